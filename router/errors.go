package router

// errors.go: Kafka's errors sorted by how a caller treats them, as pgconn
// sorts PostgreSQL's (SafeToRetry): what only a change of configuration
// fixes is a *ConfigError (Fatal), an authorizer's denial a *DeniedError
// (denied.go: wait for an ACL), a fenced producer ErrFenced (txn.go); the
// rest may pass, and is worth a retry. The router hands out its errors of
// reaching Kafka (Ping, Txn.Init) already sorted.

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"

	"github.com/twmb/franz-go/pkg/kerr"
)

// ConfigError is a Kafka error that retrying cannot fix: wrong SASL
// credentials, an unsupported mechanism, a broker certificate that does
// not verify, a transaction timeout above the broker's
// transaction.max.timeout.ms, a seed broker that does not speak Kafka.
type ConfigError struct{ Err error }

func (e *ConfigError) Error() string { return "kafka: " + e.Err.Error() }
func (e *ConfigError) Unwrap() error { return e.Err }

// Fatal is true: retrying cannot fix a configuration.
func (e *ConfigError) Fatal() bool { return true }

// classify returns err sorted: a *ConfigError for what only a change of
// configuration fixes, else err as it is.
func classify(err error) error {
	var ce *ConfigError
	switch {
	case err == nil || errors.As(err, &ce):
		return err
	case errors.Is(err, kerr.SaslAuthenticationFailed), errors.Is(err, kerr.UnsupportedSaslMechanism),
		errors.Is(err, kerr.IllegalSaslState), errors.Is(err, kerr.InvalidTransactionTimeout), certificateError(err):
		return &ConfigError{err}
	case saysFatal(err):
		// A credential source that says so itself (a token endpoint that
		// refused the client).
		return &ConfigError{err}
	case notKafka(err):
		return &ConfigError{fmt.Errorf("a seed broker (kgo.SeedBrokers) did not answer as a Kafka broker: check the host and port (another service's port, or TLS on one side only?): %w", err)}
	}
	return err
}

// saysFatal reports an error in err's chain that says retrying cannot fix
// it.
func saysFatal(err error) bool {
	var f interface{ Fatal() bool }
	return errors.As(err, &f) && f.Fatal()
}

// notKafka reports a peer that answered, but not in the Kafka protocol:
// its first bytes, read as a Kafka response size, are absurd (PostgreSQL's
// error reply reads as 1157627904). franz-go exports no error value for
// this, so its message is matched.
func notKafka(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "invalid large response size") || strings.Contains(msg, "invalid negative response size")
}

// certificateError reports a server certificate that does not verify.
func certificateError(err error) bool {
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var verify *tls.CertificateVerificationError
	return errors.As(err, &unknownCA) || errors.As(err, &hostname) || errors.As(err, &verify)
}

// IsDenied reports Kafka's authorizer denying an operation: a *DeniedError,
// or one of the error codes it stands for in an error the router did not
// sort (a Kafka transaction's commit). An operator grants the ACL; the
// caller waits for it.
func IsDenied(err error) bool {
	var d *DeniedError
	return errors.As(err, &d) || errors.Is(err, kerr.TopicAuthorizationFailed) ||
		errors.Is(err, kerr.TransactionalIDAuthorizationFailed) || errors.Is(err, kerr.ClusterAuthorizationFailed)
}
