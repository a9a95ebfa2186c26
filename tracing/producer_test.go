package tracing

import (
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/router"
)

const writerTP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

func recorder(sampler sdktrace.Sampler) (*tracetest.SpanRecorder, *Producer) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(sampler))
	return rec, NewProducer(tp)
}

func headerOf(rec *kgo.Record, key string) (string, int) {
	v, n := "", 0
	for _, h := range rec.Headers {
		if h.Key == key {
			v, n = string(h.Value), n+1
		}
	}
	return v, n
}

// TestProducerSpan: a record's span is the child of the writer's context
// its headers carry, runs from the commit to the acknowledgement with the
// read and produce events between, has the messaging attributes and
// where Kafka put the record; and the record then carries the span's
// own context, so that a consumer's span is its child.
func TestProducerSpan(t *testing.T) {
	spans, p := recorder(sdktrace.ParentBased(sdktrace.AlwaysSample()))
	commit := time.Now().Add(-50 * time.Millisecond)
	read := commit.Add(10 * time.Millisecond)
	rec := &kgo.Record{Topic: "outbox.event.order", Key: []byte("order-1"), Headers: []kgo.RecordHeader{
		{Key: "id", Value: []byte("e1")}, {Key: "traceparent", Value: []byte(writerTP)}, {Key: "tracestate", Value: []byte("vendor=abc")},
	}}
	p.Start(rec, router.TraceStart{Commit: commit, Read: read, ID: []byte("e1"), Grow: true})
	rec.Partition, rec.Offset = 2, 41
	p.End(rec, nil)

	ended := spans.Ended()
	if len(ended) != 1 {
		t.Fatalf("%d spans ended, want 1", len(ended))
	}
	s := ended[0]
	if s.Name() != "send outbox.event.order" || s.SpanKind() != trace.SpanKindProducer {
		t.Errorf("span %q kind %v", s.Name(), s.SpanKind())
	}
	if s.Parent().TraceID().String() != "0af7651916cd43dd8448eb211c80319c" || s.Parent().SpanID().String() != "b7ad6b7169203331" || !s.Parent().IsRemote() {
		t.Errorf("parent %v, want the writer's span", s.Parent())
	}
	if !s.StartTime().Equal(commit) || s.EndTime().Before(read) {
		t.Errorf("span from %v to %v, want from the commit %v", s.StartTime(), s.EndTime(), commit)
	}
	if ev := s.Events(); len(ev) != 2 || ev[0].Name != EventRead || !ev[0].Time.Equal(read) || ev[1].Name != EventProduce {
		t.Errorf("events %+v, want %s at the read time and %s", ev, EventRead, EventProduce)
	}
	want := map[string]string{
		"messaging.system": "kafka", "messaging.operation.name": "send", "messaging.operation.type": "send",
		"messaging.destination.name": "outbox.event.order", "messaging.message.id": "e1", "messaging.kafka.message.key": "order-1",
		"messaging.destination.partition.id": "2", "messaging.kafka.offset": "41",
	}
	got := map[string]string{}
	for _, kv := range s.Attributes() {
		got[string(kv.Key)] = kv.Value.String()
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("attribute %s = %q, want %q", k, got[k], v)
		}
	}
	if s.Status().Code == codes.Error {
		t.Errorf("status %+v", s.Status())
	}
	tp, n := headerOf(rec, "traceparent")
	if n != 1 || tp != "00-0af7651916cd43dd8448eb211c80319c-"+s.SpanContext().SpanID().String()+"-01" {
		t.Errorf("record's traceparent %q (%d of them), want the producer span's", tp, n)
	}
	if ts, n := headerOf(rec, "tracestate"); n != 1 || ts != "vendor=abc" {
		t.Errorf("record's tracestate %q (%d), want the writer's carried on", ts, n)
	}
}

// TestProducerDeadLetterAndFailure: a dead letter's span has an error
// status and the reason; a record Kafka refused ends with the error; a
// span the writer's context did not sample records nothing but still
// carries the decision on.
func TestProducerDeadLetterAndFailure(t *testing.T) {
	spans, p := recorder(sdktrace.ParentBased(sdktrace.AlwaysSample()))
	dl := &kgo.Record{Topic: "walrelay.dlq", Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte(writerTP)}}}
	p.Start(dl, router.TraceStart{Commit: time.Now(), Reason: deadletter.ReasonTooLarge, Detail: "record of 2000000 bytes"})
	p.End(dl, nil)
	failed := &kgo.Record{Topic: "t"}
	p.Start(failed, router.TraceStart{Commit: time.Now(), Grow: true})
	p.End(failed, errors.New("NOT_ENOUGH_REPLICAS"))
	ended := spans.Ended()
	if len(ended) != 2 {
		t.Fatalf("%d spans", len(ended))
	}
	if st := ended[0].Status(); st.Code != codes.Error || st.Description != "dead-lettered (record_too_large): record of 2000000 bytes" {
		t.Errorf("dead letter status %+v", st)
	}
	if st := ended[1].Status(); st.Code != codes.Error || st.Description != "NOT_ENOUGH_REPLICAS" {
		t.Errorf("failed record status %+v", st)
	}
	if _, n := headerOf(failed, "traceparent"); n != 1 {
		t.Errorf("a record without a trace context gets the producer span's (grow): %d traceparent headers", n)
	}

	unsampled := &kgo.Record{Topic: "t", Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte(writerTP[:len(writerTP)-2] + "00")}}}
	p.Start(unsampled, router.TraceStart{Commit: time.Now(), Grow: true})
	p.End(unsampled, nil)
	if n := len(spans.Ended()); n != 2 {
		t.Errorf("an unsampled writer's trace recorded a span")
	}
	if tp, _ := headerOf(unsampled, "traceparent"); tp[len(tp)-2:] != "00" || tp[3:35] != writerTP[3:35] {
		t.Errorf("unsampled record's traceparent %q: want the same trace, not sampled", tp)
	}
}

// TestSetTraceHeadersGrow: without grow, no header is added or
// lengthened (a dead letter's size is fitted to its topic).
func TestSetTraceHeadersGrow(t *testing.T) {
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled})
	rec := &kgo.Record{Headers: []kgo.RecordHeader{{Key: "id", Value: []byte("1")}}}
	SetTraceHeaders(rec, sc, false)
	if len(rec.Headers) != 1 {
		t.Errorf("no grow: headers %v", rec.Headers)
	}
	rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: "traceparent", Value: []byte("00-x-01")}, kgo.RecordHeader{Key: "tracestate", Value: []byte("a=1")})
	SetTraceHeaders(rec, sc, false)
	if tp, _ := headerOf(rec, "traceparent"); tp != "00-x-01" {
		t.Errorf("no grow: a short invalid traceparent was lengthened to %q", tp)
	}
	if _, n := headerOf(rec, "tracestate"); n != 0 {
		t.Errorf("a tracestate the span does not have is kept")
	}
	SetTraceHeaders(rec, sc, true)
	if tp, n := headerOf(rec, "traceparent"); n != 1 || tp != "00-01000000000000000000000000000000-0200000000000000-01" {
		t.Errorf("grow: traceparent %q (%d)", tp, n)
	}
}
