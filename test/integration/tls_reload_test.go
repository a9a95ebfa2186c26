package integration

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// tlsGen is what a TLS kfake broker serves and accepts: its certificate
// and the CA its clients' certificates must come from, switched at once.
type tlsGen struct {
	server   tls.Certificate
	clientCA *x509.CertPool
	second   bool // the rotated generation
}

// TestTLSReloadKafka rotates the Kafka CA, the broker's certificate and
// the relay's client certificate while rows are written: the broker (a
// kfake with mutual TLS) switches to a certificate of a new CA and accepts
// only client certificates of that CA, the relay's files are rewritten
// (the CA file first holding both CAs), and the broker closes the relay's
// produce connection: the relay's next connection verifies the new broker
// certificate and presents the new client certificate, without a
// restart. Then a key that does not match the certificate is written: one
// WARN, the previous pair kept at the next connection. No row is lost.
func TestTLSReloadKafka(t *testing.T) {
	ca1, ca2 := newTestCA(t), newTestCA(t)
	pair := func(ca *testCA, name string, serial int64) (tls.Certificate, []byte, []byte) {
		c, k := ca.issue(t, name, serial)
		p, err := tls.X509KeyPair(c, k)
		if err != nil {
			t.Fatal(err)
		}
		return p, c, k
	}
	pool := func(ca *testCA) *x509.CertPool {
		p := x509.NewCertPool()
		p.AppendCertsFromPEM(ca.pem)
		return p
	}
	s1, _, _ := pair(ca1, "broker", 2)
	s2, _, _ := pair(ca2, "broker", 3)
	_, c1, k1 := pair(ca1, "walrelay", 4)
	_, c2, k2 := pair(ca2, "walrelay", 5)
	_, _, kOther := pair(ca2, "other", 6)

	var gen atomic.Pointer[tlsGen]
	gen.Store(&tlsGen{server: s1, clientCA: pool(ca1)})
	var newHandshakes atomic.Int64 // the relay's handshakes with its client certificate of ca2
	srvTLS := &tls.Config{
		MinVersion: tls.VersionTLS12,
		ClientAuth: tls.RequireAnyClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			c := gen.Load().server
			return &c, nil
		},
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			leaf, err := x509.ParseCertificate(raw[0])
			if err != nil {
				return err
			}
			g := gen.Load()
			if _, err := leaf.Verify(x509.VerifyOptions{Roots: g.clientCA, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
				return err
			}
			if g.second && leaf.Subject.CommonName == "walrelay" {
				newHandshakes.Add(1)
			}
			return nil
		},
	}
	e := newEnv(t)
	k, err := devcluster.StartKafka(devcluster.KafkaOptions{Extra: []kfake.Opt{kfake.TLS(srvTLS)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Close)
	dir := t.TempDir()
	caFile, certFile, keyFile := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "client.pem"), filepath.Join(dir, "client-key.pem")
	write := func(path string, b []byte) {
		t.Helper()
		if err := os.WriteFile(path+".tmp", b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".tmp", path); err != nil {
			t.Fatal(err)
		}
	}
	write(caFile, ca1.pem)
	write(certFile, c1)
	write(keyFile, k1)
	e.brokers = []string{k.Addr()}
	p := startProc(t, nil, append(e.args(), "--kafka-tls-ca", caFile, "--kafka-tls-cert", certFile, "--kafka-tls-key", keyFile)...)
	e.waitSlotActive(p)
	// The test's consumer reads the same broker, trusting both CAs and
	// presenting a client certificate of the generation in force.
	both := pool(ca1)
	both.AppendCertsFromPEM(ca2.pem)
	cc1, _, _ := pair(ca1, "consumer", 7)
	cc2, _, _ := pair(ca2, "consumer", 8)
	c := e.consumeWith(kgo.DialTLSConfig(&tls.Config{RootCAs: both, MinVersion: tls.VersionTLS12,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if gen.Load().second {
				return &cc2, nil
			}
			return &cc1, nil
		}}))

	// dropProduce closes the next produce connection: the client's next
	// connection is a new TLS handshake.
	dropProduce := func() {
		k.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
			return nil, errors.New("closing the connection"), true
		})
	}
	wr := e.startWriters(2, 0, 300, 20*time.Millisecond)
	e.waitFor("rows flowing", 30*time.Second, func() (bool, error) { return wr.rows.Load() > 50, nil })

	// Rotate: the relay trusts both CAs and holds a client certificate of
	// ca2; then the broker serves ca2's certificate and wants ca2 clients.
	write(caFile, append(append([]byte{}, ca1.pem...), ca2.pem...))
	write(certFile, c2)
	write(keyFile, k2)
	gen.Store(&tlsGen{server: s2, clientCA: pool(ca2), second: true})
	dropProduce()
	e.waitFor("a handshake with the rotated client certificate", 30*time.Second, func() (bool, error) {
		return newHandshakes.Load() > 0, nil
	})
	write(caFile, ca2.pem) // the old CA retired

	// A broken pair: the certificate of ca2 with another key.
	write(keyFile, kOther)
	before := newHandshakes.Load()
	dropProduce()
	e.waitFor("a handshake after the broken pair", 30*time.Second, func() (bool, error) {
		return newHandshakes.Load() > before, nil
	})
	wr.wait(t)
	want, total := committedRows(t, e, e.conn())
	recs := waitAllIDs(c, want, 2*time.Minute)
	checkDelivered(t, recs, want, nil)
	if lost := total - len(distinctIDs(recs)); lost != 0 {
		t.Errorf("%d of %d rows lost", lost, total)
	}
	checkRunning(t, p, "the relay")
	out := p.out.String()
	if n := strings.Count(out, "kafka TLS client certificate not reloaded"); n != 1 {
		t.Errorf("%d WARN lines for the broken pair, want 1", n)
	}
	if !strings.Contains(out, "kafka TLS client certificate reloaded") || !strings.Contains(out, "kafka TLS CA file reloaded") {
		t.Errorf("the reloads are not logged:\n%s", lastLines(out, 5))
	}
	if strings.Contains(out, "PRIVATE KEY") {
		t.Error("a key appears in the output")
	}
}

// TestTLSReloadPostgres rotates PostgreSQL's TLS material under load: the
// server gets a certificate of a new CA and asks for client certificates
// of that CA (pg_reload_conf), the relay's sslrootcert, sslcert and sslkey
// files are rewritten, and the relay's backends are ended: its
// connections come back over TLS with the new files (pgconn reads them at
// each connection), no row lost. A key that does not match its
// certificate then stops the relay at its next connection, exit 2, with
// one line naming sslkey.
func TestTLSReloadPostgres(t *testing.T) {
	if pgCluster == nil {
		t.Skip("starts a PostgreSQL cluster of its own; skipped with WALRELAY_TEST_PG_URL")
	}
	ca1, ca2 := newTestCA(t), newTestCA(t)
	srvDir, err := os.MkdirTemp("", "walrelay-pgtls-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(srvDir) })
	if err := os.Chmod(srvDir, 0o755); err != nil {
		t.Fatal(err)
	}
	uid, gid := postgresOwner(t)
	writeSrv := func(name string, b []byte) string {
		p := filepath.Join(srvDir, name)
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
	s1, sk1 := ca1.issue(t, "127.0.0.1", 2)
	srvCert, srvKey, srvCA := writeSrv("server.pem", s1), writeSrv("server-key.pem", sk1), writeSrv("client-ca.pem", ca1.pem)
	hba := hbaFile(t, "local all all trust", "hostssl all all 127.0.0.1/32 trust clientcert=verify-ca", "hostssl replication all 127.0.0.1/32 trust clientcert=verify-ca", "host all postgres 127.0.0.1/32 trust")
	e, _ := newClusterEnv(t, map[string]string{
		"ssl": "on", "ssl_cert_file": "'" + srvCert + "'", "ssl_key_file": "'" + srvKey + "'", "ssl_ca_file": "'" + srvCA + "'", "hba_file": "'" + hba + "'",
	})
	dir := t.TempDir()
	caFile, certFile, keyFile := filepath.Join(dir, "root.pem"), filepath.Join(dir, "client.pem"), filepath.Join(dir, "client-key.pem")
	write := func(path string, b []byte) {
		t.Helper()
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	c1, k1 := ca1.issue(t, "walrelay", 3)
	write(caFile, ca1.pem)
	write(certFile, c1)
	write(keyFile, k1)
	url := strings.Replace(e.url, "sslmode=disable", "sslmode=verify-full&sslrootcert="+caFile+"&sslcert="+certFile+"&sslkey="+keyFile, 1)
	c := e.consume()
	p := startProc(t, nil, append(e.args(), "--pg-url", url)...)
	e.waitSlotActive(p)
	wr := e.startWriters(2, 0, 300, 20*time.Millisecond)
	e.waitFor("rows flowing", 30*time.Second, func() (bool, error) { return wr.rows.Load() > 50, nil })

	s2, sk2 := ca2.issue(t, "127.0.0.1", 4)
	writeSrv("server.pem", s2)
	writeSrv("server-key.pem", sk2)
	writeSrv("client-ca.pem", ca2.pem)
	e.exec(`SELECT pg_reload_conf()`)
	c2, k2 := ca2.issue(t, "walrelay", 5)
	write(caFile, ca2.pem)
	write(certFile, c2)
	write(keyFile, k2)
	kickRelay := func() {
		e.exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE 'walrelay%' AND pid <> pg_backend_pid()`)
	}
	restarts := strings.Count(p.out.String(), "relay restarting")
	kickRelay()
	e.waitFor("the relay back after the rotation", 60*time.Second, func() (bool, error) {
		return strings.Count(p.out.String(), "relay restarting") > restarts, nil
	})
	e.waitSlotActive(p)
	wr.wait(t)
	want, total := committedRows(t, e, e.conn())
	recs := waitAllIDs(c, want, 2*time.Minute)
	checkDelivered(t, recs, want, nil)
	if lost := total - len(distinctIDs(recs)); lost != 0 {
		t.Errorf("%d of %d rows lost", lost, total)
	}
	var onTLS int
	if err := e.conn().QueryRow(e.ctx, `SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
		WHERE a.backend_type = 'walsender' AND s.ssl AND s.client_dn LIKE '%walrelay%' AND s.issuer_dn = $1`, "/CN=walrelay test CA").Scan(&onTLS); err != nil {
		t.Fatal(err)
	}
	if onTLS != 1 {
		t.Errorf("%d walsenders over TLS with a client certificate, want 1", onTLS)
	}

	_, kOther := ca2.issue(t, "other", 6)
	write(keyFile, kOther)
	kickRelay()
	code, elapsed, exited := p.wait(60 * time.Second)
	last := lastLines(p.out.String(), 1)
	t.Logf("broken pair: exit %d after %s: %s", code, elapsed.Round(time.Millisecond), last)
	if !exited || code != 2 || !strings.Contains(last, "sslkey") {
		t.Errorf("a mismatched sslkey: exit %d (by itself: %v), last line %s; want 2 naming sslkey", code, exited, last)
	}
	if strings.Contains(p.out.String(), "PRIVATE KEY") {
		t.Error("a key appears in the output")
	}
}

// postgresOwner is the uid and gid the server's files must belong to when
// the tests run as root (the server runs as postgres), else -1, -1.
func postgresOwner(t *testing.T) (int, int) {
	t.Helper()
	if os.Geteuid() != 0 {
		return -1, -1
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return uid, gid
}
