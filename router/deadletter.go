package router

import (
	"context"
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
)

// Dead-letter header names. The event's own id and type headers keep their
// configured names.
const (
	HeaderReason        = "walrelay.reason"
	HeaderDetail        = "walrelay.detail"
	HeaderTable         = "walrelay.table"
	HeaderLSN           = "walrelay.lsn"
	HeaderAggregateType = "walrelay.aggregate_type"
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

func (e *InvalidEventError) Error() string {
	return fmt.Sprintf("invalid outbox event (id %q, table %s, LSN %s): %s: %s", e.ID, e.Table, e.LSN, e.Reason, e.Detail)
}

// invalid handles an event that cannot go to its own topic.
func (r *Router) invalid(ev *decoder.Event, lsn decoder.LSN, a Acker, reason Reason, detail string) error {
	r.metrics.EventsDeadLettered.WithLabelValues(string(reason)).Inc()
	fields := []zap.Field{
		zap.String("reason", string(reason)), zap.String("detail", detail),
		zap.Stringer("table", ev.Table), zap.Stringer("lsn", lsn), zap.ByteString("id", ev.ID),
	}
	switch r.cfg.OnInvalid {
	case InvalidFail:
		return &InvalidEventError{Reason: reason, Detail: detail, Table: ev.Table.String(), LSN: lsn, ID: string(ev.ID)}
	case InvalidSkip:
		r.log.Warn("skipping invalid outbox event", fields...)
		return nil
	}
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
	if reason == ReasonInvalidTopic || reason == ReasonTopicRejected {
		h = append(h, kgo.RecordHeader{Key: HeaderTopic, Value: truncate([]byte(r.tmpl.Topic(ev.AggregateType)), 1024)})
	}
	for _, x := range ev.Headers {
		if x.Value != nil {
			h = append(h, kgo.RecordHeader{Key: x.Key, Value: x.Value})
		}
	}
	o.rec.Headers = h
	o.size = recordOverhead + len(o.rec.Key)
	for _, x := range h {
		o.size += len(x.Key) + len(x.Value) + 2
	}
	// The payload rides along when it fits; a record that was too large
	// (or whose headers alone are) keeps only what identifies it.
	if o.size+len(ev.Payload) <= r.cfg.MaxRecordBytes {
		o.rec.Value = ev.Payload
		o.size += len(ev.Payload)
	} else {
		o.rec.Key = truncate(o.rec.Key, 1024)
		o.rec.Headers = append(o.rec.Headers, kgo.RecordHeader{Key: HeaderPayloadOmit, Value: []byte(fmt.Sprint(len(ev.Payload)))})
		o.size = recordOverhead
		for i := range o.rec.Headers {
			x := &o.rec.Headers[i]
			x.Value = truncate(x.Value, 1024)
			o.size += len(x.Key) + len(x.Value) + 2
		}
	}
	r.gate.acquire(o.size)
	a.Add()
	r.client.TryProduce(context.Background(), &o.rec, r.promise)
	return nil
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}
