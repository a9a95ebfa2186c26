package integration

// A throwaway OIDC issuer on loopback for the OAUTHBEARER tests: RS256
// keys generated here, a JWKS document Apache Kafka's own validator reads,
// and a client-credentials token endpoint. Started once, before the
// package's Apache Kafka node, whose OAUTH listener trusts it.

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// oidcAudience is the audience the package's broker expects.
const oidcAudience = "walrelay-test-kafka"

// oidcIssuer issues JWTs to the clients registered with it.
type oidcIssuer struct {
	srv *httptest.Server
	key *rsa.PrivateKey

	mu      sync.Mutex
	clients map[string]*oidcClient
}

// oidcClient is a client of the issuer: its secret, its tokens' lifetime,
// and how many tokens it was given.
type oidcClient struct {
	secret string
	life   time.Duration
	issued atomic.Int64

	mu   sync.Mutex
	hung chan struct{} // while not nil, its token requests are taken and not answered
}

// hang makes the issuer take this client's token requests and answer none
// of them (as a SIGSTOPped identity provider, whose kernel still accepts
// connections), until release is called: the requests still open are
// answered then.
func (c *oidcClient) hang() (release func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan struct{})
	c.hung = ch
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			c.hung = nil
			c.mu.Unlock()
			close(ch)
		})
	}
}

var (
	issuerOnce sync.Once
	issuer     *oidcIssuer
)

// testIssuer is the package's issuer, started at the first call.
func testIssuer() *oidcIssuer {
	issuerOnce.Do(func() {
		key, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			panic(err)
		}
		issuer = &oidcIssuer{key: key, clients: map[string]*oidcClient{}}
		mux := http.NewServeMux()
		mux.HandleFunc("/jwks", issuer.jwks)
		mux.HandleFunc("/token", issuer.token)
		issuer.srv = httptest.NewServer(mux)
	})
	return issuer
}

func (o *oidcIssuer) url() string      { return o.srv.URL }
func (o *oidcIssuer) jwksURL() string  { return o.srv.URL + "/jwks" }
func (o *oidcIssuer) tokenURL() string { return o.srv.URL + "/token" }

// client registers a client whose tokens live life.
func (o *oidcIssuer) client(id, secret string, life time.Duration) *oidcClient {
	o.mu.Lock()
	defer o.mu.Unlock()
	c := &oidcClient{secret: secret, life: life}
	o.clients[id] = c
	return c
}

func (o *oidcIssuer) jwks(w http.ResponseWriter, _ *http.Request) {
	enc := base64.RawURLEncoding.EncodeToString
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"keys": []map[string]string{{
		"kty": "RSA", "kid": "k1", "use": "sig", "alg": "RS256",
		"n": enc(o.key.N.Bytes()), "e": enc(big.NewInt(int64(o.key.E)).Bytes()),
	}}})
}

// token answers the client-credentials grant: client authentication by
// HTTP basic or form fields, the audience parameter as the aud claim
// (oidcAudience when absent), scope as the scope claim.
func (o *oidcIssuer) token(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil || r.PostForm.Get("grant_type") != "client_credentials" {
		http.Error(w, `{"error":"unsupported_grant_type"}`, http.StatusBadRequest)
		return
	}
	id, secret, ok := r.BasicAuth()
	if !ok {
		id, secret = r.PostForm.Get("client_id"), r.PostForm.Get("client_secret")
	}
	o.mu.Lock()
	c := o.clients[id]
	o.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if c == nil || c.secret != secret {
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprint(w, `{"error":"invalid_client","error_description":"client authentication failed"}`)
		return
	}
	c.mu.Lock()
	hung := c.hung
	c.mu.Unlock()
	if hung != nil {
		select {
		case <-hung:
		case <-r.Context().Done(): // the client gave up
			return
		}
	}
	aud := r.PostForm.Get("audience")
	if aud == "" {
		aud = oidcAudience
	}
	tok := o.sign(id, aud, r.PostForm.Get("scope"), c.life)
	c.issued.Add(1)
	_ = json.NewEncoder(w).Encode(map[string]any{"access_token": tok, "token_type": "Bearer", "expires_in": int(c.life.Seconds())})
}

// sign makes an RS256 JWT for sub.
func (o *oidcIssuer) sign(sub, aud, scope string, life time.Duration) string {
	enc := base64.RawURLEncoding.EncodeToString
	now := time.Now()
	header, _ := json.Marshal(map[string]string{"alg": "RS256", "typ": "JWT", "kid": "k1"})
	claims := map[string]any{"iss": o.url(), "sub": sub, "aud": aud, "iat": now.Unix(), "exp": now.Add(life).Unix()}
	if scope != "" {
		claims["scope"] = scope
	}
	payload, _ := json.Marshal(claims)
	signed := enc(header) + "." + enc(payload)
	sum := sha256.Sum256([]byte(signed))
	sig, err := rsa.SignPKCS1v15(rand.Reader, o.key, crypto.SHA256, sum[:])
	if err != nil {
		panic(err)
	}
	return signed + "." + enc(sig)
}

// connsTo is the local ports of the ESTABLISHED IPv4 TCP connections to
// port on this machine (from /proc/net/tcp): the clients of a listener.
func connsTo(port int) (map[string]bool, error) {
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return nil, err
	}
	want := fmt.Sprintf(":%04X", port)
	out := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 3 && strings.HasSuffix(f[2], want) && f[3] == "01" {
			out[f[1]] = true
		}
	}
	return out, nil
}
