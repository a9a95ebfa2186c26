package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
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
