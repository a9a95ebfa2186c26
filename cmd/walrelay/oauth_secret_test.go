package main

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

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"go.uber.org/zap"
)

// TestKafkaOAuthSecretFileRotates: --kafka-oauth-client-secret-file is
// read again at each request to the token endpoint, so a rotated secret
// (a Kubernetes Secret updated in place) is used without a restart, as
// docs/security.md says.
func TestKafkaOAuthSecretFileRotates(t *testing.T) {
	var mu sync.Mutex
	want := "first-S3cret"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, p, _ := r.BasicAuth()
		mu.Lock()
		ok := p == want
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		if !ok {
			w.WriteHeader(http.StatusUnauthorized)
			fmt.Fprint(w, `{"error":"invalid_client"}`)
			return
		}
		// An opaque token without expires_in: fetched at each
		// authentication, so the test needs no clock.
		fmt.Fprint(w, `{"access_token":"opaque","token_type":"Bearer"}`)
	}))
	defer srv.Close()
	file := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(file, []byte("first-S3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	f := KafkaFlags{KafkaSASLMechanism: "oauthbearer", KafkaOAuthTokenURL: srv.URL, KafkaOAuthClientID: "relay", KafkaOAuthClientSecretFile: file}
	opts, err := f.options(t.Context(), zap.NewNop(), nil)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	mech := cl.OptValue(kgo.SASL).([]sasl.Mechanism)[0]
	if _, _, err := mech.Authenticate(context.Background(), "b:9092"); err != nil {
		t.Fatalf("with the first secret: %v", err)
	}
	mu.Lock()
	want = "second-S3cret"
	mu.Unlock()
	if err := os.WriteFile(file, []byte("second-S3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := mech.Authenticate(context.Background(), "b:9092"); err != nil {
		t.Errorf("after the secret file was rotated: %v, want the new secret read", err)
	}
}

// TestExplainSASLState: ILLEGAL_SASL_STATE, which stopped nothing before
// but named nothing either, says it is Kafka authentication.
func TestExplainSASLState(t *testing.T) {
	f := KafkaFlags{KafkaSASLMechanism: "oauthbearer"}
	err := f.explain(fmt.Errorf("producing: %w", kerr.IllegalSaslState))
	if !errors.Is(err, kerr.IllegalSaslState) || !strings.Contains(err.Error(), "Kafka authentication") {
		t.Errorf("explained as %v, want the error kept and named as Kafka authentication", err)
	}
}
