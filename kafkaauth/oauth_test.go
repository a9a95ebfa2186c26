package kafkaauth

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// fakeJWT is an unsigned token with exp (the cache reads exp only).
func fakeJWT(n int, exp time.Time) string {
	enc := base64.RawURLEncoding.EncodeToString
	payload, _ := json.Marshal(map[string]any{"n": n, "exp": exp.Unix()})
	return enc([]byte(`{"alg":"none"}`)) + "." + enc(payload) + "." + enc([]byte("sig"))
}

// tokenServer is a client-credentials token endpoint accepting id/secret,
// issuing tokens valid for life; it counts what it issued.
func tokenServer(t *testing.T, id, secret string, life time.Duration) (*httptest.Server, *atomic.Int64) {
	var issued atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, p, ok := r.BasicAuth()
		if !ok {
			_ = r.ParseForm()
			u, p = r.PostForm.Get("client_id"), r.PostForm.Get("client_secret")
		}
		w.Header().Set("Content-Type", "application/json")
		if u != id || p != secret {
			w.WriteHeader(http.StatusUnauthorized)
			fmt.Fprint(w, `{"error":"invalid_client","error_description":"Invalid client credentials"}`)
			return
		}
		n := int(issued.Add(1))
		_ = json.NewEncoder(w).Encode(map[string]any{"access_token": fakeJWT(n, time.Now().Add(life)), "token_type": "Bearer", "expires_in": int(life.Seconds())})
	}))
	t.Cleanup(srv.Close)
	return srv, &issued
}

// authenticate runs one OAUTHBEARER authentication and returns the token
// it sent.
func authenticate(t *testing.T, o OAuth, log *zap.Logger) (string, error) {
	t.Helper()
	mech, err := o.Mechanism(t.Context(), log)
	if err != nil {
		t.Fatal(err)
	}
	_, first, err := mech.Authenticate(context.Background(), "broker:9092")
	if err != nil {
		return "", err
	}
	tok, _, _ := strings.Cut(strings.TrimPrefix(string(first), "n,,\x01auth=Bearer "), "\x01")
	return tok, nil
}

// TestOAuthClientCredentials: a token from the endpoint is sent as the
// bearer token; a wrong secret is ErrRefused naming the client, an
// unreachable endpoint is not ErrRefused and names reaching it; no error
// holds the secret.
func TestOAuthClientCredentials(t *testing.T) {
	const secret = "s3cret-client-Pa55"
	srv, issued := tokenServer(t, "relay", secret, time.Hour)
	o := OAuth{TokenURL: srv.URL + "/token", ClientID: "relay", ClientSecret: secret, Scopes: []string{"kafka"}}
	tok, err := authenticate(t, o, zap.NewNop())
	if exp, ok := jwtExpiry(tok); err != nil || !ok || issued.Load() != 1 || time.Until(exp) < 59*time.Minute {
		t.Fatalf("token %q, %v (issued %d), want the endpoint's first token", tok, err, issued.Load())
	}

	wrong := o
	wrong.ClientSecret = "wr0ng-client-Pa55"
	_, err = authenticate(t, wrong, zap.NewNop())
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "kafkaauth.OAuth.ClientID") || !strings.Contains(err.Error(), "invalid_client") {
		t.Errorf("wrong secret: %v, want ErrRefused naming invalid_client and the client id", err)
	}
	if err != nil && strings.Contains(err.Error(), "Pa55") {
		t.Errorf("the error holds the secret: %v", err)
	}

	addr := closedAddr(t)
	down := o
	down.TokenURL = "http://" + addr + "/token"
	core, logs := observer.New(zapcore.WarnLevel)
	_, err = authenticate(t, down, zap.New(core))
	if err == nil || errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "cannot reach") || !strings.Contains(err.Error(), addr) {
		t.Errorf("unreachable endpoint: %v, want a transient error naming the endpoint", err)
	}
	if logs.Len() != 1 {
		t.Errorf("unreachable endpoint: %d WARN lines, want 1", logs.Len())
	}
}

// closedAddr is a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestOAuthTokenFile: the file is read again at each authentication, and
// an expired token in it is an error, not sent.
func TestOAuthTokenFile(t *testing.T) {
	file := t.TempDir() + "/token"
	write := func(s string) {
		if err := writeFile(file, s); err != nil {
			t.Fatal(err)
		}
	}
	write(fakeJWT(1, time.Now().Add(time.Hour)) + "\n")
	o := OAuth{TokenFile: file}
	mech, err := o.Mechanism(t.Context(), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	send := func() (string, error) {
		_, first, err := mech.Authenticate(context.Background(), "b:9092")
		tok, _, _ := strings.Cut(strings.TrimPrefix(string(first), "n,,\x01auth=Bearer "), "\x01")
		return tok, err
	}
	if tok, err := send(); err != nil || tok != fakeJWT(1, time.Now().Add(time.Hour)) {
		t.Fatalf("first: %q, %v", tok, err)
	}
	// The JWT's exp is an hour away: the cache would keep it; a rotated
	// file must still be read at the next authentication once refresh is
	// due, so the test moves past 80% by writing a token expiring soon.
	write(fakeJWT(2, time.Now().Add(-time.Minute)))
	o2 := OAuth{TokenFile: file}
	mech, _ = o2.Mechanism(t.Context(), zap.NewNop())
	if _, err := send(); err == nil || !strings.Contains(err.Error(), "expired") || !strings.Contains(err.Error(), "kafkaauth.OAuth.TokenFile") {
		t.Errorf("expired token in the file: %v, want an error naming the file and the expiry", err)
	}
}
