package router

// deadletter.go: what the producer does with an invalid event. Package
// letter (router/internal/letter) says why an event is invalid and builds
// its dead-letter record, with package deadletter's reasons and headers;
// here the on-invalid policy is applied (fail, skip or
// dead-letter, with the log line and the metric), and the dead letter is
// produced in the event's place: it takes over the event's acker, its
// slot in the in-flight gate and, with exactly-once delivery, its place
// in the open Kafka transaction.

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"

	"go.uber.org/zap"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router/internal/letter"
)

// invalid handles an event that cannot go to its own topic.
func (r *Router) invalid(ev *decoder.Event, lsn decoder.LSN, a Acker, reason deadletter.Reason, detail string, extra ...kgo.RecordHeader) error {
	fields := []zap.Field{
		zap.String("reason", string(reason)), zap.String("detail", detail),
		zap.Stringer("table", ev.Table), zap.Stringer("lsn", lsn), zap.ByteString("id", ev.ID),
	}
	switch r.cfg.OnInvalid {
	case InvalidFail:
		return &deadletter.InvalidEventError{Reason: reason, Detail: detail, Table: ev.Table.String(), LSN: lsn, ID: string(ev.ID)}
	case InvalidSkip:
		r.metrics.EventsDeadLettered.WithLabelValues(string(reason)).Inc()
		r.log.Warn("skipping invalid outbox event", fields...)
		if r.tracer != nil {
			r.traceSkipped(ev, reason, detail)
		}
		return nil
	}
	r.metrics.EventsDeadLettered.WithLabelValues(string(reason)).Inc()
	r.log.Warn("dead-lettering invalid outbox event", fields...)

	l := letter.Letter{Reason: reason, Detail: detail, LSN: lsn, Topic: r.tmpl.Topic(ev.AggregateType), HeaderID: r.cfg.HeaderID, HeaderType: r.cfg.HeaderType, Extra: extra}
	o := &outRecord{topic: r.dlq, ack: a}
	// The dead-letter topic's limit: its own max.message.bytes, read by
	// Start, and --max-record-bytes; less room for the commit time header
	// when the dead letter will carry the produce time.
	limit := r.dlq.maxBytes
	if needsProduceTime(r.dlq, ev.CommitTime) {
		limit -= commitTimeHeaderBytes
	}
	o.rec, o.size = letter.ForEvent(ev, l, r.dlq.name, limit)
	if r.tracer != nil {
		r.traceDeadLetter(o, ev, reason, detail)
	}
	stamp(o)
	return r.produce(o)
}

// invalidValue handles an event whose value Config.Values could not make
// (err): its payload does not match its schema, or the schema is not in
// the registry. The dead letter names the subject and version.
func (r *Router) invalidValue(ev *decoder.Event, lsn decoder.LSN, a Acker, err error) error {
	reason := deadletter.ReasonSchemaMismatch
	var extra []kgo.RecordHeader
	var se *deadletter.SchemaError
	if errors.As(err, &se) {
		if se.Reason != "" {
			reason = se.Reason
		}
		if se.Subject != "" {
			extra = append(extra, kgo.RecordHeader{Key: deadletter.HeaderSchemaSubject, Value: []byte(se.Subject)})
		}
		if se.Version > 0 {
			extra = append(extra, kgo.RecordHeader{Key: deadletter.HeaderSchemaVersion, Value: []byte(strconv.Itoa(se.Version))})
		}
	}
	return r.invalid(ev, lsn, a, reason, err.Error(), extra...)
}

// redirect dead-letters a record Kafka refused because of its topic for
// good (a creation policy; an authorization failure is not one, see
// denied.go), on the promise goroutine: the topic is remembered as refused (its later
// events are dead-lettered by Send), and the record goes to the dead-letter
// topic carrying the original's acker, so the event is acknowledged once
// the dead letter is. With exactly-once delivery the Kafka transaction
// cannot carry on after a failed record: the router fails instead, and
// the next session dead-letters the event before producing it.
func (r *Router) redirect(o *outRecord, err error) {
	t := o.topic
	why := err.Error()
	r.topics.Refuse(t.name, why)
	t.refused.Store(true)
	r.log.Warn("Kafka refuses the topic for good; its events go to the dead-letter topic",
		zap.String("topic", t.name), zap.Error(err))
	if r.txn != nil || r.cfg.OnInvalid == InvalidFail {
		r.fail(fmt.Errorf("produce to %s: %w", t.name, err))
		return
	}
	r.metrics.EventsDeadLettered.WithLabelValues(string(deadletter.ReasonTopicRejected)).Inc()
	if r.cfg.OnInvalid == InvalidSkip {
		o.ack.Ack()
		return
	}
	d := &outRecord{topic: r.dlq, ack: o.ack}
	d.rec, d.size = letter.ForRefused(&o.rec, o.aggType, o.table.String(), o.lsn, why, r.dlq.name, r.dlq.maxBytes-commitTimeHeaderBytes)
	if r.tracer != nil {
		r.traceRedirect(o, d, err)
	}
	stamp(d)
	r.gate.acquire(d.size)
	r.client.TryProduce(context.Background(), &d.rec, r.promise)
}
