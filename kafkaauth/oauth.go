// Package kafkaauth gives a Kafka client the credentials that managed
// clusters ask for and that rotate while the client runs: SASL/OAUTHBEARER
// tokens from an OIDC token endpoint or a token file (OAuth), AWS MSK IAM
// signatures from the AWS default credential chain (MSKIAM), and TLS
// material re-read from its files when they change (TLSFiles). Each returns
// what franz-go takes (a sasl.Mechanism, a *tls.Config); nothing here keeps
// a connection, so a refreshed credential is used at the next
// authentication (a new connection, or a KIP-368 re-authentication of an
// open one) without restarting the producer.
//
// Secrets (client secrets, tokens, signed requests, keys) never appear in
// an error or a log line of this package.
package kafkaauth

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/oauth"
	"go.uber.org/zap"
	"golang.org/x/oauth2"
	"golang.org/x/oauth2/clientcredentials"
)

// ErrRefused marks a credential that the issuer refused (a wrong client id
// or secret, a scope or audience it does not grant): retrying with the same
// configuration cannot succeed, so a caller stops rather than retries.
var ErrRefused error = refused{}

// refused is ErrRefused's type: an error that says retrying cannot fix it.
type refused struct{}

func (refused) Error() string { return "credentials refused" }

// Fatal is true: a refused credential stays refused until it is changed.
func (refused) Fatal() bool { return true }

// OAuth configures SASL/OAUTHBEARER: tokens from an OIDC token endpoint by
// the client-credentials grant (TokenURL, ClientID, ClientSecret or
// ClientSecretFile), or read from TokenFile (what Kubernetes projected
// service-account tokens and workload-identity agents write and rotate).
//
// A token is replaced once RefreshAfter of its lifetime passed, by a
// refresher of its own, whatever the broker's re-authentication schedule
// (KIP-368 asks for a token only near the end of a session, which would
// leave the refresh to the last seconds of a token's life), and retried
// with backoff (retryMin to retryMax) when that fails. A token is never
// handed to the broker in its last part (expiryMargin): the broker ends
// a session at its token's expiry, and one begun in the token's last
// seconds is re-authenticated at once, which the broker may refuse. An
// authentication never waits for a fetch while a valid token is cached.
type OAuth struct {
	// TokenURL is the token endpoint of the client-credentials grant.
	TokenURL string
	// ClientID and ClientSecret authenticate walrelay to the token
	// endpoint (HTTP basic authentication, or form fields when the
	// endpoint refuses that).
	ClientID     string
	ClientSecret string
	// ClientSecretFile, instead of ClientSecret: a file holding the
	// client secret (a mounted Kubernetes Secret), read again at every
	// request to the token endpoint, so that a rotated secret is used
	// without a restart.
	ClientSecretFile string
	// Scopes and Audience are asked for in the token request (audience as
	// the audience parameter, which Auth0, Keycloak and others read).
	Scopes   []string
	Audience string
	// Extensions are SASL extensions sent with the token (Confluent
	// Cloud's logicalCluster and identityPoolId).
	Extensions map[string]string
	// TokenFile, instead of the token endpoint: a file holding the token,
	// read again when the current token is due for replacement (and at
	// every authentication when the token carries no expiry).
	TokenFile string
	// RefreshAfter is the part of a token's lifetime after which a new one
	// is fetched (default 0.8, Kafka's sasl.login.refresh.window.factor).
	RefreshAfter float64
	// HTTPClient calls the token endpoint; nil uses one with a timeout of
	// fetchTimeout (30s).
	HTTPClient *http.Client
	// Holds is told when the token source holds delivery, that is when no
	// valid token is left (the relay's holds.Condition for
	// holds.TokenSource), and when it no longer does; nil tells nobody.
	Holds HoldReporter
}

// HoldReporter is where the token source reports that it holds delivery
// (package holds' *Condition is one): Hold with one of the Reason*
// constants and a one-line message naming the source, the cause and the
// fix, once no valid token is left; Clear once a token is had again.
type HoldReporter interface {
	Hold(reason, message string)
	Clear()
}

// Why the token source holds delivery: the reasons it reports to
// OAuth.Holds.
const (
	// ReasonUnreachable: the token endpoint cannot be connected to.
	ReasonUnreachable = "Unreachable"
	// ReasonNotAnswering: the token endpoint took the request and has
	// not answered it (notAnsweringAfter), or did not within its timeout.
	ReasonNotAnswering = "NotAnswering"
	// ReasonRefused: the token endpoint refused the client or the grant.
	ReasonRefused = "Refused"
	// ReasonFailing: the token endpoint answered with an error or no
	// token.
	ReasonFailing = "Failing"
	// ReasonExpired: the token had (from the token file) is expired or
	// about to.
	ReasonExpired = "Expired"
	// ReasonUnreadable: the token file or the client secret file cannot
	// be read, or is empty.
	ReasonUnreadable = "Unreadable"
)

// The token source's defaults and timing, in one place (OAuth's
// documentation names them).
const (
	// defaultRefreshAfter is OAuth.RefreshAfter's default, Kafka's
	// sasl.login.refresh.window.factor.
	defaultRefreshAfter = 0.8
	// fetchTimeout bounds one request to the token endpoint (the default
	// OAuth.HTTPClient's timeout).
	fetchTimeout = 30 * time.Second
	// notAnsweringAfter is how long a request to the token endpoint may
	// go unanswered before it is reported, without waiting for its
	// timeout: a hung identity provider is said while the current token
	// still serves.
	notAnsweringAfter = 5 * time.Second
	// minExpiryMargin is the least of a token's life left for it to be
	// handed to the broker (see expiryMargin): above franz-go's second
	// of re-authentication pessimism and a broker's round trip.
	minExpiryMargin = 2 * time.Second
	// retryMin and retryMax bound the backoff between fetches that
	// failed or brought no newer token (a token file not yet rotated),
	// doubling from one to the other.
	retryMin = time.Second
	retryMax = 10 * time.Second
)

// Check reports a configuration that cannot work, naming the field.
func (o OAuth) Check() error {
	switch {
	case o.TokenFile != "" && o.TokenURL != "":
		return errors.New("kafkaauth.OAuth.TokenFile and kafkaauth.OAuth.TokenURL are two sources of tokens: give one")
	case o.TokenFile == "" && o.TokenURL == "":
		return errors.New("SASL OAUTHBEARER needs a source of tokens: kafkaauth.OAuth.TokenURL (with kafkaauth.OAuth.ClientID and its secret) or kafkaauth.OAuth.TokenFile")
	case o.TokenURL != "" && o.ClientID == "":
		return errors.New("kafkaauth.OAuth.TokenURL needs kafkaauth.OAuth.ClientID (and kafkaauth.OAuth.ClientSecret)")
	case o.ClientSecret != "" && o.ClientSecretFile != "":
		return errors.New("kafkaauth.OAuth.ClientSecret and kafkaauth.OAuth.ClientSecretFile are two sources of the client secret: give one")
	case o.TokenURL != "" && o.ClientSecret == "" && o.ClientSecretFile == "":
		return errors.New("kafkaauth.OAuth.TokenURL needs kafkaauth.OAuth.ClientSecret (the client's secret): it is empty")
	case o.RefreshAfter < 0 || o.RefreshAfter >= 1:
		return fmt.Errorf("kafkaauth.OAuth.RefreshAfter %v: want a fraction of the token's lifetime, above 0 and below 1", o.RefreshAfter)
	}
	if o.TokenURL != "" {
		u, err := url.Parse(o.TokenURL)
		if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
			return errors.New("kafkaauth.OAuth.TokenURL: want an http(s) URL of the token endpoint")
		}
	}
	if o.ClientSecretFile != "" {
		// Read once here so that a wrong path is a configuration error at
		// start, not a hold later; it is read again at every request.
		if _, err := o.clientSecret(); err != nil {
			return err
		}
	}
	for k := range o.Extensions {
		if k == "" || k == "auth" {
			return fmt.Errorf("kafkaauth.OAuth.Extensions: %q is not a SASL extension name", k)
		}
	}
	return nil
}

// Mechanism is the OAUTHBEARER mechanism of o. The first authentication
// fetches a token; from then on a refresher replaces it once RefreshAfter
// of its lifetime passed, until ctx ends (later, tokens are fetched when
// an authentication finds none valid). An authentication gets the cached
// token while it is valid, even while a fetch hangs; with none valid it
// waits for the fetch under way, or until its own context ends.
//
// A token endpoint that refuses the client is an error wrapping
// ErrRefused. A failing or hung source is one WARN per failing streak,
// naming it and when the current token expires; once no valid token is
// left it holds delivery (o.Holds, with a Reason*), until a token is had
// again. Errors of an authentication without a token are *SourceError.
func (o OAuth) Mechanism(ctx context.Context, log *zap.Logger) (sasl.Mechanism, error) {
	if err := o.Check(); err != nil {
		return nil, err
	}
	if o.RefreshAfter == 0 {
		o.RefreshAfter = defaultRefreshAfter
	}
	c := &tokenCache{refreshAfter: o.RefreshAfter, log: log, clock: realClock{}, hold: o.Holds, bg: ctx}
	if o.TokenFile != "" {
		c.where = "the token file (kafkaauth.OAuth.TokenFile) " + o.TokenFile
		c.fetch = o.fromFile
	} else {
		c.where = "the token endpoint (kafkaauth.OAuth.TokenURL) " + redactURL(o.TokenURL)
		c.fetch = o.clientCredentials()
	}
	ext := o.Extensions
	return oauth.Oauth(func(ctx context.Context) (oauth.Auth, error) {
		tok, err := c.token(ctx)
		if err != nil {
			return oauth.Auth{}, err
		}
		return oauth.Auth{Token: tok, Extensions: ext}, nil
	}), nil
}

// clientSecret is the client secret: ClientSecret, or ClientSecretFile's
// content, read now.
func (o OAuth) clientSecret() (string, error) {
	if o.ClientSecretFile == "" {
		return o.ClientSecret, nil
	}
	b, err := os.ReadFile(o.ClientSecretFile)
	if err != nil {
		return "", reasoned(ReasonUnreadable, fmt.Errorf("cannot read kafkaauth.OAuth.ClientSecretFile %s: %w", o.ClientSecretFile, errors.Unwrap(err)))
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return "", reasoned(ReasonUnreadable, fmt.Errorf("kafkaauth.OAuth.ClientSecretFile %s is empty", o.ClientSecretFile))
	}
	return s, nil
}

// clientCredentials fetches a token by the client-credentials grant,
// with the client secret as it is at each request.
func (o OAuth) clientCredentials() func(context.Context) (string, time.Time, error) {
	// One Config, so that the client authentication style it finds
	// (basic, else form fields) is kept; the cache calls fetch one at a
	// time, and mu makes sure of it.
	cc := &clientcredentials.Config{ClientID: o.ClientID, TokenURL: o.TokenURL, Scopes: o.Scopes}
	if o.Audience != "" {
		cc.EndpointParams = url.Values{"audience": {o.Audience}}
	}
	hc := o.HTTPClient
	if hc == nil {
		hc = &http.Client{Timeout: fetchTimeout}
	}
	var mu sync.Mutex
	return func(ctx context.Context) (string, time.Time, error) {
		secret, err := o.clientSecret()
		if err != nil {
			return "", time.Time{}, err
		}
		mu.Lock()
		cc.ClientSecret = secret
		tok, err := cc.Token(context.WithValue(ctx, oauth2.HTTPClient, hc))
		mu.Unlock()
		if err != nil {
			return "", time.Time{}, tokenEndpointError(err)
		}
		if tok.AccessToken == "" {
			return "", time.Time{}, reasoned(ReasonFailing, errors.New("its answer holds no access_token"))
		}
		exp := tok.Expiry
		if jwtExp, ok := jwtExpiry(tok.AccessToken); ok && (exp.IsZero() || jwtExp.Before(exp)) {
			exp = jwtExp
		}
		return tok.AccessToken, exp, nil
	}
}

// fromFile reads the token file; its expiry is the JWT's exp claim, when
// it is a JWT.
func (o OAuth) fromFile(context.Context) (string, time.Time, error) {
	b, err := os.ReadFile(o.TokenFile)
	if err != nil {
		return "", time.Time{}, reasoned(ReasonUnreadable, fmt.Errorf("cannot read it: %w", errors.Unwrap(err)))
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", time.Time{}, reasoned(ReasonUnreadable, errors.New("it is empty"))
	}
	exp, _ := jwtExpiry(tok)
	return tok, exp, nil
}

// tokenEndpointError is what the token endpoint's failure says, without
// the response body (which a misbehaving endpoint may fill with anything):
// a refusal of the client (an OAuth error code, or 401/403) wraps
// ErrRefused; each carries its reason.
func tokenEndpointError(err error) error {
	var re *oauth2.RetrieveError
	if errors.As(err, &re) {
		status := 0
		if re.Response != nil {
			status = re.Response.StatusCode
		}
		what := fmt.Sprintf("HTTP %d", status)
		if re.ErrorCode != "" {
			what += " " + re.ErrorCode
			if d := oneLine(re.ErrorDescription, 120); d != "" {
				what += fmt.Sprintf(" (%s)", d)
			}
		}
		switch {
		case re.ErrorCode == "invalid_client" || re.ErrorCode == "unauthorized_client" || status == http.StatusUnauthorized:
			return reasoned(ReasonRefused, fmt.Errorf("%w: it refused the client: %s: check kafkaauth.OAuth.ClientID and kafkaauth.OAuth.ClientSecret", ErrRefused, what))
		case re.ErrorCode == "invalid_scope" || re.ErrorCode == "invalid_target" || re.ErrorCode == "access_denied" || re.ErrorCode == "invalid_grant" || status == http.StatusForbidden:
			return reasoned(ReasonRefused, fmt.Errorf("%w: it refused to grant the token: %s: check kafkaauth.OAuth.Scopes and kafkaauth.OAuth.Audience, and what the client may ask for", ErrRefused, what))
		}
		return reasoned(ReasonFailing, fmt.Errorf("it answered %s", what))
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		// url.Error quotes the URL; the caller names it, redacted.
		if ue.Timeout() {
			return reasoned(ReasonNotAnswering, fmt.Errorf("it did not answer in time: %w", ue.Err))
		}
		return reasoned(ReasonUnreachable, fmt.Errorf("cannot reach it: %w", ue.Err))
	}
	return err
}

// reasonError is a source's error with the reason it holds delivery for.
type reasonError struct {
	reason string
	err    error
}

func (e *reasonError) Error() string { return e.err.Error() }
func (e *reasonError) Unwrap() error { return e.err }

func reasoned(reason string, err error) error { return &reasonError{reason, err} }

// reasonOf is the Reason* of a source's error.
func reasonOf(err error) string {
	var re *reasonError
	switch {
	case errors.As(err, &re):
		return re.reason
	case errors.Is(err, ErrRefused):
		return ReasonRefused
	case errors.Is(err, context.DeadlineExceeded):
		return ReasonNotAnswering
	}
	return ReasonFailing
}

// clock is the time as the cache sees it (tests move it by hand).
type clock interface {
	Now() time.Time
	// At is a channel that receives once the time is t. An absolute
	// moment, not a duration: the refresher reads the time, then arms
	// its timer, and time moved in between must not push the moment on.
	At(t time.Time) <-chan time.Time
}

type realClock struct{}

func (realClock) Now() time.Time                  { return time.Now() }
func (realClock) At(t time.Time) <-chan time.Time { return time.After(time.Until(t)) }

// tokenCache holds the newest token, replaces it in the background
// (refresh) and hands it to authentications (token). Fetches happen one
// at a time, outside the lock: an authentication with a valid token
// never waits for one.
type tokenCache struct {
	fetch        func(context.Context) (tok string, exp time.Time, err error)
	where        string
	refreshAfter float64
	log          *zap.Logger
	hold         HoldReporter // nil: report nowhere
	clock        clock
	bg           context.Context // the refresher's lifetime; nil: no refresher

	startOnce sync.Once
	wake      chan struct{} // a fetch ended: the refresher looks again

	mu       sync.Mutex
	tok      string
	got, exp time.Time  // exp zero: unknown, fetched at every authentication
	call     *fetchCall // the fetch under way, nil when none
	lastEnd  time.Time  // when the last fetch ended
	retries  int        // fetches in a row that failed or brought no newer token
	failing  *failure   // the current failing streak; nil when none
	held     bool       // hold was told it holds delivery

	fetched func() // tests: called once a fetch's result is recorded
}

// fetchCall is one fetch, which the authentications that need a token
// and the refresher share.
type fetchCall struct {
	started time.Time
	done    chan struct{} // closed when tok or err is set
	tok     string
	err     error
}

// failure is a streak of fetches that failed (or one that has not
// answered for notAnsweringAfter), until one succeeds.
type failure struct {
	err    error // the newest failure, naming the source
	warned bool  // its WARN was logged
}

// token is the token to authenticate with: the cached one while valid,
// else the result of the fetch under way or of a new one. A fetch is not
// started again before the backoff since the last failed one passed: the
// authentication gets that failure at once.
func (c *tokenCache) token(ctx context.Context) (string, error) {
	c.startOnce.Do(c.startRefresher)
	c.mu.Lock()
	now := c.clock.Now()
	if c.validAt(now) {
		// Due for replacement and the refresher not at it (it stopped,
		// or has not woken yet): a fetch starts, which this
		// authentication does not wait for.
		if _, due := c.scheduleLocked(now); due {
			c.fetchLocked(now)
		}
		tok := c.tok
		c.mu.Unlock()
		return tok, nil
	}
	if c.call == nil && c.failing != nil && c.failing.err != nil && now.Before(c.lastEnd.Add(backoff(c.retries))) {
		err := c.failing.err
		c.mu.Unlock()
		return "", &SourceError{err}
	}
	call := c.fetchLocked(now)
	c.mu.Unlock()
	select {
	case <-call.done:
		if call.err != nil {
			return "", call.err
		}
		return call.tok, nil
	case <-ctx.Done():
		return "", &SourceError{fmt.Errorf("kafka SASL OAUTHBEARER: %s: no valid token, and the authentication ended while waiting for one (%w)", c.where, ctx.Err())}
	}
}

// validAt reports whether the cached token may be handed to the broker
// at now: it has a known expiry, more than expiryMargin away.
func (c *tokenCache) validAt(now time.Time) bool {
	return c.tok != "" && !c.exp.IsZero() && now.Before(c.exp.Add(-c.expiryMargin(c.got, c.exp)))
}

// expiryMargin is the last part of the life of a token had at got and
// expiring at exp, in which it is no longer handed to the broker: half
// of what follows the refresh point (a tenth of the lifetime at the
// default RefreshAfter, so 6s of a 60s token), at least minExpiryMargin.
func (c *tokenCache) expiryMargin(got, exp time.Time) time.Duration {
	m := time.Duration((1 - c.refreshAfter) / 2 * float64(exp.Sub(got))).Round(time.Millisecond)
	return max(m, minExpiryMargin)
}

// refreshAt is when the token had at got and expiring at exp is
// replaced: at RefreshAfter of its lifetime, or earlier so that two
// margins are left for retries (tokens so short-lived that the margin's
// minimum is most of their end), never before half of it.
func (c *tokenCache) refreshAt(got, exp time.Time) time.Time {
	life := exp.Sub(got)
	at := got.Add(time.Duration(c.refreshAfter * float64(life)).Round(time.Millisecond))
	if early := exp.Add(-2 * c.expiryMargin(got, exp)); early.Before(at) {
		at = early
	}
	if half := got.Add(life / 2); at.Before(half) {
		at = half
	}
	return at
}

// backoff is the pause after n fetches in a row that failed or brought no
// newer token.
func backoff(n int) time.Duration {
	if n <= 0 {
		return 0
	}
	d := retryMin
	for i := 1; i < n && d < retryMax; i++ {
		d *= 2
	}
	return min(d, retryMax)
}

// fetchLocked returns the fetch under way, starting one if none is; c.mu
// is held.
func (c *tokenCache) fetchLocked(now time.Time) *fetchCall {
	if c.call != nil {
		return c.call
	}
	call := &fetchCall{started: now, done: make(chan struct{})}
	c.call = call
	go c.run(call)
	return call
}

// run does one fetch and records what it brought.
func (c *tokenCache) run(call *fetchCall) {
	ctx, cancel := context.WithTimeout(context.Background(), fetchTimeout)
	tok, exp, err := c.fetch(ctx)
	cancel()
	c.mu.Lock()
	// The clock is read after the fetch, which may have taken its whole
	// timeout: whether a token is still valid is judged now.
	now := c.clock.Now()
	c.call, c.lastEnd = nil, now
	got := call.started
	if tok == c.tok {
		got = c.got // the same token again (a file not yet rotated): had when first seen
	}
	switch {
	case err != nil || exp.IsZero():
	case !now.Before(exp):
		err = reasoned(ReasonExpired, fmt.Errorf("its token expired at %s (whatever writes it has not replaced it)", exp.UTC().Format(time.RFC3339)))
	case !now.Before(exp.Add(-c.expiryMargin(got, exp))):
		err = reasoned(ReasonExpired, fmt.Errorf("its token expires at %s, too soon to authenticate with (whatever writes it has not replaced it)", exp.UTC().Format(time.RFC3339)))
	}
	if err != nil {
		err = fmt.Errorf("kafka SASL OAUTHBEARER: %s: %w", c.where, err)
		c.retries++
		if c.failing == nil {
			c.failing = &failure{}
		}
		c.failing.err = err
		c.judgeLocked(now)
		call.err = &SourceError{err}
	} else {
		if c.tok == "" || exp.IsZero() || c.exp.IsZero() || exp.After(c.exp) {
			c.retries = 0
		} else {
			c.retries++ // the same token again: look later, not at once
		}
		c.tok, c.got, c.exp = tok, got, exp
		if c.failing != nil && c.failing.warned {
			c.log.Info("kafka OAUTHBEARER token available again", zap.String("source", c.where), zap.Time("expires", c.exp))
		}
		c.failing = nil
		if c.held {
			c.held = false
			c.hold.Clear()
		}
		call.tok = tok
	}
	c.mu.Unlock()
	close(call.done)
	select {
	case c.wake <- struct{}{}:
	default:
	}
	if c.fetched != nil {
		c.fetched()
	}
}

// judgeLocked says what the failing streak means at now: a fetch
// unanswered for notAnsweringAfter, or by the time the cached token is
// spent, starts one; its first moment is one WARN, naming the source and
// when the current token expires; once no valid token is left, it holds
// delivery. c.mu is held.
func (c *tokenCache) judgeLocked(now time.Time) {
	if c.failing == nil && c.call != nil && (now.Sub(c.call.started) >= notAnsweringAfter || c.tok != "" && !c.exp.IsZero() && !c.validAt(now)) {
		c.failing = &failure{err: reasoned(ReasonNotAnswering, fmt.Errorf("kafka SASL OAUTHBEARER: %s: it has not answered a token request sent at %s", c.where, c.call.started.UTC().Format(time.RFC3339)))}
	}
	f := c.failing
	if f == nil {
		return
	}
	valid := c.validAt(now)
	if !f.warned {
		f.warned = true
		switch {
		case valid:
			c.log.Warn("kafka OAUTHBEARER token not refreshed; the current one is used until it expires, then Kafka connections wait for a new one",
				zap.String("reason", reasonOf(f.err)), zap.Time("expires", c.exp), zap.Duration("expires_in", c.exp.Sub(now).Round(time.Second)), zap.Error(f.err))
		case !errors.Is(f.err, ErrRefused):
			// A refusal with no token to go on is the error that stops
			// the relay, naming what to fix: no WARN before it.
			fields := []zap.Field{zap.String("reason", reasonOf(f.err)), zap.Error(f.err)}
			if c.tok != "" && !c.exp.IsZero() {
				fields = append(fields, zap.Time("expires", c.exp))
			}
			c.log.Warn("kafka OAUTHBEARER token unavailable: Kafka connections wait for it", fields...)
		}
	}
	if !valid && c.hold != nil {
		c.held = true
		c.hold.Hold(reasonOf(f.err), c.holdMessage(f, now))
	}
}

// holdMessage is the one line of a hold by the token source.
func (c *tokenCache) holdMessage(f *failure, now time.Time) string {
	msg := "no valid OAUTHBEARER token to authenticate to Kafka with"
	switch {
	case c.tok == "" || c.exp.IsZero():
	case now.Before(c.exp):
		msg += fmt.Sprintf(" (the last expires at %s, too soon to use)", c.exp.UTC().Format(time.RFC3339))
	default:
		msg += fmt.Sprintf(" (the last expired at %s)", c.exp.UTC().Format(time.RFC3339))
	}
	msg += ": " + f.err.Error()
	switch reasonOf(f.err) {
	case ReasonUnreachable, ReasonNotAnswering:
		msg += ": check the identity provider and the network path to it; Kafka connections authenticate again once it answers"
	case ReasonFailing:
		msg += ": check the identity provider's health and log"
	case ReasonExpired:
		msg += ": check what writes the token"
	}
	return msg
}

// startRefresher starts the refresher, at the first authentication, when
// the cache has a lifetime for it.
func (c *tokenCache) startRefresher() {
	c.mu.Lock()
	c.wake = make(chan struct{}, 1)
	c.mu.Unlock()
	if c.bg != nil {
		go c.refresh(c.bg)
	}
}

// refresh replaces the token when it is due and retries failed fetches
// with backoff, and wakes when a hung fetch or the token's end must be
// reported (judgeLocked), until ctx ends.
func (c *tokenCache) refresh(ctx context.Context) {
	for {
		c.mu.Lock()
		now := c.clock.Now()
		c.judgeLocked(now)
		next, due := c.scheduleLocked(now)
		if due {
			c.fetchLocked(now)
			next, _ = c.scheduleLocked(now)
		}
		wake := c.wake
		c.mu.Unlock()
		var timer <-chan time.Time
		if !next.IsZero() {
			timer = c.clock.At(next)
		}
		select {
		case <-ctx.Done():
			return
		case <-wake:
		case <-timer:
		}
	}
}

// scheduleLocked says whether a fetch is due at now and, if not, the
// next moment the refresher has something to do (zero: none until a
// fetch ends). c.mu is held.
func (c *tokenCache) scheduleLocked(now time.Time) (next time.Time, due bool) {
	earliest := func(t time.Time) {
		if next.IsZero() || t.Before(next) {
			next = t
		}
	}
	switch {
	case c.validAt(now):
		earliest(c.exp.Add(-c.expiryMargin(c.got, c.exp))) // its end: judgeLocked holds
	case c.tok != "" && !c.exp.IsZero() && now.Before(c.exp):
		earliest(c.exp) // its expiry: the hold's message says it expired
	}
	if c.call != nil {
		if c.failing == nil {
			earliest(c.call.started.Add(notAnsweringAfter))
		}
		return next, false
	}
	var at time.Time
	switch {
	case c.tok != "" && !c.exp.IsZero():
		at = c.refreshAt(c.got, c.exp)
	case c.failing != nil:
		at = c.lastEnd // no token: retried after the backoff
	default:
		// No token yet, or tokens without an expiry: fetched when an
		// authentication asks.
		return next, false
	}
	if retry := c.lastEnd.Add(backoff(c.retries)); retry.After(at) {
		at = retry
	}
	if !at.After(now) {
		return next, true
	}
	earliest(at)
	return next, false
}

// jwtExpiry is the exp claim of a JWT, read without verifying it: only to
// know when to fetch the next one (the broker verifies).
func jwtExpiry(tok string) (time.Time, bool) {
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return time.Time{}, false
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return time.Time{}, false
	}
	var claims struct {
		Exp *json.Number `json:"exp"`
	}
	if json.Unmarshal(payload, &claims) != nil || claims.Exp == nil {
		return time.Time{}, false
	}
	f, err := claims.Exp.Float64()
	if err != nil {
		return time.Time{}, false
	}
	sec := int64(f)
	return time.Unix(sec, int64((f-float64(sec))*1e9)), true
}

// redactURL is u without user information and query, which may carry
// credentials.
func redactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "(unparseable URL)"
	}
	p.User, p.RawQuery, p.Fragment = nil, "", ""
	return p.String()
}

// oneLine is s on one line, cut to n runes.
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		s = string(r[:n]) + "…"
	}
	return s
}
