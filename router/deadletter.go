package router

import (
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
)

// Reason says why an event is invalid. It is the value of the dead-letter
// record's walrelay.reason header and of the metric's reason label.
type Reason string

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
	ReasonUnmappable      Reason = "unmappable"
	ReasonTopicNotAllowed Reason = "topic_not_allowed" // not matched by Config.TopicAllow
	ReasonTooManyTopics   Reason = "too_many_topics"   // past Config.MaxTopics
)

// Reasons lists every Reason (a new slice each call).
func Reasons() []Reason { return append([]Reason(nil), reasons...) }

var reasons = []Reason{ReasonNoAggregateType, ReasonNoAggregateID, ReasonNoID, ReasonInvalidTopic, ReasonTopicRejected, ReasonTooLarge, ReasonUnmappable,
	ReasonTopicNotAllowed, ReasonTooManyTopics}

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

// InvalidEventError is returned by Send for an invalid event when
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

// invalid handles an event that cannot go to its own topic.
func (r *Router) invalid(ev *decoder.Event, lsn decoder.LSN, a Acker, reason Reason, detail string) error {
	fields := []zap.Field{
		zap.String("reason", string(reason)), zap.String("detail", detail),
		zap.Stringer("table", ev.Table), zap.Stringer("lsn", lsn), zap.ByteString("id", ev.ID),
	}
	switch r.cfg.OnInvalid {
	case InvalidFail:
		return &InvalidEventError{Reason: reason, Detail: detail, Table: ev.Table.String(), LSN: lsn, ID: string(ev.ID)}
	case InvalidSkip:
		r.metrics.EventsDeadLettered.WithLabelValues(string(reason)).Inc()
		r.log.Warn("skipping invalid outbox event", fields...)
		return nil
	}
	r.metrics.EventsDeadLettered.WithLabelValues(string(reason)).Inc()
	r.log.Warn("dead-lettering invalid outbox event", fields...)

	o := &outRecord{topic: r.dlq, ack: a}
	o.rec.Topic = r.dlq.name
	o.rec.Key = ev.AggregateID
	o.rec.Timestamp = ev.CommitTime
	h := []kgo.RecordHeader{
		{Key: HeaderReason, Value: []byte(reason)},
		{Key: HeaderDetail, Value: []byte(detail)},
		{Key: HeaderTable, Value: []byte(ev.Table.String())},
		{Key: HeaderLSN, Value: []byte(lsn.String())},
	}
	if ev.ID != nil {
		h = append(h, kgo.RecordHeader{Key: r.cfg.HeaderID, Value: ev.ID})
	}
	if ev.Type != nil {
		h = append(h, kgo.RecordHeader{Key: r.cfg.HeaderType, Value: ev.Type})
	}
	if ev.AggregateType != nil {
		h = append(h, kgo.RecordHeader{Key: HeaderAggregateType, Value: truncate(ev.AggregateType, 1024)})
	}
	if ev.AggregateID != nil {
		// Also the key, but a header survives tools that show headers only.
		h = append(h, kgo.RecordHeader{Key: HeaderAggregateID, Value: truncate(ev.AggregateID, 1024)})
	}
	if reason == ReasonInvalidTopic || reason == ReasonTopicRejected || reason == ReasonTopicNotAllowed || reason == ReasonTooManyTopics {
		h = append(h, kgo.RecordHeader{Key: HeaderTopic, Value: truncate([]byte(r.tmpl.Topic(ev.AggregateType)), 1024)})
	}
	for _, x := range ev.Headers {
		if x.Value != nil {
			h = append(h, kgo.RecordHeader{Key: x.Key, Value: x.Value})
		}
	}
	if ev.Omitted > 0 {
		h = append(h, kgo.RecordHeader{Key: HeaderPayloadOmit, Value: []byte(fmt.Sprint(ev.Omitted))})
	}
	o.rec.Headers = h
	// The payload rides along when it fits the dead-letter topic (its own
	// max.message.bytes, read by Start, and --max-record-bytes); a record
	// that does not (or whose headers alone do not) keeps only what
	// identifies it. Kafka would refuse it for good otherwise, and the
	// relay would restart into the same event forever.
	o.rec.Value = ev.Payload
	o.size = recordSize(o.rec.Key, o.rec.Value, h)
	if o.size > r.dlq.maxBytes {
		o.rec.Value = nil
		o.rec.Key = truncate(o.rec.Key, 1024)
		o.rec.Headers = append(o.rec.Headers, kgo.RecordHeader{Key: HeaderPayloadOmit, Value: []byte(fmt.Sprint(len(ev.Payload)))})
		for i := range o.rec.Headers {
			o.rec.Headers[i].Value = truncate(o.rec.Headers[i].Value, 1024)
		}
		o.size = recordSize(o.rec.Key, nil, o.rec.Headers)
	}
	return r.produce(o)
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}
