// Package deadletter decides whether an outbox event is invalid, and why,
// and builds the dead-letter record that carries it: the event's key,
// payload and headers plus headers naming the reason, the table, the LSN
// and the topic it was meant for, shrunk to what the dead-letter topic
// accepts.
//
// It builds records and produces none. Producing a dead letter is the
// router's job: the dead letter replaces the event in the producer's
// in-flight accounting and, with exactly-once delivery, in the open Kafka
// transaction, so the code that sends it stays with the producer. What
// happens to an invalid event (dead-letter, fail, skip: router.OnInvalid)
// is applied there too, with the log line and metric that go with it.
package deadletter

import (
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/topics"
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

// aboutTopic reports whether the reason concerns the event's topic, so
// the dead letter names that topic.
func (r Reason) aboutTopic() bool {
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

// Check finds what makes ev invalid whatever its topic, or "" when
// nothing does: a row its table's columns could not map, a value that
// could not be decoded, or a missing
// aggregate type (unless fixed: a template without placeholder needs
// none), aggregate id or id. Whether its topic will take it is for the
// router and package topics to say.
func Check(ev *decoder.Event, fixed bool) (reason Reason, detail string) {
	switch {
	case ev.Unmappable != nil:
		return ReasonUnmappable, ev.Unmappable.Error()
	case ev.Undecodable != nil:
		return ReasonUndecodable, ev.Undecodable.Error()
	case len(ev.AggregateType) == 0 && !fixed:
		return ReasonNoAggregateType, "aggregate type is NULL or empty"
	case ev.AggregateID == nil:
		return ReasonNoAggregateID, "aggregate id is NULL"
	case ev.ID == nil:
		return ReasonNoID, "id is NULL"
	}
	return "", ""
}

// Letter says what a dead letter is about.
type Letter struct {
	Reason Reason
	Detail string
	LSN    decoder.LSN // the WAL position of the event's message
	// Topic is the topic the event was meant for; named in a header when
	// the reason concerns the topic.
	Topic string
	// HeaderID and HeaderType are the configured names of the event's id
	// and type headers.
	HeaderID, HeaderType string
}

// ForEvent builds the dead letter of ev for the dead-letter topic dlq,
// whose records may be at most maxBytes (topics.RecordSize), and returns
// it with its size. The payload rides along when it fits; a record that
// does not (or whose headers alone do not) keeps only what identifies it,
// with values cut to 1 KiB: Kafka would refuse it for good otherwise, and
// the relay would restart into the same event forever.
func ForEvent(ev *decoder.Event, l Letter, dlq string, maxBytes int) (kgo.Record, int) {
	rec := kgo.Record{Topic: dlq, Key: ev.AggregateID, Timestamp: ev.CommitTime}
	h := []kgo.RecordHeader{
		{Key: HeaderReason, Value: []byte(l.Reason)},
		{Key: HeaderDetail, Value: []byte(l.Detail)},
		{Key: HeaderTable, Value: []byte(ev.Table.String())},
		{Key: HeaderLSN, Value: []byte(l.LSN.String())},
	}
	if ev.ID != nil {
		h = append(h, kgo.RecordHeader{Key: l.HeaderID, Value: ev.ID})
	}
	if ev.Type != nil {
		h = append(h, kgo.RecordHeader{Key: l.HeaderType, Value: ev.Type})
	}
	if ev.AggregateType != nil {
		h = append(h, kgo.RecordHeader{Key: HeaderAggregateType, Value: truncate(ev.AggregateType, 1024)})
	}
	if ev.AggregateID != nil {
		// Also the key, but a header survives tools that show headers only.
		h = append(h, kgo.RecordHeader{Key: HeaderAggregateID, Value: truncate(ev.AggregateID, 1024)})
	}
	if l.Reason.aboutTopic() {
		h = append(h, kgo.RecordHeader{Key: HeaderTopic, Value: truncate([]byte(l.Topic), 1024)})
	}
	for _, x := range ev.Headers {
		if x.Value != nil {
			h = append(h, kgo.RecordHeader{Key: x.Key, Value: x.Value})
		}
	}
	if ev.Omitted > 0 {
		h = append(h, kgo.RecordHeader{Key: HeaderPayloadOmit, Value: []byte(fmt.Sprint(ev.Omitted))})
	}
	rec.Headers = h
	rec.Value = ev.Payload
	size := topics.RecordSize(rec.Key, rec.Value, h)
	if size > maxBytes {
		rec.Value = nil
		rec.Key = truncate(rec.Key, 1024)
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: HeaderPayloadOmit, Value: []byte(fmt.Sprint(len(ev.Payload)))})
		for i := range rec.Headers {
			rec.Headers[i].Value = truncate(rec.Headers[i].Value, 1024)
		}
		size = topics.RecordSize(rec.Key, nil, rec.Headers)
	}
	return rec, size
}

// ForRefused builds the dead letter of orig, a record of table's event at
// lsn that Kafka refused because of its topic (why), for the dead-letter
// topic dlq, and returns it with its size. It keeps orig's key, value and
// headers; the value is left out when the record would exceed maxBytes.
func ForRefused(orig *kgo.Record, table string, lsn decoder.LSN, why, dlq string, maxBytes int) (kgo.Record, int) {
	rec := kgo.Record{Topic: dlq, Key: orig.Key, Timestamp: orig.Timestamp}
	h := []kgo.RecordHeader{
		{Key: HeaderReason, Value: []byte(ReasonTopicRejected)},
		{Key: HeaderDetail, Value: truncate([]byte(why), 1024)},
		{Key: HeaderTable, Value: []byte(table)},
		{Key: HeaderLSN, Value: []byte(lsn.String())},
		{Key: HeaderTopic, Value: []byte(orig.Topic)},
	}
	h = append(h, orig.Headers...)
	rec.Headers = h
	rec.Value = orig.Value
	size := topics.RecordSize(rec.Key, rec.Value, h)
	if size > maxBytes {
		rec.Value = nil
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: HeaderPayloadOmit, Value: []byte(strconv.Itoa(len(orig.Value)))})
		size = topics.RecordSize(rec.Key, nil, rec.Headers)
	}
	return rec, size
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}
