package router

// trace.go: the optional hook that gives each event a span (package
// tracing implements it with OpenTelemetry). Config.Tracer nil, the
// default, leaves every path as it is without it: the router tests it
// for nil once where a record is built, sent or acknowledged, and the
// promise is the plain one. With a tracer, each event's record (or its
// dead letter) begins a span when it is handed to the producer, starting
// at the transaction's commit and carrying the time the router was first
// handed the event (the end of its wait in the WAL); the span ends when
// Kafka acknowledges the record, with exactly-once delivery when its Kafka
// transaction commits; or with the error that lost the record (the
// stream then sends it again, under a span of its own).

import (
	"errors"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router/internal/topics"
)

// Tracer follows each event's record from the router to Kafka's
// acknowledgement. Start runs on the goroutine that sends, Acked and End
// on the producer's promise goroutine (End also on the sending goroutine,
// for a Kafka transaction's records): all must be fast and never block.
type Tracer interface {
	// Start begins the span of rec, an event's record (or the dead
	// letter in its place) about to be produced. It may rewrite rec's
	// W3C trace headers (traceparent, tracestate) to carry the span, and
	// keeps what End needs in rec.Context.
	Start(rec *kgo.Record, s TraceStart)
	// Acked tells, with exactly-once delivery, that Kafka has rec
	// (partition and offset set); read_committed consumers see it once
	// its Kafka transaction commits, which End tells.
	Acked(rec *kgo.Record)
	// End ends rec's span: err is nil once Kafka acknowledged rec (with
	// exactly-once delivery, committed its Kafka transaction), else what
	// lost it. A record Kafka refused in a Kafka transaction that is then
	// aborted is ended twice: the Tracer keeps the first.
	End(rec *kgo.Record, err error)
}

// TraceStart is what the router knows of an event when its record's
// span begins.
type TraceStart struct {
	// Commit is the commit time of the event's transaction (a snapshot
	// event's: the snapshot's), on PostgreSQL's clock.
	Commit time.Time
	// Read is when the router was first handed the event: from Commit to
	// Read the event waited in the WAL (and the replication stream), from
	// Read to Start in the relay (the in-flight limit, a new topic).
	Read time.Time
	// ID is the event's id (the id header).
	ID []byte
	// Reason is set for a dead letter (and a skipped invalid event): why
	// the event did not go to its own topic; Detail says more.
	Reason deadletter.Reason
	Detail string
	// Grow lets Start add a traceparent header the record lacks. A dead
	// letter's size was fitted to its topic already: its trace headers
	// are only rewritten, never added.
	Grow bool
}

// ErrSkipped ends the span of an invalid event that on-invalid skip
// dropped: no record was produced for it.
var ErrSkipped = errors.New("invalid event skipped (on-invalid skip): no record")

// ErrAborted ends the spans of the records of an aborted Kafka
// transaction: read_committed consumers never see them, and the stream
// sends their events again.
var ErrAborted = errors.New("kafka transaction aborted: the events are sent again")

// sendTraced is Send with a tracer: it notes when the event was first
// handed over, Send being called again with the same event until it
// returns no channel to wait on.
func (r *Router) sendTraced(ev *decoder.Event, lsn decoder.LSN, a Acker) (<-chan struct{}, error) {
	if r.traceRead.IsZero() {
		r.traceRead = time.Now()
	}
	wait, err := r.send(ev, lsn, a)
	if wait == nil {
		r.traceRead = time.Time{}
	}
	return wait, err
}

// traceRecord begins the span of o, the record of ev for its own topic,
// before its size is checked: the trace headers may change it.
func (r *Router) traceRecord(o *outRecord, ev *decoder.Event) {
	r.tracer.Start(&o.rec, TraceStart{Commit: ev.CommitTime, Read: r.traceRead, ID: ev.ID, Grow: true})
	o.size = topics.RecordSize(o.rec.Key, o.rec.Value, o.rec.Headers)
}

// traceDeadLetter begins the span of o, the dead letter of ev. A span
// begun for ev's own record, which turned out too large, is dropped
// unended: an unended span is never exported.
func (r *Router) traceDeadLetter(o *outRecord, ev *decoder.Event, reason deadletter.Reason, detail string) {
	r.tracer.Start(&o.rec, TraceStart{Commit: ev.CommitTime, Read: r.traceRead, ID: ev.ID, Reason: reason, Detail: detail})
	o.size = topics.RecordSize(o.rec.Key, o.rec.Value, o.rec.Headers)
}

// traceSkipped gives an invalid event that on-invalid skip drops a span
// that ends at once, with the reason.
func (r *Router) traceSkipped(ev *decoder.Event, reason deadletter.Reason, detail string) {
	rec := &kgo.Record{Topic: r.tmpl.Topic(ev.AggregateType), Key: ev.AggregateID, Timestamp: ev.CommitTime}
	for _, h := range ev.Headers {
		if h.Value != nil {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
	}
	r.tracer.Start(rec, TraceStart{Commit: ev.CommitTime, Read: r.traceRead, ID: ev.ID, Reason: reason, Detail: detail})
	r.tracer.End(rec, ErrSkipped)
}

// traceRedirect ends the span of o, a record Kafka refused because of its
// topic, and begins that of d, its dead letter (whose headers carry o's
// span: the dead letter's span is its child).
func (r *Router) traceRedirect(o, d *outRecord, refused error) {
	r.tracer.End(&o.rec, refused)
	o.rec.Context = nil // ended: the promise has nothing more to end
	r.tracer.Start(&d.rec, TraceStart{Commit: o.rec.Timestamp, Read: time.Now(), ID: headerValue(&o.rec, r.cfg.HeaderID), Reason: deadletter.ReasonTopicRejected, Detail: refused.Error()})
	d.size = topics.RecordSize(d.rec.Key, d.rec.Value, d.rec.Headers)
}

// tracedPromise is the promise with a tracer: at-least-once, the span
// ends at the acknowledgement (before the ack, which may confirm it);
// exactly-once, at the Kafka transaction's commit (Txn.traced). A record
// Kafka refused ends its span after onPromise, which may have handed it
// to a dead letter (traceRedirect).
func (r *Router) tracedPromise(rec *kgo.Record, err error) {
	switch {
	case err != nil:
		r.onPromise(rec, err)
		if rec.Context != nil {
			r.tracer.End(rec, err)
		}
		return
	case r.txn == nil:
		r.tracer.End(rec, nil)
	default:
		r.tracer.Acked(rec)
	}
	r.onPromise(rec, nil)
}

// endTraced ends the spans of the lane's open Kafka transaction's
// records: committed (err nil) or aborted.
func (l *lane) endTraced(tr Tracer, err error) {
	for _, rec := range l.traced {
		tr.End(rec, err)
	}
	clear(l.traced)
	l.traced = l.traced[:0]
}

// headerValue is the value of rec's first header named key, or nil.
func headerValue(rec *kgo.Record, key string) []byte {
	for _, h := range rec.Headers {
		if h.Key == key {
			return h.Value
		}
	}
	return nil
}
