package integration

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// testCA is a throwaway certificate authority issuing server and client
// certificates for 127.0.0.1.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "walrelay test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a certificate and key (PEM) for name, usable by servers
// and clients.
func (ca *testCA) issue(t *testing.T, name string, serial int64) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

// TestKafkaTLS runs the relay against a TLS-only kfake broker: with the
// CA it delivers; with client-certificate authentication required it
// delivers only when given a certificate; without the CA (the system roots
// do not know this one) it refuses at once with a certificate error.
func TestKafkaTLS(t *testing.T) {
	ca := newTestCA(t)
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	caFile := write("ca.pem", ca.pem)
	srvCert, srvKey := ca.issue(t, "broker", 2)
	cliCert, cliKey := ca.issue(t, "walrelay", 3)
	certFile, keyFile := write("client.pem", cliCert), write("client-key.pem", cliKey)
	serverPair, err := tls.X509KeyPair(srvCert, srvKey)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.pem)

	for _, tc := range []struct {
		name     string
		mutual   bool
		args     []string
		delivers bool
		errText  string
	}{
		{"server verified with --kafka-tls-ca", false, []string{"--kafka-tls-ca", caFile}, true, ""},
		{"mutual TLS with a client certificate", true, []string{"--kafka-tls-ca", caFile, "--kafka-tls-cert", certFile, "--kafka-tls-key", keyFile}, true, ""},
		{"mutual TLS without a client certificate", true, []string{"--kafka-tls-ca", caFile, "--startup-timeout", "5s"}, false, ""},
		{"unknown CA", false, []string{"--kafka-tls"}, false, "certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			srv := &tls.Config{Certificates: []tls.Certificate{serverPair}, MinVersion: tls.VersionTLS12}
			if tc.mutual {
				srv.ClientAuth, srv.ClientCAs = tls.RequireAndVerifyClientCert, pool
			}
			k, err := devcluster.StartKafka(devcluster.KafkaOptions{Extra: []kfake.Opt{kfake.TLS(srv)}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(k.Close)
			e.brokers = []string{k.Addr()}
			p := startProc(t, nil, append(e.args(), tc.args...)...)
			if !tc.delivers {
				code, elapsed, exited := p.wait(45 * time.Second)
				if !exited || code == 0 {
					t.Fatalf("exit %d after %s (exited by itself: %v); want a non-zero exit\n%s", code, elapsed, exited, p.out.String())
				}
				if tc.errText != "" && !strings.Contains(finalLines(p.out.String()), tc.errText) {
					t.Errorf("error does not mention %q:\n%s", tc.errText, finalLines(p.out.String()))
				}
				return
			}
			e.waitFor("slot active", 30*time.Second, func() (bool, error) {
				i, err := e.slotInfoErr()
				return err == nil && i.Active, err
			})
			e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('tls', 'k', 'T', '{"secure": true}')`)
			cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.ConsumeTopics(e.topic("tls")),
				kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
				kgo.DialTLSConfig(&tls.Config{RootCAs: pool, Certificates: clientPair(t, cliCert, cliKey), MinVersion: tls.VersionTLS12}))
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			e.waitFor("the event over TLS", 60*time.Second, func() (bool, error) {
				ctx, cancel := context.WithTimeout(e.ctx, time.Second)
				defer cancel()
				fs := cl.PollRecords(ctx, 10)
				var got string
				fs.EachRecord(func(r *kgo.Record) { got = string(r.Value) })
				return got == `{"secure": true}`, fmt.Errorf("read %q (%v); relay output:\n%s", got, fs.Err(), p.out.String())
			})
		})
	}
}

func clientPair(t *testing.T, certPEM, keyPEM []byte) []tls.Certificate {
	t.Helper()
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return []tls.Certificate{pair}
}

// TestPostgresTLS starts a PostgreSQL cluster with TLS on and runs the
// relay with sslmode=verify-full in --pg-url: it delivers, and both of its
// connections to the server (the replication connection included) use TLS
// (pg_stat_ssl). With a CA that did not sign the server's certificate, or
// without sslmode (walrelay then verifies, and the system roots do not
// know the test CA), it refuses to start at once with a certificate error;
// sslmode=require runs, with a warning in the log.
func TestPostgresTLS(t *testing.T) {
	if pgCluster == nil {
		t.Skip("starts a PostgreSQL cluster of its own; skipped with WALRELAY_TEST_PG_URL")
	}
	ca, other := newTestCA(t), newTestCA(t)
	// The server reads its key as the postgres account: a directory it can
	// enter, files it owns, the key private to it.
	dir, err := os.MkdirTemp("", "walrelay-pgtls-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	uid, gid := -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatal(err)
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if uid >= 0 {
			if err := os.Chown(p, uid, gid); err != nil {
				t.Fatal(err)
			}
		}
		return p
	}
	srvCert, srvKey := ca.issue(t, "127.0.0.1", 2)
	certFile, keyFile := write("server.pem", srvCert), write("server-key.pem", srvKey)
	caFile, otherCAFile := write("ca.pem", ca.pem), write("other-ca.pem", other.pem)
	pg, err := devcluster.StartPostgres(context.Background(), devcluster.PostgresOptions{Settings: map[string]string{
		"ssl": "on", "ssl_cert_file": "'" + certFile + "'", "ssl_key_file": "'" + keyFile + "'",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })

	tlsURL := func(e *env, ca string) string {
		u := strings.Replace(e.url, "sslmode=disable", "sslmode=verify-full&sslrootcert="+ca, 1)
		if u == e.url {
			t.Fatalf("cannot make a TLS URL of %s", e.url)
		}
		return u
	}

	t.Run("verify-full with the server's CA", func(t *testing.T) {
		e := newEnvOn(t, pg.URL("postgres"))
		p := startProc(t, nil, append(e.args(), "--pg-url", tlsURL(e, caFile))...)
		c := e.consume()
		e.waitFor("slot active", 30*time.Second, func() (bool, error) {
			i, err := e.slotInfoErr()
			return err == nil && i.Active, err
		})
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('tls', 'k', 'T', '{"secure": true}')`)
		c.waitIDs(1, 60*time.Second)
		if got := string(c.records()[0].Value); got != `{"secure": true}` {
			t.Errorf("value %q", got)
		}
		// The walsender's connection, and the relay's other connection
		// (slot polling) to the database, run over TLS.
		var repl, plain int
		err := e.conn().QueryRow(e.ctx, `
			SELECT count(*) FILTER (WHERE a.backend_type = 'walsender' AND s.ssl),
			       count(*) FILTER (WHERE NOT s.ssl AND a.application_name LIKE 'walrelay%')
			FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
			WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()`).Scan(&repl, &plain)
		if err != nil {
			t.Fatal(err)
		}
		if repl != 1 {
			t.Errorf("%d walsenders of this database use TLS, want 1 (relay output:\n%s)", repl, lastLines(p.out.String(), 3))
		}
		if plain != 0 {
			t.Errorf("%d walrelay connections without TLS", plain)
		}
		checkRunning(t, p, "the relay")
	})

	// Without sslmode walrelay verifies (verify-full), where pgx would
	// prefer TLS without verification: a certificate from a CA the system
	// roots do not know is refused at once.
	t.Run("no sslmode, server certificate not trusted", func(t *testing.T) {
		e := newEnvOn(t, pg.URL("postgres"))
		noMode := strings.Replace(e.url, "?sslmode=disable", "", 1)
		if noMode == e.url {
			t.Fatalf("cannot drop sslmode from %s", e.url)
		}
		p := startProc(t, []string{"PGSSLMODE="}, append(e.args(), "--pg-url", noMode, "--startup-timeout", "2m")...)
		code, elapsed, exited := p.wait(20 * time.Second)
		if !exited || code == 0 {
			t.Fatalf("exit %d after %s (exited by itself: %v); want a non-zero exit at once\n%s", code, elapsed, exited, p.out.String())
		}
		if out := finalLines(p.out.String()); !strings.Contains(out, "certificate") {
			t.Errorf("the error does not mention the certificate:\n%s", out)
		}
	})

	// An explicit weaker mode is honoured, with a warning naming the risk.
	t.Run("sslmode=require runs with a warning", func(t *testing.T) {
		e := newEnvOn(t, pg.URL("postgres"))
		p := startProc(t, nil, append(e.args(), "--pg-url", strings.Replace(e.url, "sslmode=disable", "sslmode=require", 1))...)
		e.waitSlotActive(p)
		checkRunning(t, p, "the relay")
		var warned bool
		for _, l := range strings.Split(p.out.String(), "\n") {
			if strings.Contains(l, `"level":"warn"`) && strings.Contains(l, "sslmode=require") && strings.Contains(l, "does not verify") {
				warned = true
			}
		}
		if !warned {
			t.Errorf("no warning about sslmode=require in the log:\n%s", p.out.String())
		}
	})

	t.Run("verify-full with another CA", func(t *testing.T) {
		e := newEnvOn(t, pg.URL("postgres"))
		// A certificate that does not verify is refused at once, not
		// retried until --startup-timeout.
		p := startProc(t, nil, append(e.args(), "--pg-url", tlsURL(e, otherCAFile), "--startup-timeout", "2m")...)
		code, elapsed, exited := p.wait(20 * time.Second)
		if !exited || code == 0 {
			t.Fatalf("exit %d after %s (exited by itself: %v); want a non-zero exit at once\n%s", code, elapsed, exited, p.out.String())
		}
		if out := finalLines(p.out.String()); !strings.Contains(out, "certificate") {
			t.Errorf("the error does not mention the certificate:\n%s", out)
		}
	})
}
