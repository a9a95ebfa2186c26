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

// The reasons an event is invalid.
const (
	ReasonNoAggregateType Reason = "missing_aggregate_type"
	ReasonNoAggregateID   Reason = "missing_aggregate_id"
	ReasonNoID            Reason = "missing_id"
	ReasonInvalidTopic    Reason = "invalid_topic"
	ReasonTopicRejected   Reason = "topic_rejected"
	ReasonTooLarge        Reason = "record_too_large"
	// ReasonUnmappable is a row of an outbox table that lacked a mapped
	// column when the row was written (decoder.Event.Unmappable): a column
	// dropped or renamed while the relay ran.
	ReasonUnmappable Reason = "unmappable"
	// ReasonUndecodable is a row with a mapped value the decoder cannot
	// render (decoder.Event.Undecodable), such as a binary value of a
	// type --binary does not cover.
	ReasonUndecodable     Reason = "undecodable"
	ReasonTopicNotAllowed Reason = "topic_not_allowed" // not matched by the topic allowlist
	ReasonTooManyTopics   Reason = "too_many_topics"   // past the bound on event topics
)

// Reasons lists every Reason (a new slice each call).
func Reasons() []Reason { return append([]Reason(nil), reasons...) }

var reasons = []Reason{ReasonNoAggregateType, ReasonNoAggregateID, ReasonNoID, ReasonInvalidTopic, ReasonTopicRejected, ReasonTooLarge, ReasonUnmappable,
	ReasonUndecodable, ReasonTopicNotAllowed, ReasonTooManyTopics}

// AboutTopic reports whether the reason concerns the event's topic: the
// dead letter then names that topic (HeaderTopic).
func (r Reason) AboutTopic() bool {
	return r == ReasonInvalidTopic || r == ReasonTopicRejected || r == ReasonTopicNotAllowed || r == ReasonTooManyTopics
}

// Dead-letter header names. The event's own id and type headers keep their
// configured names.
const (
	HeaderReason        = "walrelay.reason"
	HeaderDetail        = "walrelay.detail"
	HeaderTable         = "walrelay.table"
	HeaderLSN           = "walrelay.lsn"
	HeaderAggregateType = "walrelay.aggregate_type"
	HeaderAggregateID   = "walrelay.aggregate_id"
	HeaderTopic         = "walrelay.topic"
	HeaderPayloadOmit   = "walrelay.payload_omitted"
)

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
