package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"golang.org/x/crypto/bcrypt"
)

func startHTTP(t *testing.T, o httpOptions) string {
	t.Helper()
	o.Addr = "127.0.0.1:0"
	addr, stop, err := serveHTTP(o, prometheus.NewRegistry(), func() error { return nil }, nil, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return addr
}

// TestMetricsServerClosesIdleConnections: a keep-alive connection that
// sends nothing after its request is closed by the server once the idle
// timeout passes, so idle clients cannot hold descriptors forever.
func TestMetricsServerClosesIdleConnections(t *testing.T) {
	const idle = 300 * time.Millisecond
	addr := startHTTP(t, httpOptions{IdleTimeout: idle})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Close {
		t.Fatalf("status %d, close %v: want a kept-alive 200", resp.StatusCode, resp.Close)
	}
	// The read ends when the server closes the connection; the deadline
	// only bounds a failing test.
	start := time.Now()
	_ = c.SetReadDeadline(time.Now().Add(20 * idle))
	_, err = br.ReadByte()
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the idle connection was still open after %s (idle timeout %s)", time.Since(start).Round(time.Millisecond), idle)
	}
	if !errors.Is(err, io.EOF) {
		t.Fatalf("read on the idle connection: %v, want EOF (closed by the server)", err)
	}
	t.Logf("closed after %s", time.Since(start).Round(time.Millisecond))
}

// TestMetricsServerBasicAuth: with a --web-config-file holding
// basic_auth_users, a scrape without credentials is refused (401) and one
// with them is served.
func TestMetricsServerBasicAuth(t *testing.T) {
	hash, err := bcrypt.GenerateFromPassword([]byte("scrape-pass"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(t.TempDir(), "web.yml")
	if err := os.WriteFile(cfg, []byte("basic_auth_users:\n  prometheus: "+string(hash)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := startHTTP(t, httpOptions{WebConfigFile: cfg})
	get := func(user, pass string) int {
		req, _ := http.NewRequest("GET", "http://"+addr+"/metrics", nil)
		if user != "" {
			req.SetBasicAuth(user, pass)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get("", ""); code != http.StatusUnauthorized {
		t.Errorf("scrape without credentials: %d, want 401", code)
	}
	if code := get("prometheus", "wrong"); code != http.StatusUnauthorized {
		t.Errorf("scrape with a wrong password: %d, want 401", code)
	}
	if code := get("prometheus", "scrape-pass"); code != http.StatusOK {
		t.Errorf("scrape with credentials: %d, want 200", code)
	}
}

// TestMetricsServerRefusesABadWebConfig: a web config file that does not
// load stops the start, rather than serving without the protection it
// asked for.
func TestMetricsServerRefusesABadWebConfig(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "web.yml")
	if err := os.WriteFile(cfg, []byte("tls_server_config:\n  cert_file: /nonexistent.pem\n  key_file: /nonexistent-key.pem\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err := serveHTTP(httpOptions{Addr: "127.0.0.1:0", WebConfigFile: cfg}, prometheus.NewRegistry(), func() error { return nil }, nil, zap.NewNop())
	if err == nil {
		t.Fatal("a web config with missing certificate files was accepted")
	}
}

// TestMetricsServerTimeouts pins the limits that keep slow or idle
// clients from holding the listener.
func TestMetricsServerTimeouts(t *testing.T) {
	s := newHTTPServer(httpOptions{}, http.NewServeMux())
	if s.ReadHeaderTimeout == 0 || s.ReadTimeout == 0 || s.WriteTimeout == 0 || s.IdleTimeout == 0 || s.MaxHeaderBytes == 0 || s.MaxHeaderBytes > 1<<16 {
		t.Errorf("server limits: header %s, read %s, write %s, idle %s, max header bytes %d", s.ReadHeaderTimeout, s.ReadTimeout, s.WriteTimeout, s.IdleTimeout, s.MaxHeaderBytes)
	}
}
