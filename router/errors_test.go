package router

import (
	"crypto/x509"
	"errors"
	"fmt"
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
)

// TestClassify: what only a change of configuration fixes comes out of the
// router as a fatal *ConfigError (credentials, mechanism, certificate, a
// transaction timeout above the broker's, a peer that is no Kafka broker),
// the rest as it was; denials are told apart whether sorted or not.
func TestClassify(t *testing.T) {
	certErr := fmt.Errorf("connect: %w", x509.UnknownAuthorityError{})
	for _, tc := range []struct {
		name           string
		err            error
		config, denied bool
	}{
		{"untrusted certificate", certErr, true, false},
		{"wrong SASL password", kerr.SaslAuthenticationFailed, true, false},
		{"unsupported mechanism", kerr.UnsupportedSaslMechanism, true, false},
		{"transaction timeout above the broker's", fmt.Errorf("init: %w", kerr.InvalidTransactionTimeout), true, false},
		{"PostgreSQL port as broker", errors.New("unable to dial: invalid large response size 1157627904 > limit 104857600: response exceeds BrokerMaxReadBytes"), true, false},
		{"broker down", errors.New("dial tcp 127.0.0.1:9092: connect: connection refused"), false, false},
		{"transactional id not authorized", kerr.TransactionalIDAuthorizationFailed, false, true},
		{"topic denied, sorted", &DeniedError{Operation: "WRITE", Resource: "topic", Name: "t", Err: kerr.TopicAuthorizationFailed}, false, true},
		{"commit not authorized, unsorted", fmt.Errorf("commit: %w", kerr.TransactionalIDAuthorizationFailed), false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := classify(tc.err)
			var ce *ConfigError
			if got := errors.As(err, &ce); got != tc.config {
				t.Errorf("classify = %T %v, config error %v, want %v", err, err, got, tc.config)
			}
			if got := IsDenied(err); got != tc.denied {
				t.Errorf("IsDenied = %v, want %v", got, tc.denied)
			}
			if !errors.Is(err, tc.err) && errors.Unwrap(err) == nil {
				t.Errorf("classify lost the error: %v", err)
			}
		})
	}
	if classify(nil) != nil {
		t.Error("classify(nil) is not nil")
	}
}
