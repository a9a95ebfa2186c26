package kafkaauth

// The token cache's timing against a clock and a token source the tests
// drive by hand: a refresh at 80% of a token's life that nobody asks for,
// a token endpoint that takes a request and never answers, an expired
// token never handed out, one WARN with the true expiry, the hold and its
// clear.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// bound is how long a test waits for something that must happen before
// it calls it a failure; nothing waits it out when all goes well.
const bound = 10 * time.Second

// fakeClock is time that moves only when the test says.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []fakeTimer
	armed  chan struct{} // a timer was set
}

type fakeTimer struct {
	at time.Time
	ch chan time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Unix(1_000_000, 0), armed: make(chan struct{}, 1)}
}

func (f *fakeClock) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

func (f *fakeClock) At(t time.Time) <-chan time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	ch := make(chan time.Time, 1)
	if !t.After(f.now) {
		ch <- f.now
	} else {
		f.timers = append(f.timers, fakeTimer{t, ch})
	}
	select {
	case f.armed <- struct{}{}:
	default:
	}
	return ch
}

// Advance moves the clock by d, firing the timers it passes.
func (f *fakeClock) Advance(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
	kept := f.timers[:0]
	for _, tm := range f.timers {
		if tm.at.After(f.now) {
			kept = append(kept, tm)
		} else {
			tm.ch <- f.now
		}
	}
	f.timers = kept
}

// waitArmed waits until a timer is set for at: the refresher is parked
// until then.
func (f *fakeClock) waitArmed(t *testing.T, at time.Time) {
	t.Helper()
	deadline := time.After(bound)
	for {
		f.mu.Lock()
		var set []string
		for _, tm := range f.timers {
			if tm.at.Equal(at) {
				f.mu.Unlock()
				return
			}
			set = append(set, tm.at.Sub(f.now).String())
		}
		now := f.now
		f.mu.Unlock()
		select {
		case <-f.armed:
		case <-deadline:
			t.Fatalf("no timer for %s (in %s); timers in %v", at.Format(time.TimeOnly), at.Sub(now), set)
		}
	}
}

// fakeSource is a token source whose every fetch waits for the test's
// answer (or its context): a fetch not answered is a token endpoint that
// took the request and hangs.
type fakeSource struct{ calls chan *fetchReq }

type fetchReq struct {
	ctx   context.Context
	reply chan fetchReply
}

type fetchReply struct {
	tok string
	exp time.Time
	err error
}

func newFakeSource() *fakeSource { return &fakeSource{calls: make(chan *fetchReq, 16)} }

func (f *fakeSource) fetch(ctx context.Context) (string, time.Time, error) {
	r := &fetchReq{ctx, make(chan fetchReply, 1)}
	f.calls <- r
	select {
	case rep := <-r.reply:
		return rep.tok, rep.exp, rep.err
	case <-ctx.Done():
		return "", time.Time{}, ctx.Err()
	}
}

// next is the next fetch begun.
func (f *fakeSource) next(t *testing.T) *fetchReq {
	t.Helper()
	select {
	case r := <-f.calls:
		return r
	case <-time.After(bound):
		t.Fatal("no fetch began")
		return nil
	}
}

// none checks that no fetch began.
func (f *fakeSource) none(t *testing.T, when string) {
	t.Helper()
	select {
	case <-f.calls:
		t.Errorf("%s: a fetch began", when)
	default:
	}
}

func (r *fetchReq) answer(tok string, exp time.Time, err error) {
	r.reply <- fetchReply{tok, exp, err}
}

// holdRecorder records what the token source reports to the board.
type holdRecorder struct {
	mu              sync.Mutex
	held            bool
	reason, message string
	holds, clears   int
	changed         chan struct{}
}

func newHoldRecorder() *holdRecorder { return &holdRecorder{changed: make(chan struct{}, 1)} }

func (h *holdRecorder) Hold(reason, message string) {
	h.mu.Lock()
	if !h.held || reason != h.reason {
		h.holds++
	}
	h.held, h.reason, h.message = true, reason, message
	h.mu.Unlock()
	h.signal()
}

func (h *holdRecorder) Clear() {
	h.mu.Lock()
	if h.held {
		h.clears++
	}
	h.held = false
	h.mu.Unlock()
	h.signal()
}

func (h *holdRecorder) signal() {
	select {
	case h.changed <- struct{}{}:
	default:
	}
}

func (h *holdRecorder) state() (held bool, reason, message string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held, h.reason, h.message
}

// wait waits until the hold is held (or not).
func (h *holdRecorder) wait(t *testing.T, held bool) {
	t.Helper()
	deadline := time.After(bound)
	for {
		if got, _, _ := h.state(); got == held {
			return
		}
		select {
		case <-h.changed:
		case <-deadline:
			t.Fatalf("the token source never reported held=%v", held)
		}
	}
}

// testCache is a cache on clk and src reporting to hold, whose refresher
// runs until the test ends; fetched receives once each fetch is recorded.
func testCache(t *testing.T, clk clock, src *fakeSource, hold HoldReporter, log *zap.Logger) (*tokenCache, chan struct{}) {
	fetched := make(chan struct{}, 16)
	c := &tokenCache{fetch: src.fetch, where: "the token endpoint (test) http://idp.test/token", refreshAfter: 0.8,
		log: log, hold: hold, clock: clk, bg: t.Context(), fetched: func() { fetched <- struct{}{} }}
	return c, fetched
}

func waitFetched(t *testing.T, fetched chan struct{}) {
	t.Helper()
	select {
	case <-fetched:
	case <-time.After(bound):
		t.Fatal("a fetch's result was never recorded")
	}
}

// tokenOf runs one authentication's request for a token in the
// background.
func tokenOf(ctx context.Context, c *tokenCache) chan fetchReply {
	ch := make(chan fetchReply, 1)
	go func() {
		tok, err := c.token(ctx)
		ch <- fetchReply{tok: tok, err: err}
	}()
	return ch
}

// got is the answer of tokenOf, which must come.
func got(t *testing.T, ch chan fetchReply, what string) (string, error) {
	t.Helper()
	select {
	case r := <-ch:
		return r.tok, r.err
	case <-time.After(bound):
		t.Fatalf("%s: the authentication is still waiting for a token", what)
		return "", nil
	}
}

// TestOAuthRefreshesByItself: the token is replaced at 80% of its life
// with no authentication asking (the broker's re-authentication comes at
// 95-98% of a session, which would leave a failing refresh 1-2 seconds),
// and the new one is what the next authentication gets.
func TestOAuthRefreshesByItself(t *testing.T) {
	clk, src := newFakeClock(), newFakeSource()
	c, fetched := testCache(t, clk, src, nil, zap.NewNop())
	start := clk.Now()
	first := tokenOf(t.Context(), c)
	src.next(t).answer("t1", start.Add(60*time.Second), nil)
	if tok, err := got(t, first, "first token"); tok != "t1" || err != nil {
		t.Fatalf("first token: %q, %v", tok, err)
	}
	waitFetched(t, fetched)
	clk.waitArmed(t, start.Add(48*time.Second))
	clk.Advance(47 * time.Second)
	src.none(t, "at 78% of the token's life")
	clk.Advance(time.Second)
	src.next(t).answer("t2", clk.Now().Add(60*time.Second), nil)
	waitFetched(t, fetched)
	if tok, err := got(t, tokenOf(t.Context(), c), "after the refresh"); tok != "t2" || err != nil {
		t.Errorf("after the refresh at 80%%: %q, %v, want t2", tok, err)
	}
	// The next refresh is scheduled from t2's life.
	clk.waitArmed(t, clk.Now().Add(48*time.Second))
}

// TestOAuthHungTokenEndpoint: the refresh at 80% is taken by the endpoint
// and never answered. Authentications meanwhile get the current token at
// once; after notAnsweringAfter one WARN names the endpoint and the true
// expiry; in the token's last tenth it is handed out no more, and the
// token source holds delivery (NotAnswering, naming the endpoint and the
// expiry); an authentication then waits only as long as its own context;
// the endpoint's answer clears the hold.
func TestOAuthHungTokenEndpoint(t *testing.T) {
	clk, src, hold := newFakeClock(), newFakeSource(), newHoldRecorder()
	core, logs := observer.New(zapcore.InfoLevel)
	c, fetched := testCache(t, clk, src, hold, zap.New(core))
	start := clk.Now()
	exp := start.Add(60 * time.Second)
	first := tokenOf(t.Context(), c)
	src.next(t).answer("t1", exp, nil)
	if tok, err := got(t, first, "first token"); tok != "t1" || err != nil {
		t.Fatalf("first token: %q, %v; want t1", tok, err)
	}
	waitFetched(t, fetched)
	clk.waitArmed(t, start.Add(48*time.Second))
	clk.Advance(48 * time.Second)
	hung := src.next(t) // taken, never answered until the end
	if tok, err := got(t, tokenOf(t.Context(), c), "while the refresh hangs"); tok != "t1" || err != nil {
		t.Errorf("while the refresh hangs: %q, %v, want t1 at once", tok, err)
	}

	clk.waitArmed(t, start.Add(53*time.Second)) // notAnsweringAfter
	clk.Advance(5 * time.Second)
	clk.waitArmed(t, start.Add(54*time.Second)) // the token's last tenth
	warns := logs.FilterLevelExact(zapcore.WarnLevel).All()
	if len(warns) != 1 {
		t.Fatalf("%d WARN lines once the endpoint has not answered for 5s, want 1: %v", len(warns), warns)
	}
	w := warns[0].ContextMap()
	if e, ok := w["expires"].(time.Time); !ok || !e.Equal(exp) || !e.After(clk.Now()) {
		t.Errorf("the WARN says the token expires %v, want %s (the truth, still ahead)", w["expires"], exp)
	}
	if w["reason"] != ReasonNotAnswering || !strings.Contains(fmt.Sprint(w["error"]), "http://idp.test/token") {
		t.Errorf("the WARN: %q %v, want the reason NotAnswering and the endpoint named", warns[0].Message, w)
	}
	if held, _, _ := hold.state(); held {
		t.Error("the token source holds delivery while its token is valid")
	}

	clk.Advance(time.Second) // 54s: t1 has 6s left
	hold.wait(t, true)
	_, reason, msg := hold.state()
	if reason != ReasonNotAnswering || !strings.Contains(msg, "http://idp.test/token") || !strings.Contains(msg, exp.UTC().Format(time.RFC3339)) {
		t.Errorf("hold %s: %s; want NotAnswering naming the endpoint and %s", reason, msg, exp.UTC().Format(time.RFC3339))
	}
	ctx, cancel := context.WithCancel(t.Context())
	waiting := tokenOf(ctx, c)
	cancel()
	tok, err := got(t, waiting, "its context ended")
	var se *SourceError
	if tok != "" || !errors.As(err, &se) {
		t.Errorf("in t1's last tenth, the endpoint hung: %q, %v, want no token and a *SourceError", tok, err)
	}
	if n := len(logs.FilterLevelExact(zapcore.WarnLevel).All()); n != 1 {
		t.Errorf("%d WARN lines from the token source by its hold, want the one", n)
	}

	hung.answer("t2", clk.Now().Add(60*time.Second), nil)
	waitFetched(t, fetched)
	hold.wait(t, false)
	if tok, err := got(t, tokenOf(t.Context(), c), "after the endpoint answered"); tok != "t2" || err != nil {
		t.Errorf("after the endpoint answered: %q, %v, want t2", tok, err)
	}
	if logs.FilterMessageSnippet("available again").Len() != 1 {
		t.Error("no line saying the token is available again")
	}
}

// TestOAuthNeverHandsExpiredToken: a fetch that fails after its whole
// timeout must not make the token it was to replace look valid (the
// clock is read after the fetch), a token in its last tenth is not
// handed out, nor one that arrives with less left than the margin; the
// hold says why.
func TestOAuthNeverHandsExpiredToken(t *testing.T) {
	clk, src, hold := newFakeClock(), newFakeSource(), newHoldRecorder()
	c, fetched := testCache(t, clk, src, hold, zap.NewNop())
	c.bg = nil // no refresher: the authentications alone ask
	start := clk.Now()
	first := tokenOf(t.Context(), c)
	src.next(t).answer("t1", start.Add(100*time.Second), nil)
	if tok, err := got(t, first, "first token"); tok != "t1" || err != nil {
		t.Fatalf("first token: %q, %v; want t1", tok, err)
	}
	waitFetched(t, fetched)

	clk.Advance(85 * time.Second) // due: the authentication starts a fetch, and does not wait for it
	if tok, err := got(t, tokenOf(t.Context(), c), "at 85%"); tok != "t1" || err != nil {
		t.Fatalf("at 85%%: %q, %v, want t1", tok, err)
	}
	slow := src.next(t)
	clk.Advance(30 * time.Second) // the fetch's whole timeout: t1 expired meanwhile
	slow.answer("", time.Time{}, context.DeadlineExceeded)
	waitFetched(t, fetched)
	if tok, err := got(t, tokenOf(t.Context(), c), "after the slow failure"); err == nil {
		t.Errorf("the fetch failed after t1 expired: %q handed out, want an error", tok)
	}
	if _, reason, _ := hold.state(); reason != ReasonNotAnswering {
		t.Errorf("hold reason %q, want NotAnswering", reason)
	}

	clk.Advance(retryMax)
	late := tokenOf(t.Context(), c)
	src.next(t).answer("t2", clk.Now().Add(time.Second), nil) // less left than the margin
	if tok, err := got(t, late, "a token about to expire"); err == nil || !strings.Contains(err.Error(), "too soon") {
		t.Errorf("a token with 1s left: %q, %v, want an error saying it is too soon to use", tok, err)
	}
	waitFetched(t, fetched)
	if _, reason, _ := hold.state(); reason != ReasonExpired {
		t.Errorf("hold reason %q, want Expired", reason)
	}
}

// TestOAuthRetriesWithBackoff: a failing refresh is retried by the
// refresher after 1s, 2s, 4s…, with one WARN for the streak; a success
// ends it.
func TestOAuthRetriesWithBackoff(t *testing.T) {
	clk, src := newFakeClock(), newFakeSource()
	core, logs := observer.New(zapcore.WarnLevel)
	c, fetched := testCache(t, clk, src, nil, zap.New(core))
	start := clk.Now()
	first := tokenOf(t.Context(), c)
	src.next(t).answer("t1", start.Add(600*time.Second), nil)
	if tok, err := got(t, first, "first token"); tok != "t1" || err != nil {
		t.Fatalf("first token: %q, %v; want t1", tok, err)
	}
	waitFetched(t, fetched)
	clk.waitArmed(t, start.Add(480*time.Second))
	clk.Advance(480 * time.Second)
	refused := errors.New("HTTP 503")
	src.next(t).answer("", time.Time{}, refused)
	waitFetched(t, fetched)
	for _, pause := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second} {
		clk.waitArmed(t, clk.Now().Add(pause))
		clk.Advance(pause)
		src.next(t).answer("", time.Time{}, refused)
		waitFetched(t, fetched)
	}
	if logs.Len() != 1 {
		t.Errorf("%d WARN lines for a streak of 4 failures, want 1", logs.Len())
	}
	clk.waitArmed(t, clk.Now().Add(8*time.Second))
	clk.Advance(8 * time.Second)
	src.next(t).answer("t2", clk.Now().Add(600*time.Second), nil)
	waitFetched(t, fetched)
	clk.waitArmed(t, clk.Now().Add(480*time.Second))
}

// TestOAuthHoldReasons: each real source's failure holds delivery, once
// no valid token is left, for its reason, with a message naming it: a
// closed port, an endpoint that takes the request and hangs, one that
// refuses the client, a token file missing or expired; a token had again
// clears the hold.
func TestOAuthHoldReasons(t *testing.T) {
	const secret = "hold-S3cret"
	srv, _ := tokenServer(t, "relay", secret, time.Hour)
	hung := make(chan struct{})
	hang := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { <-hung }))
	t.Cleanup(hang.Close)
	t.Cleanup(func() { close(hung) }) // runs first: the handler returns, so Close does not wait on it
	file := filepath.Join(t.TempDir(), "token")
	base := OAuth{ClientID: "relay", ClientSecret: secret}
	for _, tc := range []struct {
		name   string
		o      OAuth
		reason string
		names  string
	}{
		{"closed port", withURL(base, "http://"+closedAddr(t)+"/token"), ReasonUnreachable, "cannot reach"},
		{"hung endpoint", withHTTP(withURL(base, hang.URL+"/token"), &http.Client{Timeout: 200 * time.Millisecond}), ReasonNotAnswering, hang.URL},
		{"wrong secret", OAuth{TokenURL: srv.URL, ClientID: "relay", ClientSecret: "wr0ng"}, ReasonRefused, "kafkaauth.OAuth.ClientID"},
		{"token file missing", OAuth{TokenFile: file}, ReasonUnreadable, file},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hold := newHoldRecorder()
			tc.o.Holds = hold
			if _, err := authenticate(t, tc.o, zap.NewNop()); err == nil {
				t.Fatal("authenticated")
			}
			held, reason, msg := hold.state()
			if !held || reason != tc.reason || !strings.Contains(msg, tc.names) || !strings.Contains(msg, "no valid OAUTHBEARER token") {
				t.Errorf("hold %v %s: %s; want %s naming %q", held, reason, msg, tc.reason, tc.names)
			}
		})
	}

	t.Run("token file expired, then rotated", func(t *testing.T) {
		if err := os.WriteFile(file, []byte(fakeJWT(1, time.Now().Add(-time.Minute))), 0o600); err != nil {
			t.Fatal(err)
		}
		hold := newHoldRecorder()
		mech, err := OAuth{TokenFile: file, Holds: hold}.Mechanism(t.Context(), zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := mech.Authenticate(t.Context(), "b:9092"); err == nil {
			t.Fatal("authenticated with an expired token")
		}
		if held, reason, msg := hold.state(); !held || reason != ReasonExpired || !strings.Contains(msg, "kafkaauth.OAuth.TokenFile") {
			t.Errorf("hold %v %s: %s; want Expired naming the file", held, reason, msg)
		}
		if err := os.WriteFile(file, []byte(fakeJWT(2, time.Now().Add(time.Hour))), 0o600); err != nil {
			t.Fatal(err)
		}
		// The authentication that finds the failure's backoff passed
		// reads the file again: wait for the hold to clear.
		deadline := time.Now().Add(bound)
		for held, _, _ := hold.state(); held; held, _, _ = hold.state() {
			if time.Now().After(deadline) {
				t.Fatal("the rotated token file never cleared the hold")
			}
			_, _, _ = mech.Authenticate(t.Context(), "b:9092")
			select {
			case <-hold.changed:
			case <-time.After(100 * time.Millisecond): // the next authentication attempt, as a client's retry
			}
		}
	})
}

func withURL(o OAuth, u string) OAuth { o.TokenURL = u; return o }

func withHTTP(o OAuth, hc *http.Client) OAuth { o.HTTPClient = hc; return o }

// TestOAuthHoldAtTokenEnd: with a token so short-lived that its end comes
// before notAnsweringAfter of its hung refresh, the hold (and the WARN)
// still come at its end, not after it expired.
func TestOAuthHoldAtTokenEnd(t *testing.T) {
	clk, src, hold := newFakeClock(), newFakeSource(), newHoldRecorder()
	core, logs := observer.New(zapcore.WarnLevel)
	c, fetched := testCache(t, clk, src, hold, zap.New(core))
	start := clk.Now()
	exp := start.Add(12 * time.Second) // refreshed at 8s, spent at 10s
	first := tokenOf(t.Context(), c)
	src.next(t).answer("t1", exp, nil)
	if tok, err := got(t, first, "first token"); tok != "t1" || err != nil {
		t.Fatalf("first token: %q, %v; want t1", tok, err)
	}
	waitFetched(t, fetched)
	clk.waitArmed(t, start.Add(8*time.Second))
	clk.Advance(8 * time.Second)
	src.next(t) // hung
	clk.waitArmed(t, start.Add(10*time.Second))
	clk.Advance(2 * time.Second)
	hold.wait(t, true)
	if _, reason, _ := hold.state(); reason != ReasonNotAnswering {
		t.Errorf("hold reason %q, want NotAnswering", reason)
	}
	warns := logs.All()
	if len(warns) != 1 {
		t.Fatalf("%d WARN lines at the token's end, want 1", len(warns))
	}
	if e, ok := warns[0].ContextMap()["expires"].(time.Time); !ok || !e.Equal(exp) || !e.After(clk.Now()) {
		t.Errorf("the WARN says the token expires %v, want %s (still ahead)", warns[0].ContextMap()["expires"], exp)
	}
}
