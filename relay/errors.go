package relay

// errors.go: how the relay tells what retrying can fix from what it
// cannot (errors that say so themselves: Fatal), and the causes of its
// restarts.

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router"
)

// kafkaConfigError reports a Kafka error retrying cannot fix, as the
// router sorts them (router.ConfigError). An authorization failure is not
// one: an ACL can be granted while the relay waits (kafkaDenied).
func kafkaConfigError(err error) bool {
	var ce *router.ConfigError
	return errors.As(err, &ce)
}

// kafkaDenied reports Kafka's authorizer denying the relay an operation:
// the operator's to fix with an ACL, after which the relay resumes by
// itself.
func kafkaDenied(err error) bool { return router.IsDenied(err) }

// kafkaCause names a failure to make or start a producer for the restarts
// metric.
func kafkaCause(err error) RestartCause {
	if kafkaDenied(err) {
		return CauseKafkaAuthorization
	}
	return CauseKafka
}

// pgAuthError reports PostgreSQL refusing the login: a wrong password
// (28P01) or no pg_hba.conf entry allowing it (28000). Retrying cannot fix
// either.
func pgAuthError(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "28P01" || pgErr.Code == "28000")
}

// certificateError reports a PostgreSQL server certificate that does not
// verify (Kafka's are the router's: router.ConfigError).
func certificateError(err error) bool {
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var verify *tls.CertificateVerificationError
	return errors.As(err, &unknownCA) || errors.As(err, &hostname) || errors.As(err, &verify)
}

// StartupTimeoutError is Run giving up at StartupTimeout without having
// streamed: PostgreSQL or Kafka stayed unreachable, or creating the slot
// kept waiting for transactions to end (Err says which, and what it
// waited for). Unlike the other errors Run returns, a later start may
// succeed by itself, once they are reachable or have ended.
type StartupTimeoutError struct {
	Timeout time.Duration
	Err     error
}

func (e *StartupTimeoutError) Error() string {
	return fmt.Sprintf("gave up after relay.Config.StartupTimeout %s without streaming: %v", e.Timeout, e.Err)
}

func (e *StartupTimeoutError) Unwrap() error { return e.Err }

// Fatal is true: this Run is over (a new one may succeed).
func (e *StartupTimeoutError) Fatal() bool { return true }

// produceError wraps a record Kafka refused for good.
type produceError struct{ err error }

func (e *produceError) Error() string { return e.err.Error() }

func (e *produceError) Unwrap() error { return e.err }

// fatalError marks what restarting will not fix.
type fatalError struct{ err error }

func (e *fatalError) Error() string { return e.err.Error() }

func (e *fatalError) Unwrap() error { return e.err }

// Fatal is true: see fatalError.
func (e *fatalError) Fatal() bool { return true }

// fataler is an error that says whether restarting can fix it: fatalError,
// slot.SetupError, deadletter.InvalidEventError, decoder.Error.
type fataler interface{ Fatal() bool }

// isFatal reports whether any error in err's tree says restarting cannot
// fix it. Errors say so themselves: the relay knows no other package's
// sentinels for this.
func isFatal(err error) bool {
	if f, ok := err.(fataler); ok && f.Fatal() {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return isFatal(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if isFatal(e) {
				return true
			}
		}
	}
	return false
}

// RestartCause says why the relay restarted: the cause label of
// walrelay_stream_restarts_total.
type RestartCause string

const (
	// CauseKafka is a restart because Kafka refused a record for good, a Kafka transaction
	// failed, or no producer could be made.
	CauseKafka RestartCause = "kafka"
	// CauseKafkaAuthorization is a restart because Kafka's authorizer denied the relay an
	// operation it needs (WRITE on a topic or the transactional id): the relay waits, not
	// ready, until an ACL allows it; the log names the principal, the operation and the resource.
	CauseKafkaAuthorization RestartCause = "kafka_authorization"
	// CauseFenced is a restart because another producer took the exactly-once transactional
	// id after another relay took the slot (this one waits as a standby).
	CauseFenced RestartCause = "fenced"
	// CauseSlotBusy is a wait because another client streams from the slot (a standby's
	// wait, not a fault).
	CauseSlotBusy RestartCause = "slot_busy"
	// CauseSilent is a restart because the server sent nothing for Config.ReceiveTimeout.
	CauseSilent RestartCause = "silent"
	// CauseDecode is a restart on a pgoutput message the decoder found malformed.
	CauseDecode RestartCause = "decode"
	// CausePostgres is a restart on an error PostgreSQL reported on the stream.
	CausePostgres RestartCause = "postgres"
	// CauseConnection is any other end of the stream (a broken connection).
	CauseConnection RestartCause = "connection"
	// CauseSetup is a retry because the setup checks at start failed in a way a retry may
	// fix (the database unreachable, say).
	CauseSetup RestartCause = "setup"
)

// RestartCauses lists every RestartCause (a new slice each call).
func RestartCauses() []RestartCause {
	return []RestartCause{CauseKafka, CauseKafkaAuthorization, CauseFenced, CauseSlotBusy, CauseSilent, CauseDecode, CausePostgres, CauseConnection, CauseSetup}
}

// causeOf names a session's end for the restarts metric.
func causeOf(err error) RestartCause {
	var pgErr *pgconn.PgError
	var produceErr *produceError
	var txnErr *kafkaTxnFailure
	switch {
	case errors.Is(err, router.ErrFenced):
		return CauseFenced
	case kafkaDenied(err):
		return CauseKafkaAuthorization
	case errors.As(err, &produceErr), errors.As(err, &txnErr):
		return CauseKafka
	case errors.Is(err, errSlotBusy):
		return CauseSlotBusy
	case errors.Is(err, errServerSilent):
		return CauseSilent
	case errors.Is(err, decoder.ErrMalformed):
		return CauseDecode
	case errors.As(err, &pgErr):
		return CausePostgres
	default:
		return CauseConnection
	}
}
