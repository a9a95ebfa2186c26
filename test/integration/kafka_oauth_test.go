package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/test/kafkacluster"
	"github.com/walrelay/walrelay/test/keycloak"
)

// oauthArgs are e.args() on the broker's OAUTHBEARER listener with the
// client-credentials flags (the secret goes in the environment).
func (e *env) oauthArgs(clientID string, extra ...string) []string {
	args := withFlag(e.args(), "--brokers", strings.Join(apache.OAuthAddrs(), ","))
	args = append(args, "--kafka-sasl-mechanism", "oauthbearer", "--kafka-oauth-token-url", testIssuer().tokenURL(),
		"--kafka-oauth-client-id", clientID, "--kafka-oauth-scope", "kafka")
	return append(args, extra...)
}

// TestKafkaOAuthTokenRefresh runs the relay binary, exactly-once, on Apache
// Kafka's OAUTHBEARER listener, whose own OIDC validator checks each
// token's RS256 signature (against the test issuer's JWKS), issuer,
// audience and expiry, and ends each session when its token expires
// (connections.max.reauth.ms): tokens live 8 seconds and rows are written
// for about 25 seconds. The relay streams throughout, getting a new token
// several times, re-authenticating its open connections (KIP-368) rather
// than reconnecting (the connections to the listener stay few), never
// restarting; read_committed reads each row exactly once; the secret
// appears nowhere in its output.
func TestKafkaOAuthTokenRefresh(t *testing.T) {
	needApache(t)
	const secret = "oauth-S3cret-refresh"
	c := testIssuer().client("relay-refresh", secret, 8*time.Second)
	e := newEnv(t) // its brokers stay PLAINTEXT: the test's own clients
	rc := e.consumeIsolated(true)
	p := startProc(t, []string{"WALRELAY_KAFKA_OAUTH_CLIENT_SECRET=" + secret},
		e.oauthArgs("relay-refresh", "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic())...)
	e.waitSlotActive(p)

	port := apache.Node(1).OAuthPort
	seen := map[string]bool{}
	sample := func() {
		conns, err := connsTo(port)
		if err != nil {
			t.Fatal(err)
		}
		for k := range conns {
			seen[k] = true
		}
	}
	start := time.Now()
	// About 25 seconds of writing (2 × 250 rows, 100ms apart): an idle
	// producer sends nothing, so has nothing to re-authenticate.
	wr := e.startWriters(2, 0, 250, 100*time.Millisecond)
	for !wrDone(wr) || time.Since(start) < 25*time.Second {
		sample()
		if exited(p) {
			t.Fatalf("the relay exited while tokens expired: %v\n%s", p.err, lastLines(p.out.String(), 5))
		}
		time.Sleep(100 * time.Millisecond) // the sampling period of the connections, not a wait for a condition
	}
	wr.wait(t)
	_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	sample()
	checkRunning(t, p, "the relay")
	out := p.out.String()
	issued := c.issued.Load()
	t.Logf("%d rows in %s; %d tokens issued; %d connections to the OAUTHBEARER listener seen", n, time.Since(start).Round(time.Second), issued, len(seen))
	// At least one refresh: the first token expired 8 seconds in, and the
	// relay went on producing without a restart (checked below), so it
	// re-authenticated with a new one. How many more depends on when the
	// client re-authenticates, which a busy machine shifts.
	if issued < 2 {
		t.Errorf("%d tokens issued over %s of 8-second tokens: the relay did not refresh them", issued, time.Since(start).Round(time.Second))
	}
	// A client of one broker holds a handful of connections (metadata,
	// produce, the transaction coordinator); one that reconnected at each
	// expiry would show several more per token.
	if len(seen) > 8 {
		t.Errorf("%d connections to the OAUTHBEARER listener over the run: the relay reconnected instead of re-authenticating", len(seen))
	}
	if strings.Contains(out, "relay restarting") {
		t.Errorf("the relay restarted while tokens expired:\n%s", lastLines(out, 5))
	}
	if strings.Contains(out, secret) {
		t.Error("the client secret appears in the relay's output")
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	if code, _, ok := p.wait(60 * time.Second); !ok || code != 0 {
		t.Errorf("SIGTERM: exit %d (exited %v), want 0", code, ok)
	}
}

// TestKafkaOAuthTokenFile: with --kafka-oauth-token-file the relay sends
// the token the file holds, read again once the previous one nears its
// expiry: the file is rewritten every 3 seconds with a token of 6, and an
// event written after several rotations arrives.
func TestKafkaOAuthTokenFile(t *testing.T) {
	needApache(t)
	e := newEnv(t)
	c := e.consume()
	file := filepath.Join(t.TempDir(), "token")
	iss := testIssuer()
	rotate := func() {
		if err := os.WriteFile(file+".tmp", []byte(iss.sign("relay-file", oidcAudience, "", 6*time.Second)), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(file+".tmp", file); err != nil { // as the kubelet does: whole files only
			t.Fatal(err)
		}
	}
	rotate()
	args := append(withFlag(e.args(), "--brokers", strings.Join(apache.OAuthAddrs(), ",")),
		"--kafka-sasl-mechanism", "oauthbearer", "--kafka-oauth-token-file", file)
	p := startProc(t, nil, args...)
	e.waitSlotActive(p)
	start := time.Now()
	for i := 0; time.Since(start) < 15*time.Second; i++ {
		e.exec(fmt.Sprintf(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('f', 'k', 'T', '{"n": %d}')`, i))
		time.Sleep(3 * time.Second) // the agent's rotation period
		rotate()
	}
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('f', 'k', 'T', '{"last": true}')`)
	e.waitFor("the last event", 60*time.Second, func() (bool, error) {
		for _, r := range c.records() {
			if string(r.Value) == `{"last": true}` {
				return true, nil
			}
		}
		return false, fmt.Errorf("relay output:\n%s", lastLines(p.out.String(), 3))
	})
	checkRunning(t, p, "the relay")
	if strings.Contains(p.out.String(), "relay restarting") {
		t.Errorf("the relay restarted while the token file rotated:\n%s", lastLines(p.out.String(), 5))
	}
}

// TestKafkaOAuthRefusals: a wrong client secret, an unreachable token
// endpoint and a token for an audience the broker does not accept each
// stop the relay with exit 2 and a last line naming which, without the
// secret, and without a line per retry.
func TestKafkaOAuthRefusals(t *testing.T) {
	needApache(t)
	const secret = "oauth-S3cret-refusals"
	testIssuer().client("relay-refusals", secret, time.Minute)
	e := newEnv(t)
	for _, tc := range []struct {
		name   string
		secret string
		extra  []string
		want   []string
	}{
		{"wrong secret", "wr0ng-S3cret", nil, []string{"--kafka-oauth-token-url", "invalid_client", "--kafka-oauth-client-id"}},
		{"unreachable token endpoint", secret, []string{"--kafka-oauth-token-url", fmt.Sprintf("http://127.0.0.1:%d/token", closedPort(t))}, []string{"cannot reach", "--kafka-oauth-token-url"}},
		{"audience refused by the broker", secret, []string{"--kafka-oauth-audience", "another-cluster"}, []string{"SASL_AUTHENTICATION_FAILED", "--kafka-oauth-audience", "sasl.oauthbearer.expected.audience"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := withFlag(e.oauthArgs("relay-refusals", tc.extra...), "--startup-timeout", "10s")
			if tc.extra != nil && tc.extra[0] == "--kafka-oauth-token-url" {
				args = withFlag(e.oauthArgs("relay-refusals"), "--kafka-oauth-token-url", tc.extra[1])
				args = withFlag(args, "--startup-timeout", "10s")
			}
			p := startProc(t, []string{"WALRELAY_KAFKA_OAUTH_CLIENT_SECRET=" + tc.secret}, args...)
			code, elapsed, ok := p.wait(60 * time.Second)
			out := p.out.String()
			last := lastLines(out, 1)
			t.Logf("exit %d after %s: %s", code, elapsed.Round(time.Millisecond), last)
			// A token endpoint that cannot be reached may come back: the
			// relay retries it until --startup-timeout (exit 4); a refusal
			// is a configuration to fix (exit 2).
			want := 2
			if tc.name == "unreachable token endpoint" {
				want = 4
			}
			if !ok || code != want {
				t.Fatalf("exit %d (exited by itself: %v), want %d:\n%s", code, ok, want, lastLines(out, 5))
			}
			for _, w := range tc.want {
				if !strings.Contains(last, w) {
					t.Errorf("the last line does not name %q: %s", w, last)
				}
			}
			if strings.Contains(out, tc.secret) {
				t.Error("the secret appears in the output")
			}
			// The relay logs each retry (a "relay restarting" line, with
			// its backoff); the source says once why it has no token, and
			// the Kafka client's line at every attempt is dropped.
			if n := strings.Count(out, "unable to initialize sasl"); n > 1 {
				t.Errorf("%d lines of the Kafka client about the failed authentication, want at most 1", n)
			}
			if n := strings.Count(out, "token unavailable"); n > 1 {
				t.Errorf("%d WARN lines from the token source, want at most 1", n)
			}
		})
	}
}

// TestKafkaOAuthTokenEndpointHangs: the relay streams exactly-once on
// Apache Kafka's OAUTHBEARER listener with tokens of 12 seconds under a
// steady trickle of rows, and the token endpoint, just after issuing one,
// takes every request and answers none (as a SIGSTOPped identity
// provider): see tokenEndpointHangs. TestKafkaOAuthKeycloakHangs runs the
// same with Keycloak, stopped by SIGSTOP.
func TestKafkaOAuthTokenEndpointHangs(t *testing.T) {
	needApache(t)
	const secret = "oauth-S3cret-hang"
	c := testIssuer().client("relay-hang", secret, 12*time.Second)
	e := newEnv(t)
	e.tokenEndpointHangs(hungEndpoint{url: testIssuer().tokenURL(), life: 12 * time.Second, hang: c.hang, issued: c.issued.Load},
		[]string{"WALRELAY_KAFKA_OAUTH_CLIENT_SECRET=" + secret}, secret, e.oauthArgs("relay-hang")...)
}

// hungEndpoint is a token endpoint that a test makes hang.
type hungEndpoint struct {
	url  string
	life time.Duration // its tokens'
	// hang makes it take requests and answer none until release.
	hang func() (release func())
	// issued counts the tokens it gave; nil when it cannot be told.
	issued func() int64
}

// tokenEndpointHangs runs the relay (args, with env; secret must appear
// nowhere in its output) exactly-once under a steady trickle of rows and
// makes ep hang, just after it issued a token when it can tell. Delivery
// goes on on the cached token; the relay says so once, at WARN, naming the
// endpoint and when the token truly expires; once the token is spent,
// /readyz (relay.Ready) names the token source (token_source,
// NotAnswering, the endpoint) rather than a connection or a lag; when the
// endpoint answers again, delivery resumes by itself, and every row is
// read exactly once.
func (e *env) tokenEndpointHangs(ep hungEndpoint, env []string, secret string, args ...string) {
	t := e.t
	t.Helper()
	rc := e.consumeIsolated(true)
	addr := freeAddr(t)
	p := startProc(t, env, append(args, "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic(), "--metrics-addr", addr)...)
	e.waitSlotActive(p)
	seq := 0
	insert := func(phase string) string {
		v := fmt.Sprintf(`{"phase": %q}`, phase)
		seq++ // the commit order of key k, which the exactly-once check reads
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('h', 'k', 'T', $1, $2)`, v, seq)
		return v
	}
	arrived := func(v string) func() (bool, error) {
		return func() (bool, error) {
			for _, r := range rc.records() {
				if string(r.Value) == v {
					return true, nil
				}
			}
			return false, fmt.Errorf("relay output:\n%s", lastLines(p.out.String(), 3))
		}
	}
	e.waitFor("the first event", time.Minute, arrived(insert("before")))
	// A steady trickle of rows until the end, as a busy outbox: an idle
	// producer sends nothing to re-authenticate.
	stopTrickle, trickled := make(chan struct{}), make(chan error, 1)
	go func() { trickled <- e.trickle(stopTrickle) }()

	if ep.issued != nil {
		// Hang just after a refresh: the relay holds a fresh token.
		n := ep.issued()
		e.waitFor("a token refresh", 2*ep.life, func() (bool, error) { return ep.issued() > n, nil })
	}
	release := ep.hang()
	t.Cleanup(release)
	hungAt := time.Now()
	e.waitFor("an event written after the token endpoint hung", time.Minute, arrived(insert("on the cached token")))
	deliveredIn := time.Since(hungAt)

	var body string
	e.waitFor("/readyz naming the token source", ep.life+time.Minute, func() (bool, error) {
		code, b := readyzBody(addr)
		body = b
		return code == 503 && strings.Contains(b, "token_source"), fmt.Errorf("/readyz %d: %s", code, b)
	})
	heldIn := time.Since(hungAt)
	t.Logf("endpoint hung: an event delivered %s after, /readyz 503 %s after: %s", deliveredIn.Round(time.Millisecond), heldIn.Round(time.Millisecond), strings.TrimSpace(body))
	if deliveredIn > heldIn {
		t.Errorf("the event written after the hang arrived %s after it, once readiness already named the token source (%s): delivery did not go on on the cached token", deliveredIn, heldIn)
	}
	for _, want := range []string{"token_source (NotAnswering", ep.url, "no valid OAUTHBEARER token"} {
		if !strings.Contains(body, want) {
			t.Errorf("/readyz does not name %q: %s", want, body)
		}
	}
	held := insert("while held")

	// One WARN from the token source, naming the endpoint, with an
	// expiry that was still ahead when it was logged.
	warns := logLines(p.out.String(), "warn", "kafka OAUTHBEARER token")
	if len(warns) != 1 {
		t.Errorf("%d WARN lines from the token source, want 1:\n%v", len(warns), warns)
	}
	for _, w := range warns {
		at, err1 := time.Parse(logTime, fmt.Sprint(w["time"]))
		exp, err2 := time.Parse(logTime, fmt.Sprint(w["expires"]))
		if err1 != nil || err2 != nil || !exp.After(at) {
			t.Errorf("the WARN at %v says the token expires %v: want the true expiry, still ahead", w["time"], w["expires"])
		}
		if !strings.Contains(fmt.Sprint(w["error"]), ep.url) || w["reason"] != "NotAnswering" {
			t.Errorf("the WARN does not name the endpoint and NotAnswering: %v", w)
		}
	}

	release()
	releasedAt := time.Now()
	e.waitFor("the event written while the token source held delivery", 2*time.Minute, arrived(held))
	e.waitFor("/readyz 200 again", time.Minute, func() (bool, error) {
		code, b := readyzBody(addr)
		return code == 200, fmt.Errorf("/readyz %d: %s", code, b)
	})
	t.Logf("endpoint answering again: delivery and readiness back %s after", time.Since(releasedAt).Round(time.Millisecond))
	close(stopTrickle)
	if err := <-trickled; err != nil {
		t.Fatal(err)
	}
	e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, p, "the relay")
	out := p.out.String()
	t.Logf("WARN lines of the run: %d", len(logLines(out, "warn", "")))
	for _, bad := range []string{"ILLEGAL_SASL_STATE", "DESCRIBE on the transactional id", secret} {
		if strings.Contains(out, bad) {
			t.Errorf("the relay's output holds %q:\n%s", bad, grepLines(out, bad, 3))
		}
	}
}

// trickle writes a row every 250 ms (key t, seq 1, 2, …) until stop is
// closed.
func (e *env) trickle(stop chan struct{}) error {
	conn, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	for seq := 1; ; seq++ {
		if _, err := conn.Exec(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('t', 't', 'T', jsonb_build_object('seq', $1::int), $1)`, seq); err != nil {
			return fmt.Errorf("trickle: %w", err)
		}
		select {
		case <-stop:
			return nil
		case <-time.After(250 * time.Millisecond): // the trickle's pace
		}
	}
}

// logTime is the layout of the relay's log times.
const logTime = "2006-01-02T15:04:05.000Z0700"

// readyzBody is the status code and body of a relay's /readyz (0 when it
// does not answer).
func readyzBody(addr string) (int, string) {
	cl := http.Client{Timeout: 2 * time.Second}
	resp, err := cl.Get("http://" + addr + "/readyz")
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// logLines are the relay's JSON log lines at level whose message contains
// msg.
func logLines(out, level, msg string) []map[string]any {
	var lines []map[string]any
	for _, l := range strings.Split(out, "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) != nil {
			continue
		}
		if m["level"] == level && strings.Contains(fmt.Sprint(m["msg"]), msg) {
			lines = append(lines, m)
		}
	}
	return lines
}

// TestKafkaOAuthKeycloakHangs is TestKafkaOAuthTokenEndpointHangs with
// Keycloak as the identity provider (package keycloak), in front of an
// Apache Kafka node of its own whose OAUTHBEARER validator trusts
// Keycloak's realm and ends sessions after 30 s
// (connections.max.reauth.ms), as a production broker might: tokens of
// 20 s (the behaviour scales with the lifetime; shorter would meet the
// 2-second margin's floor), Keycloak stopped by SIGSTOP just after it
// issued one, continued once readiness names the token source.
func TestKafkaOAuthKeycloakHangs(t *testing.T) {
	needApache(t)
	const secret = "keycloak-S3cret-hang"
	life := 20 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	kc, err := keycloak.Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Stop)
	realm, err := kc.AddRealm("walrelay", life, "relay", secret, oidcAudience)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Keycloak answering, with its realm, after %s", time.Since(start).Round(time.Millisecond))
	k := startApache(t, kafkacluster.Options{OAuth: &kafkacluster.OAuth{JWKSURL: realm.JWKSURL(), Issuer: realm.Issuer(), Audience: oidcAudience, MaxReauth: 30 * time.Second}})
	e := newEnv(t)
	e.brokers = k.Addrs() // the test's own clients: PLAINTEXT
	args := append(withFlag(e.args(), "--brokers", strings.Join(k.OAuthAddrs(), ",")),
		"--kafka-sasl-mechanism", "oauthbearer", "--kafka-oauth-token-url", realm.TokenURL(), "--kafka-oauth-client-id", "relay")
	issued := func() int64 {
		n, err := realm.Issued()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	hang := func() (release func()) {
		if err := kc.Hang(); err != nil {
			t.Fatal(err)
		}
		var once sync.Once
		return func() { once.Do(func() { _ = kc.Continue() }) }
	}
	e.tokenEndpointHangs(hungEndpoint{url: realm.TokenURL(), life: life, hang: hang, issued: issued},
		[]string{"WALRELAY_KAFKA_OAUTH_CLIENT_SECRET=" + secret}, secret, args...)
}
