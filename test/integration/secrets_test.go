package integration

import (
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestPostgresSecretsNeverPrinted runs every command of the binary (run,
// status, setup, drop) with PostgreSQL connection strings whose password
// (Secret99) or key password (Keypass77) used to survive redaction: a '#'
// in the password, sslpassword, key=value pairs, and strings that do not
// parse (a bad % escape, an invalid sslmode). It greps everything each one
// prints (stdout, stderr, logs at debug level, /metrics and /readyz) for
// either secret. The strings that parse stream an event, and fail against
// a closed port with retry warnings; those that do not parse are refused
// at once, exit 2, with the fix named.
func TestPostgresSecretsNeverPrinted(t *testing.T) {
	if pgCluster == nil {
		t.Skip("needs the throwaway cluster, which trusts local connections whatever the password")
	}
	e := newEnv(t)
	u, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	host, port, db := u.Hostname(), u.Port(), strings.TrimPrefix(u.Path, "/")
	if u.User.Username() != "postgres" || u.RawQuery != "sslmode=disable" {
		t.Fatalf("unexpected test database URL %s", e.url)
	}
	target := fmt.Sprintf("postgres@%s:%s/%s", host, port, db)
	closed := closedPort(t)

	noSecret := func(t *testing.T, what, out string) {
		t.Helper()
		for _, s := range []string{"Secret99", "Keypass77"} {
			if strings.Contains(out, s) {
				t.Errorf("%s shows the secret %s:\n%s", what, s, out)
			}
		}
	}
	// runCmd runs one command to its end and returns what it printed.
	runCmd := func(t *testing.T, limit time.Duration, args ...string) (string, int) {
		t.Helper()
		out, code, elapsed, exited := runBounded(t, limit, nil, args...)
		if !exited {
			t.Fatalf("%s did not exit within %s", args[0], limit)
		}
		t.Logf("%s: exit %d after %s", args[0], code, elapsed.Round(time.Millisecond))
		return out, code
	}

	c := e.consume()
	for i, tc := range []struct{ name, format string }{
		{"hash in the password", "postgres://postgres:ab#Secret99@%s:%s/%s?sslmode=disable"},
		{"sslpassword", "postgres://postgres:Secret99@%s:%s/%s?sslmode=disable&sslpassword=Keypass77"},
		{"key=value", "host=%s port=%s user=postgres password=Secret99 sslpassword=Keypass77 dbname=%s sslmode=disable"},
	} {
		conn := fmt.Sprintf(tc.format, host, port, db)
		// Not subtests: the env's helpers fail the test that made it.
		t.Logf("== %s", tc.name)
		func() {
			metricsAddr := fmt.Sprintf("127.0.0.1:%d", closedPort(t))
			args := withFlag(withFlag(withFlag(e.args(), "--pg-url", conn), "--log-level", "debug"), "--metrics-addr", metricsAddr)
			p := startProc(t, nil, args...)
			e.waitSlotActive(p)
			e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('s', 'k', 'T', '{}')`)
			c.waitIDs(i+1, 60*time.Second)
			for _, path := range []string{"/metrics", "/readyz"} {
				resp, err := http.Get("http://" + metricsAddr + path)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				noSecret(t, path, string(body))
			}
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
			if code, _, ok := p.wait(60 * time.Second); !ok || code != 0 {
				t.Errorf("run: SIGTERM: exit %d (exited %v), want 0", code, ok)
			}
			out := p.out.String()
			noSecret(t, "run", out)
			if !strings.Contains(out, target) {
				t.Errorf("run does not name the target %s:\n%s", target, out)
			}

			out, code := runCmd(t, 30*time.Second, "status", "--pg-url", conn, "--slot", e.name)
			noSecret(t, "status", out)
			if code != 0 {
				t.Errorf("status: exit %d:\n%s", code, out)
			}
			out, code = runCmd(t, 30*time.Second, "setup", "--pg-url", conn, "--slot", e.name, "--publication", e.name, "--log-level", "debug")
			noSecret(t, "setup", out)
			if code != 0 {
				t.Errorf("setup: exit %d:\n%s", code, out)
			}
			out, code = runCmd(t, 30*time.Second, "drop", "--pg-url", conn, "--slot", e.name, "--log-level", "debug")
			noSecret(t, "drop", out)
			if code != 0 || !strings.Contains(out, "dropped slot") {
				t.Errorf("drop: exit %d:\n%s", code, out)
			}

			// Unreachable: retry warnings, the final error, status's error.
			down := strings.NewReplacer(":"+port+"/", fmt.Sprintf(":%d/", closed), "port="+port+" ", fmt.Sprintf("port=%d ", closed)).Replace(conn)
			if down == conn {
				t.Fatalf("cannot point %s at another port", conn)
			}
			out, code = runCmd(t, 45*time.Second, withFlag(withFlag(withFlag(e.args(), "--pg-url", down), "--log-level", "debug"), "--startup-timeout", "2s")...)
			noSecret(t, "run against a closed port", out)
			if code == 0 || !strings.Contains(out, "gave up") {
				t.Errorf("run against a closed port: exit %d, want it to give up:\n%s", code, out)
			}
			out, code = runCmd(t, 30*time.Second, "status", "--pg-url", down, "--slot", e.name)
			noSecret(t, "status against a closed port", out)
			if code == 0 || !strings.Contains(out, fmt.Sprintf("postgres@%s:%d/%s", host, closed, db)) {
				t.Errorf("status against a closed port: exit %d, want an error naming the target:\n%s", code, out)
			}
		}()
	}

	unparseable := map[string]string{
		"bad percent escape": fmt.Sprintf("postgres://postgres:ab%%zzSecret99@%s:%s/%s?sslmode=disable", host, port, db),
		"invalid sslmode":    fmt.Sprintf("postgres://postgres@%s:%s/%s?sslmode=bogus&password=Secret99&sslpassword=Keypass77", host, port, db),
		"key=value":          fmt.Sprintf("host=%s port=%s user=postgres password='Secret99 x' sslpassword=Keypass77 dbname=%s sslmode=bogus", host, port, db),
	}
	for name, conn := range unparseable {
		t.Run("unparseable, "+name, func(t *testing.T) {
			for _, args := range [][]string{
				withFlag(withFlag(e.args(), "--pg-url", conn), "--startup-timeout", "2m"),
				{"status", "--pg-url", conn, "--slot", e.name},
				{"setup", "--pg-url", conn, "--slot", e.name, "--publication", e.name},
				{"drop", "--pg-url", conn, "--slot", e.name},
			} {
				// At once: well within --startup-timeout, no connection tried.
				out, code := runCmd(t, 10*time.Second, args...)
				noSecret(t, args[0], out)
				// A malformed flag, like every other: exit 80.
				if code != 80 {
					t.Errorf("%s: exit %d, want 80", args[0], code)
				}
				if final := finalLines(out); !strings.Contains(final, "does not parse") || !strings.Contains(final, "PGPASSWORD") {
					t.Errorf("%s: the error does not say the URL does not parse and how to fix it:\n%s", args[0], final)
				}
			}
		})
	}
}

// TestPostgresDefaultSSLModeRefusesPlaintext: without sslmode the relay
// requires verified TLS, so a server without TLS (the test cluster) is
// refused at once, naming the fix, rather than used in plaintext.
func TestPostgresDefaultSSLModeRefusesPlaintext(t *testing.T) {
	if pgCluster == nil {
		t.Skip("needs the throwaway cluster (TLS off)")
	}
	e := newEnv(t)
	noMode := strings.Replace(e.url, "?sslmode=disable", "", 1)
	if noMode == e.url {
		t.Fatalf("cannot drop sslmode from %s", e.url)
	}
	out, code, elapsed, exited := runBounded(t, 20*time.Second, []string{"PGSSLMODE="}, withFlag(withFlag(e.args(), "--pg-url", noMode), "--startup-timeout", "2m")...)
	if !exited || code == 0 {
		t.Fatalf("exit %d after %s (exited by itself: %v); want a refusal at once\n%s", code, elapsed, exited, out)
	}
	if final := finalLines(out); !strings.Contains(final, "does not accept TLS") || !strings.Contains(final, "sslmode=disable") {
		t.Errorf("the error does not say the server has no TLS and how to opt out:\n%s", final)
	}
}
