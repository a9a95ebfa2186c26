package tracing

import (
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"maps"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/router"
)

const writerTP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

// captureClient is an OTLP client that encodes each request as the gRPC
// and HTTP clients do and keeps what a receiver decodes of it.
type captureClient struct {
	mu   sync.Mutex
	reqs []*coltracepb.ExportTraceServiceRequest
}

func (c *captureClient) Start(context.Context) error { return nil }
func (c *captureClient) Stop(context.Context) error  { return nil }
func (c *captureClient) UploadTraces(_ context.Context, rs []*tracepb.ResourceSpans) error {
	b, err := proto.Marshal(&coltracepb.ExportTraceServiceRequest{ResourceSpans: rs})
	if err != nil {
		return err
	}
	got := &coltracepb.ExportTraceServiceRequest{}
	if err := proto.Unmarshal(b, got); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reqs = append(c.reqs, got)
	return nil
}

// spans are the spans received, in order.
func (c *captureClient) spans() []*tracepb.Span {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*tracepb.Span
	for _, r := range c.reqs {
		for _, rs := range r.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				out = append(out, ss.Spans...)
			}
		}
	}
	return out
}

// producer is a Provider's Producer whose spans c receives once flushed.
func producer(t *testing.T, sampler sdktrace.Sampler) (*Producer, *Provider, *captureClient) {
	t.Helper()
	c := &captureClient{}
	p, err := Start(context.Background(), Config{Enabled: true, Sampler: sampler, Delay: time.Hour}, Options{Client: c})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Shutdown(context.Background()) })
	return p.Producer(), p, c
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

// attrs are a span's (or event's) attributes as text.
func attrs(kvs []*commonpb.KeyValue) map[string]string {
	m := map[string]string{}
	for _, kv := range kvs {
		switch v := kv.Value.Value.(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.Key] = v.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.Key] = strconv.FormatInt(v.IntValue, 10)
		default:
			m[kv.Key] = kv.Value.String()
		}
	}
	return m
}

// TestProducerSpan: a record's span is the child of the writer's context
// its headers carry, runs from the commit to the acknowledgement with the
// read and produce events between, has the messaging attributes and
// where Kafka put the record; and the record then carries the span's
// own context, so that a consumer's span is its child.
func TestProducerSpan(t *testing.T) {
	p, prov, c := producer(t, sdktrace.ParentBased(sdktrace.AlwaysSample()))
	commit := time.Now().Add(-50 * time.Millisecond)
	read := commit.Add(10 * time.Millisecond)
	rec := &kgo.Record{Topic: "outbox.event.order", Key: []byte("order-1"), Headers: []kgo.RecordHeader{
		{Key: "id", Value: []byte("e1")}, {Key: "traceparent", Value: []byte(writerTP)}, {Key: "tracestate", Value: []byte("vendor=abc")},
	}}
	p.Start(rec, router.TraceStart{Commit: commit, Read: read, ID: []byte("e1"), Grow: true})
	rec.Partition, rec.Offset = 2, 41
	p.End(rec, nil)
	if err := prov.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}

	ended := c.spans()
	if len(ended) != 1 {
		t.Fatalf("%d spans exported, want 1", len(ended))
	}
	s := ended[0]
	if s.Name != "send outbox.event.order" || s.Kind != tracepb.Span_SPAN_KIND_PRODUCER {
		t.Errorf("span %q kind %v", s.Name, s.Kind)
	}
	if hex.EncodeToString(s.TraceId) != "0af7651916cd43dd8448eb211c80319c" || hex.EncodeToString(s.ParentSpanId) != "b7ad6b7169203331" ||
		s.Flags != 0x01|flagHasIsRemote|flagIsRemote || s.TraceState != "vendor=abc" {
		t.Errorf("trace %x parent %x flags %#x state %q, want the writer's span, remote, sampled", s.TraceId, s.ParentSpanId, s.Flags, s.TraceState)
	}
	if s.StartTimeUnixNano != uint64(commit.UnixNano()) || s.EndTimeUnixNano < uint64(read.UnixNano()) {
		t.Errorf("span from %d to %d, want from the commit %d", s.StartTimeUnixNano, s.EndTimeUnixNano, commit.UnixNano())
	}
	if ev := s.Events; len(ev) != 2 || ev[0].Name != EventRead || ev[0].TimeUnixNano != uint64(read.UnixNano()) || ev[1].Name != EventProduce ||
		ev[1].TimeUnixNano < ev[0].TimeUnixNano || ev[1].TimeUnixNano > s.EndTimeUnixNano {
		t.Errorf("events %+v, want %s at the read time and %s", ev, EventRead, EventProduce)
	}
	want := map[string]string{
		"messaging.system": "kafka", "messaging.operation.name": "send", "messaging.operation.type": "send",
		"messaging.destination.name": "outbox.event.order", "messaging.message.id": "e1", "messaging.kafka.message.key": "order-1",
		"messaging.destination.partition.id": "2", "messaging.kafka.offset": "41",
	}
	if got := attrs(s.Attributes); !maps.Equal(got, want) {
		t.Errorf("attributes %v, want %v", got, want)
	}
	if s.Status == nil || s.Status.Code != tracepb.Status_STATUS_CODE_UNSET {
		t.Errorf("status %+v", s.Status)
	}
	tp, n := headerOf(rec, "traceparent")
	if n != 1 || tp != "00-0af7651916cd43dd8448eb211c80319c-"+hex.EncodeToString(s.SpanId)+"-01" {
		t.Errorf("record's traceparent %q (%d of them), want the producer span's", tp, n)
	}
	if ts, n := headerOf(rec, "tracestate"); n != 1 || ts != "vendor=abc" {
		t.Errorf("record's tracestate %q (%d), want the writer's carried on", ts, n)
	}
}

// TestProducerDeadLetterAndFailure: a dead letter's span has an error
// status and the reason; a record Kafka refused ends with the error; a
// span the writer's context did not sample is not exported but still
// carries the decision on; a record ended twice has one span.
func TestProducerDeadLetterAndFailure(t *testing.T) {
	p, prov, c := producer(t, sdktrace.ParentBased(sdktrace.AlwaysSample()))
	dl := &kgo.Record{Topic: "walrelay.dlq", Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte(writerTP)}}}
	p.Start(dl, router.TraceStart{Commit: time.Now(), Reason: deadletter.ReasonTooLarge, Detail: "record of 2000000 bytes"})
	p.End(dl, nil)
	failed := &kgo.Record{Topic: "t"}
	p.Start(failed, router.TraceStart{Commit: time.Now(), Grow: true})
	p.End(failed, errors.New("NOT_ENOUGH_REPLICAS"))
	p.End(failed, router.ErrAborted) // an aborted Kafka transaction ends it again
	unsampled := &kgo.Record{Topic: "t", Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte(writerTP[:len(writerTP)-2] + "00")}}}
	p.Start(unsampled, router.TraceStart{Commit: time.Now(), Grow: true})
	p.End(unsampled, nil)
	if err := prov.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}

	ended := c.spans()
	if len(ended) != 2 {
		t.Fatalf("%d spans exported, want the dead letter's and the failed record's", len(ended))
	}
	if st := ended[0].Status; st.Code != tracepb.Status_STATUS_CODE_ERROR || st.Message != "dead-lettered (record_too_large): record of 2000000 bytes" {
		t.Errorf("dead letter status %+v", st)
	}
	if a := attrs(ended[0].Attributes); a["walrelay.dead_letter.reason"] != "record_too_large" || a["error.type"] != "record_too_large" {
		t.Errorf("dead letter attributes %v", a)
	}
	if st := ended[1].Status; st.Code != tracepb.Status_STATUS_CODE_ERROR || st.Message != "NOT_ENOUGH_REPLICAS" {
		t.Errorf("failed record status %+v", st)
	}
	if ev := ended[1].Events; len(ev) != 2 || ev[1].Name != "exception" ||
		!maps.Equal(attrs(ev[1].Attributes), map[string]string{"exception.type": "*errors.errorString", "exception.message": "NOT_ENOUGH_REPLICAS"}) {
		t.Errorf("failed record's events %v, want the exception", ev)
	}
	if _, n := headerOf(failed, "traceparent"); n != 1 {
		t.Errorf("a record without a trace context gets the producer span's (grow): %d traceparent headers", n)
	}
	if tp, _ := headerOf(unsampled, "traceparent"); tp[len(tp)-2:] != "00" || tp[3:35] != writerTP[3:35] || tp == writerTP {
		t.Errorf("unsampled record's traceparent %q: want the same trace, a span of its own, not sampled", tp)
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

// fixedIDs makes the SDK's span take the ids the relay's span drew.
type fixedIDs struct {
	tid trace.TraceID
	sid trace.SpanID
}

func (f fixedIDs) NewIDs(context.Context) (trace.TraceID, trace.SpanID)  { return f.tid, f.sid }
func (f fixedIDs) NewSpanID(context.Context, trace.TraceID) trace.SpanID { return f.sid }

// sdkSpan is what the producer span of rec was when it was an SDK span
// (the code of Producer before it encoded its own), made by the SDK with
// the ids and times of ours, and exported by OpenTelemetry's exporter.
func sdkSpan(t *testing.T, res *resource.Resource, sampler sdktrace.Sampler, headers []kgo.RecordHeader, topic string, key []byte, st router.TraceStart, ours *tracepb.Span, acked bool, partition int32, offset int64, endErr error) *tracepb.ResourceSpans {
	t.Helper()
	var tid trace.TraceID
	var sid trace.SpanID
	copy(tid[:], ours.TraceId)
	copy(sid[:], ours.SpanId)
	tp := sdktrace.NewTracerProvider(sdktrace.WithResource(res), sdktrace.WithSampler(sampler), sdktrace.WithIDGenerator(fixedIDs{tid, sid}))
	tr := tp.Tracer(ScopeName, trace.WithSchemaURL(semconv.SchemaURL))
	at := func(name string) time.Time {
		for _, e := range ours.Events {
			if e.Name == name {
				return time.Unix(0, int64(e.TimeUnixNano))
			}
		}
		return time.Time{}
	}

	parent := Extract(context.Background(), headers)
	_, span := tr.Start(parent, "send "+topic, trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(st.Commit))
	a := []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationName("send"),
		semconv.MessagingOperationTypeSend,
		semconv.MessagingDestinationName(topic),
		semconv.MessagingMessageID(string(st.ID)),
	}
	if key != nil {
		a = append(a, semconv.MessagingKafkaMessageKey(string(key)))
	}
	if st.Reason != "" {
		a = append(a, semconv.ErrorTypeKey.String(string(st.Reason)), AttrDeadLetterReason.String(string(st.Reason)))
		span.SetStatus(codes.Error, "dead-lettered ("+string(st.Reason)+"): "+st.Detail)
	}
	span.SetAttributes(a...)
	if !st.Read.IsZero() {
		span.AddEvent(EventRead, trace.WithTimestamp(st.Read))
	}
	span.AddEvent(EventProduce, trace.WithTimestamp(at(EventProduce)))
	placed := []attribute.KeyValue{semconv.MessagingDestinationPartitionID(strconv.Itoa(int(partition))), semconv.MessagingKafkaOffset(int(offset))}
	if acked {
		span.AddEvent(EventKafkaAck, trace.WithTimestamp(at(EventKafkaAck)))
		span.SetAttributes(placed...)
	}
	if endErr != nil {
		span.RecordError(endErr, trace.WithTimestamp(at("exception")))
		span.SetStatus(codes.Error, endErr.Error())
	} else {
		span.SetAttributes(placed...)
	}
	c := &captureClient{}
	exp, err := otlptrace.New(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	sp := sdktrace.NewSimpleSpanProcessor(exp)
	tp.RegisterSpanProcessor(sp)
	span.End(trace.WithTimestamp(time.Unix(0, int64(ours.EndTimeUnixNano))))
	if err := tp.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(c.reqs) != 1 {
		t.Fatalf("the SDK exported %d requests", len(c.reqs))
	}
	return c.reqs[0].ResourceSpans[0]
}

// TestEncodedSpanIsTheSDKs: what the relay's producer span sends over
// OTLP is what the SDK's span of the same calls sent through
// OpenTelemetry's exporter (the Producer before it encoded its own
// spans): resource, scope, ids, parent, flags, trace state, name, kind,
// times, attributes, events and status, for a root and a child span, a
// dead letter, a failure, an exactly-once acknowledgement, a record
// without a key, a key that is not UTF-8 (which the SDK's exporter could
// not send at all: there it is made valid) and a sampler's attributes.
func TestEncodedSpanIsTheSDKs(t *testing.T) {
	commit := time.Now().Add(-time.Second)
	read := commit.Add(300 * time.Millisecond)
	withState := writerTP[:len(writerTP)-2] + "01"
	for _, tc := range []struct {
		name      string
		headers   []kgo.RecordHeader
		key       []byte
		st        router.TraceStart
		acked     bool
		err       error
		sampler   sdktrace.Sampler
		sdkFailed bool // OpenTelemetry's exporter cannot send it
	}{
		{name: "root", key: []byte("order-1"), st: router.TraceStart{Commit: commit, Read: read, ID: []byte("e1"), Grow: true}},
		{name: "child with tracestate", headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte(withState)}, {Key: "tracestate", Value: []byte("vendor=abc,other=x")}},
			key: []byte("order-2"), st: router.TraceStart{Commit: commit, Read: read, ID: []byte("e2"), Grow: true}},
		{name: "dead letter", headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte(writerTP)}},
			st: router.TraceStart{Commit: commit, ID: []byte("e3"), Reason: deadletter.ReasonTooLarge, Detail: "record of 2000000 bytes"}},
		{name: "failed", key: []byte("k"), st: router.TraceStart{Commit: commit, Read: read, ID: []byte("e4"), Grow: true}, err: errors.New("NOT_ENOUGH_REPLICAS")},
		{name: "exactly-once", key: []byte("k"), st: router.TraceStart{Commit: commit, Read: read, ID: []byte("e5"), Grow: true}, acked: true},
		{name: "no key", st: router.TraceStart{Commit: commit, ID: []byte("e6"), Grow: true}},
		{name: "key not UTF-8", key: []byte("k\xff\xfe"), st: router.TraceStart{Commit: commit, ID: []byte("e7"), Grow: true}, sdkFailed: true},
		{name: "sampler attributes", key: []byte("k"), st: router.TraceStart{Commit: commit, ID: []byte("e8"), Grow: true}, sampler: attrSampler{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sampler := cmp.Or[sdktrace.Sampler](tc.sampler, sdktrace.ParentBased(sdktrace.AlwaysSample()))
			p, prov, c := producer(t, sampler)
			rec := &kgo.Record{Topic: "outbox.event.order", Key: tc.key, Headers: slices.Clone(tc.headers)}
			p.Start(rec, tc.st)
			rec.Partition, rec.Offset = 1, 1234
			if tc.acked {
				p.Acked(rec)
			}
			p.End(rec, tc.err)
			if err := prov.ForceFlush(context.Background()); err != nil {
				t.Fatal(err)
			}
			if len(c.reqs) != 1 {
				t.Fatalf("%d requests exported", len(c.reqs))
			}
			ours := c.reqs[0].ResourceSpans[0]
			span := ours.ScopeSpans[0].Spans[0]
			if tc.sdkFailed {
				// The SDK's span kept the bytes, which protobuf refuses
				// to encode: its export failed, there is nothing to
				// compare with. The relay's span went out, the key made
				// valid.
				if got := attrs(span.Attributes)["messaging.kafka.message.key"]; got != "k\uFFFD\uFFFD" {
					t.Errorf("key %q, want the invalid bytes replaced", got)
				}
				return
			}
			ref := sdkSpan(t, prov.res, sampler, tc.headers, rec.Topic, tc.key, tc.st, span, tc.acked, rec.Partition, rec.Offset, tc.err)
			for _, rs := range []*tracepb.ResourceSpans{ours, ref} {
				for _, s := range rs.ScopeSpans[0].Spans {
					slices.SortFunc(s.Attributes, func(a, b *commonpb.KeyValue) int { return cmp.Compare(a.Key, b.Key) })
				}
				slices.SortFunc(rs.Resource.Attributes, func(a, b *commonpb.KeyValue) int { return cmp.Compare(a.Key, b.Key) })
			}
			if !proto.Equal(ref, ours) {
				t.Errorf("the relay's span differs from the SDK's:\nSDK:   %s\nrelay: %s", prototext.Format(ref), prototext.Format(ours))
			}
		})
	}
}

// attrSampler samples every span and gives it an attribute.
type attrSampler struct{}

func (attrSampler) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	return sdktrace.SamplingResult{Decision: sdktrace.RecordAndSample, Attributes: []attribute.KeyValue{attribute.String("sampler", "yes")},
		Tracestate: trace.SpanContextFromContext(p.ParentContext).TraceState()}
}
func (attrSampler) Description() string { return "attrSampler" }

// TestSpanAllocations: what a span costs in allocations, which the
// relay's rate at sampling 1.0 depends on: a sampled span one (the span,
// with the event's id and key copied into it when they are short), an
// unsampled one its traceparent header; a writer's context adds three
// (the propagator's carrier, the parent's context for the sampler).
func TestSpanAllocations(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ratio   float64
		headers []kgo.RecordHeader
		want    float64
	}{
		{"sampled root", 1, nil, 1},
		{"sampled child", 1, []kgo.RecordHeader{{Key: "traceparent", Value: []byte(writerTP)}}, 4},
		{"unsampled root", 0, nil, 1},
		{"unsampled child", 0, []kgo.RecordHeader{{Key: "traceparent", Value: []byte(writerTP[:len(writerTP)-2] + "00")}}, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _, _ := producer(t, sdktrace.ParentBased(sdktrace.TraceIDRatioBased(tc.ratio)))
			p.q.size = 1 << 30 // room for every span: a drop is not the path measured
			rec := &kgo.Record{Topic: "t", Key: []byte("order-1"), Headers: make([]kgo.RecordHeader, 0, 4)}
			st := router.TraceStart{Commit: time.Now(), Read: time.Now(), ID: []byte("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f"), Grow: true}
			p.Start(rec, st) // the topic's names, made once
			p.End(rec, nil)
			n := testing.AllocsPerRun(1000, func() {
				rec.Headers = append(rec.Headers[:0], tc.headers...)
				rec.Context = nil
				p.Start(rec, st)
				p.End(rec, nil)
			})
			if n > tc.want {
				t.Errorf("%v allocations a span, want %v", n, tc.want)
			}
		})
	}
}
