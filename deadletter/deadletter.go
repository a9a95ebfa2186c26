// Package deadletter is the dead-letter contract consumers read: why an
// outbox event was invalid (Reason, the walrelay.reason header and the
// reason label of walrelay_events_dead_lettered_total) and the names of the
// headers a dead-letter record carries besides the event's own. The
// router builds and produces dead letters (router/internal/letter); this
// package holds only what is public about them.
package deadletter

import (
	"fmt"

	"github.com/walrelay/walrelay/decoder"
)

// Reason says why an event is invalid. It is the value of the dead-letter
// record's walrelay.reason header and of the metric's reason label.
type Reason string

// The reasons an event is invalid. docs/reference/dead-letters.md is
// generated from these comments: they speak to the person reading the
// dead-letter topic.
const (
	// ReasonNoAggregateType: the aggregate type column, which selects the
	// topic, is NULL or empty.
	ReasonNoAggregateType Reason = "missing_aggregate_type"
	// ReasonNoAggregateID: the aggregate id column, the record's key, is
	// NULL.
	ReasonNoAggregateID Reason = "missing_aggregate_id"
	// ReasonNoID: the id column, the id header consumers deduplicate on, is
	// NULL.
	ReasonNoID Reason = "missing_id"
	// ReasonInvalidTopic: the topic template made a name Kafka does not
	// accept (empty, . or .., longer than 249 characters, or with a
	// character outside [a-zA-Z0-9._-]).
	ReasonInvalidTopic Reason = "invalid_topic"
	// ReasonTopicRejected: Kafka refused the topic for good: it does not
	// exist and the relay may not create it (it may describe it, so Kafka
	// says it is missing), or a policy refuses it or its records. It is
	// checked again when the relay replaces its producer (a stream
	// restart); one whose records a policy refused, when the process
	// restarts. A topic the relay may not describe or write to is never
	// rejected: that is an ACL, and the relay waits, not ready, until it
	// is granted (see failures.md).
	ReasonTopicRejected Reason = "topic_rejected"
	// ReasonTooLarge: the record is larger than its topic's
	// max.message.bytes (or the --max-record-bytes bound), or a value of
	// the row was too large to read into memory at all; the payload's size
	// is then in walrelay.payload_omitted.
	ReasonTooLarge Reason = "record_too_large"
	// ReasonUnmappable: the row was written while a mapped column
	// (--column-*, --header-column) was dropped or renamed, so it lacks
	// it. Restarting cannot help: the WAL keeps the row as written.
	ReasonUnmappable Reason = "unmappable"
	// ReasonUndecodable: a mapped value the decoder cannot render, such
	// as a binary value of a type --binary does not cover (a column whose
	// type changed while the relay ran).
	ReasonUndecodable Reason = "undecodable"
	// ReasonTopicNotAllowed: the event's topic does not match the topic
	// allowlist (--topic-allow); the topic is never created.
	ReasonTopicNotAllowed Reason = "topic_not_allowed"
	// ReasonTooManyTopics: the event's topic would be one more than the
	// bound on distinct event topics (--max-topics).
	ReasonTooManyTopics Reason = "too_many_topics"
	// ReasonSchemaMismatch: the payload does not match the schema of its
	// topic or event type (--value-format): not JSON, a field missing or
	// of the wrong type, a value the JSON Schema refuses; or the subject
	// holds a schema of another format, or one that does not compile. The
	// subject and version checked against are in walrelay.schema_subject
	// and walrelay.schema_version.
	ReasonSchemaMismatch Reason = "schema_mismatch"
	// ReasonSchemaNotFound: the registry has no subject (or no such
	// version) for the event's schema; for the record strategies, the
	// event type names the subject. Register the schema, then replay the
	// dead letter.
	ReasonSchemaNotFound Reason = "schema_not_found"
)

// Reasons lists every Reason (a new slice each call).
func Reasons() []Reason { return append([]Reason(nil), reasons...) }

var reasons = []Reason{ReasonNoAggregateType, ReasonNoAggregateID, ReasonNoID, ReasonInvalidTopic, ReasonTopicRejected, ReasonTooLarge, ReasonUnmappable,
	ReasonUndecodable, ReasonTopicNotAllowed, ReasonTooManyTopics, ReasonSchemaMismatch, ReasonSchemaNotFound}

// AboutTopic reports whether the reason concerns the event's topic: the
// dead letter then names that topic (HeaderTopic).
func (r Reason) AboutTopic() bool {
	return r == ReasonInvalidTopic || r == ReasonTopicRejected || r == ReasonTopicNotAllowed || r == ReasonTooManyTopics
}

// Dead-letter header names. The event's own id and type headers keep their
// configured names, and its header columns (--header-column) are carried
// too. docs/reference/dead-letters.md is generated from these comments.
const (
	// HeaderReason is why the event is invalid: a Reason above.
	HeaderReason = "walrelay.reason"
	// HeaderDetail is what was wrong, in words (the column missing,
	// the size and the limit, Kafka's error).
	HeaderDetail = "walrelay.detail"
	// HeaderTable is the outbox table of the row, schema.table.
	HeaderTable = "walrelay.table"
	// HeaderLSN is the WAL position of the row's message; for a row
	// of the initial snapshot, the slot's consistent point.
	HeaderLSN = "walrelay.lsn"
	// HeaderAggregateType is the row's aggregate type, when it is not
	// NULL (its first 1024 bytes).
	HeaderAggregateType = "walrelay.aggregate_type"
	// HeaderAggregateID is the row's aggregate id, when it is not NULL
	// (its first 1024 bytes); it is also the record's key.
	HeaderAggregateID = "walrelay.aggregate_id"
	// HeaderTopic is the topic the event was for, when the reason is
	// about that topic.
	HeaderTopic = "walrelay.topic"
	// HeaderPayloadOmit is the payload's size in bytes when the
	// payload was left out: too large to read, or too large for the
	// dead-letter topic's own max.message.bytes.
	HeaderPayloadOmit = "walrelay.payload_omitted"
	// HeaderSchemaSubject is the schema registry subject the payload
	// was checked against (reasons schema_mismatch, schema_not_found).
	HeaderSchemaSubject = "walrelay.schema_subject"
	// HeaderSchemaVersion is that subject's version, when one was
	// found.
	HeaderSchemaVersion = "walrelay.schema_version"
)

// SchemaError is a payload that cannot become its record value: it does
// not match the schema of its topic or event type, or the schema is not
// in the registry. The router dead-letters the event with Reason.
type SchemaError struct {
	Reason  Reason // ReasonSchemaMismatch or ReasonSchemaNotFound
	Subject string // the subject, when one could be named
	Version int    // the subject's version, 0 when none was found
	ID      int    // the schema's id, 0 when none was found
	Detail  string // what did not match, in words
}

func (e *SchemaError) Error() string {
	switch {
	case e.Subject == "":
		return e.Detail
	case e.Version == 0:
		return fmt.Sprintf("subject %s: %s", e.Subject, e.Detail)
	}
	return fmt.Sprintf("subject %s version %d (schema id %d): %s", e.Subject, e.Version, e.ID, e.Detail)
}

// InvalidEventError is returned by router.Send for an invalid event when
// on-invalid is fail.
type InvalidEventError struct {
	Reason Reason
	Detail string
	Table  string
	LSN    decoder.LSN
	ID     string
}

// Fatal is true: the same row stops the relay again after a restart.
func (e *InvalidEventError) Fatal() bool { return true }

func (e *InvalidEventError) Error() string {
	return fmt.Sprintf("invalid outbox event (id %q, table %s, LSN %s): %s: %s", e.ID, e.Table, e.LSN, e.Reason, e.Detail)
}
