package kafkaauth

import (
	"errors"

	"github.com/twmb/franz-go/pkg/kgo"
)

// SourceError is a credential source that gave no credential: a token
// endpoint, a token file, the AWS credential chain. The source logs it
// itself, once per failing streak.
type SourceError struct{ Err error }

func (e *SourceError) Error() string { return e.Err.Error() }
func (e *SourceError) Unwrap() error { return e.Err }

// KafkaAuthentication marks the error as a failure to authenticate to
// Kafka, for a package that must tell it from a refusal of what the
// principal asked (router) without importing this one.
func (e *SourceError) KafkaAuthentication() {}

// QuietLogger is l without the Kafka client's lines about a connection
// whose authentication failed for want of a credential (a SourceError):
// its source already said so once, and the client would repeat it, with a
// stack trace, at every attempt.
func QuietLogger(l kgo.Logger) kgo.Logger { return quietLogger{l} }

type quietLogger struct{ kgo.Logger }

func (q quietLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	for _, v := range keyvals {
		var se *SourceError
		if err, ok := v.(error); ok && errors.As(err, &se) {
			return
		}
	}
	q.Logger.Log(level, msg, keyvals...)
}
