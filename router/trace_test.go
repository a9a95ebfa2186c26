package router

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// fakeTracer records what the router tells a Tracer, one line a call.
type fakeTracer struct {
	mu    sync.Mutex
	calls []string
	start []TraceStart
}

type spanKey struct{}

func (f *fakeTracer) Start(rec *kgo.Record, s TraceStart) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf("start %s %s reason=%s grow=%v", rec.Topic, s.ID, s.Reason, s.Grow))
	f.start = append(f.start, s)
	rec.Context = context.WithValue(context.Background(), spanKey{}, string(s.ID))
}

func (f *fakeTracer) Acked(rec *kgo.Record) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmt.Sprintf("acked %s %v", rec.Topic, rec.Context.Value(spanKey{})))
}

func (f *fakeTracer) End(rec *kgo.Record, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var placed string
	if err == nil {
		placed = fmt.Sprintf("@%d", rec.Offset)
	}
	f.calls = append(f.calls, fmt.Sprintf("end %s %v%s err=%v", rec.Topic, rec.Context.Value(spanKey{}), placed, err))
}

func (f *fakeTracer) lines() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func wantLines(t *testing.T, got []string, want ...string) {
	t.Helper()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("tracer calls:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestTracerAtLeastOnce: each event's record begins a span when it is
// produced and ends it at Kafka's acknowledgement (offset known), before
// the ack; a dead letter's span carries the reason; a skipped invalid
// event gets a span ended at once with ErrSkipped. Start learns the
// commit time and when the event was first handed over.
func TestTracerAtLeastOnce(t *testing.T) {
	tr := &fakeTracer{}
	e := newEnv(t, Config{Tracer: tr})
	a := &testAcker{}
	before := time.Now()
	e.mustSend(event("e1", "order", "k1", `{}`), 1, a)
	e.flush()
	bad := event("e2", "order", "k1", `{}`)
	bad.AggregateID = nil
	e.mustSend(bad, 2, a)
	e.flush()
	wantLines(t, tr.lines(),
		"start outbox.event.order e1 reason= grow=true",
		"end outbox.event.order e1@0 err=<nil>",
		"start walrelay.dlq e2 reason=missing_aggregate_id grow=false",
		"end walrelay.dlq e2@0 err=<nil>",
	)
	if s := tr.start[0]; !s.Commit.Equal(commitTime) || s.Read.Before(before) || s.Read.After(time.Now()) {
		t.Errorf("TraceStart %+v: want the commit time and when Send was first called", s)
	}

	skip := &fakeTracer{}
	e = newEnv(t, Config{Tracer: skip, OnInvalid: InvalidSkip})
	e.mustSend(bad, 3, a)
	wantLines(t, skip.lines(),
		"start outbox.event.order e2 reason=missing_aggregate_id grow=false",
		"end outbox.event.order e2 err="+ErrSkipped.Error(),
	)
}

// TestTracerReadIsTheFirstSend: an event that waits for the in-flight
// limit was read when first handed over, not when the producer took it:
// its wait in the relay shows between the read and the produce events.
func TestTracerReadIsTheFirstSend(t *testing.T) {
	tr := &fakeTracer{}
	e := newEnv(t, Config{Tracer: tr, MaxInflightEvents: 1})
	e.mustSend(event("warm", "order", "k1", `{}`), 1, &testAcker{}) // the topic exists
	e.flush()
	release := make(chan struct{})
	e.c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		e.c.KeepControl()
		e.c.SleepControl(func() { <-release })
		return nil, nil, false
	})
	e.mustSend(event("e1", "order", "k1", `{}`), 2, &testAcker{}) // in flight, held by the broker
	first := time.Now()
	wait, err := e.r.Send(event("e2", "order", "k1", `{}`), 3, &testAcker{})
	if wait == nil || err != nil {
		t.Fatalf("Send at the in-flight limit = %v, %v; want a channel to wait on", wait, err)
	}
	waited := time.Now()
	close(release)
	e.mustSend(event("e2", "order", "k1", `{}`), 3, &testAcker{})
	e.flush()
	if s := tr.start[2]; string(s.ID) != "e2" || s.Read.Before(first) || s.Read.After(waited) {
		t.Errorf("TraceStart %s read at %v, want at its first Send, between %v and %v", s.ID, s.Read, first, waited)
	}
}

// TestTracerExactlyOnce: Kafka's acknowledgement of a record in the open
// transaction is Acked; its span ends at the commit, or with ErrAborted at
// an abort.
func TestTracerExactlyOnce(t *testing.T) {
	tr := &fakeTracer{}
	e := newEnv(t, Config{Tracer: tr, TransactionalID: "walrelay-test"})
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := e.r.Txn().Init(ctx); err != nil {
		t.Fatal(err)
	}
	e.mustSend(event("c1", "order", "k1", `{}`), 1, &testAcker{})
	if err := e.r.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("checkpoint 1")); err != nil {
		t.Fatal(err)
	}
	e.mustSend(event("a1", "order", "k1", `{}`), 2, &testAcker{})
	if err := e.r.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.r.Txn().Abort(ctx); err != nil {
		t.Fatal(err)
	}
	wantLines(t, tr.lines(),
		"start outbox.event.order c1 reason= grow=true",
		"acked outbox.event.order c1",
		"end outbox.event.order c1@0 err=<nil>",
		"start outbox.event.order a1 reason= grow=true",
		"acked outbox.event.order a1",
		"end outbox.event.order a1 err="+ErrAborted.Error(),
	)
}
