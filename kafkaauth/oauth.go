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
// the client-credentials grant (TokenURL, ClientID, ClientSecret), or read
// from TokenFile at every authentication (what Kubernetes projected
// service-account tokens and workload-identity agents write and rotate).
type OAuth struct {
	// TokenURL is the token endpoint of the client-credentials grant.
	TokenURL string
	// ClientID and ClientSecret authenticate walrelay to the token
	// endpoint (HTTP basic authentication, or form fields when the
	// endpoint refuses that).
	ClientID     string
	ClientSecret string
	// Scopes and Audience are asked for in the token request (audience as
	// the audience parameter, which Auth0, Keycloak and others read).
	Scopes   []string
	Audience string
	// Extensions are SASL extensions sent with the token (Confluent
	// Cloud's logicalCluster and identityPoolId).
	Extensions map[string]string
	// TokenFile, instead of the token endpoint: a file holding the token,
	// re-read at every authentication.
	TokenFile string
	// RefreshAfter is the part of a token's lifetime after which a new one
	// is fetched (default 0.8, Kafka's sasl.login.refresh.window.factor).
	RefreshAfter float64
	// HTTPClient calls the token endpoint; nil uses one with a 30s
	// timeout.
	HTTPClient *http.Client
}

// Check reports a configuration that cannot work, naming the field.
func (o OAuth) Check() error {
	switch {
	case o.TokenFile != "" && o.TokenURL != "":
		return errors.New("kafkaauth.OAuth.TokenFile and kafkaauth.OAuth.TokenURL are two sources of tokens: give one")
	case o.TokenFile == "" && o.TokenURL == "":
		return errors.New("SASL OAUTHBEARER needs a source of tokens: kafkaauth.OAuth.TokenURL (with kafkaauth.OAuth.ClientID and its secret) or kafkaauth.OAuth.TokenFile")
	case o.TokenURL != "" && o.ClientID == "":
		return errors.New("kafkaauth.OAuth.TokenURL needs kafkaauth.OAuth.ClientID (and kafkaauth.OAuth.ClientSecret)")
	case o.TokenURL != "" && o.ClientSecret == "":
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
	for k := range o.Extensions {
		if k == "" || k == "auth" {
			return fmt.Errorf("kafkaauth.OAuth.Extensions: %q is not a SASL extension name", k)
		}
	}
	return nil
}

// Mechanism is the OAUTHBEARER mechanism of o: each authentication gets the
// cached token, a new one once RefreshAfter of its lifetime passed. A
// token endpoint that refuses the client is an error wrapping ErrRefused;
// one that cannot be reached, or a token file that is missing or holds an
// expired token, is logged at WARN once (until a token is had again) and
// returned as an error, while a cached token that is still valid goes on
// being used.
func (o OAuth) Mechanism(log *zap.Logger) (sasl.Mechanism, error) {
	if err := o.Check(); err != nil {
		return nil, err
	}
	if o.RefreshAfter == 0 {
		o.RefreshAfter = 0.8
	}
	c := &tokenCache{refreshAfter: o.RefreshAfter, log: log, now: time.Now}
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

// clientCredentials fetches a token by the client-credentials grant.
func (o OAuth) clientCredentials() func(context.Context) (string, time.Time, error) {
	cc := clientcredentials.Config{ClientID: o.ClientID, ClientSecret: o.ClientSecret, TokenURL: o.TokenURL, Scopes: o.Scopes}
	if o.Audience != "" {
		cc.EndpointParams = url.Values{"audience": {o.Audience}}
	}
	hc := o.HTTPClient
	if hc == nil {
		hc = &http.Client{Timeout: 30 * time.Second}
	}
	return func(ctx context.Context) (string, time.Time, error) {
		tok, err := cc.Token(context.WithValue(ctx, oauth2.HTTPClient, hc))
		if err != nil {
			return "", time.Time{}, tokenEndpointError(err)
		}
		if tok.AccessToken == "" {
			return "", time.Time{}, errors.New("its answer holds no access_token")
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
		return "", time.Time{}, fmt.Errorf("cannot read it: %w", errors.Unwrap(err))
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", time.Time{}, errors.New("it is empty")
	}
	exp, _ := jwtExpiry(tok)
	return tok, exp, nil
}

// tokenEndpointError is what the token endpoint's failure says, without
// the response body (which a misbehaving endpoint may fill with anything):
// a refusal of the client (an OAuth error code, or 401/403) wraps
// ErrRefused.
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
			return fmt.Errorf("%w: it refused the client: %s: check kafkaauth.OAuth.ClientID and kafkaauth.OAuth.ClientSecret", ErrRefused, what)
		case re.ErrorCode == "invalid_scope" || re.ErrorCode == "invalid_target" || re.ErrorCode == "access_denied" || re.ErrorCode == "invalid_grant" || status == http.StatusForbidden:
			return fmt.Errorf("%w: it refused to grant the token: %s: check kafkaauth.OAuth.Scopes and kafkaauth.OAuth.Audience, and what the client may ask for", ErrRefused, what)
		}
		return fmt.Errorf("it answered %s", what)
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		// url.Error quotes the URL; the caller names it, redacted.
		return fmt.Errorf("cannot reach it: %w", ue.Err)
	}
	return err
}

// tokenCache holds the newest token and when to replace it.
type tokenCache struct {
	fetch        func(context.Context) (tok string, exp time.Time, err error)
	where        string
	refreshAfter float64
	log          *zap.Logger
	now          func() time.Time

	mu      sync.Mutex
	tok     string
	got     time.Time // when tok was fetched
	exp     time.Time // zero: unknown, re-fetched at every authentication
	failing bool      // a WARN was logged and no token was had since
}

func (c *tokenCache) token(ctx context.Context) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if c.tok != "" && !c.exp.IsZero() && now.Before(c.got.Add(time.Duration(c.refreshAfter*float64(c.exp.Sub(c.got))))) {
		return c.tok, nil
	}
	tok, exp, err := c.fetch(ctx)
	if err == nil && !exp.IsZero() && !now.Before(exp) {
		err = fmt.Errorf("its token expired at %s (whatever writes it has not replaced it)", exp.UTC().Format(time.RFC3339))
	}
	if err != nil {
		err = fmt.Errorf("kafka SASL OAUTHBEARER: %s: %w", c.where, err)
		if c.tok != "" && now.Before(c.exp) {
			// The previous token is still valid: use it, and say once
			// that its replacement failed.
			c.warn("kafka OAUTHBEARER token not refreshed; the current one is used until it expires", err, zap.Time("expires", c.exp))
			return c.tok, nil
		}
		if !errors.Is(err, ErrRefused) {
			c.warn("kafka OAUTHBEARER token unavailable: Kafka connections wait for it", err)
		}
		return "", &SourceError{err}
	}
	if c.failing {
		c.log.Info("kafka OAUTHBEARER token available again", zap.String("source", c.where))
	}
	c.tok, c.got, c.exp, c.failing = tok, now, exp, false
	return tok, nil
}

// warn logs msg once per failing streak.
func (c *tokenCache) warn(msg string, err error, fields ...zap.Field) {
	if c.failing {
		return
	}
	c.failing = true
	c.log.Warn(msg, append(fields, zap.Error(err))...)
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
