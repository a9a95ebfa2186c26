package tracing

// producer.go: the relay's producer span per event. It is not an SDK span:
// the SDK's general span (a mutex, attribute de-duplication, copies when
// it ends, then a conversion per attribute at export) cost the relay
// 12-15 µs an event at sampling 1.0, more than the relay's own work; the
// relay's spans all have one shape, so each is a small record, ended into
// the export queue and written straight into OTLP's wire format
// (encode.go). What the spans carry, and the sampling decision (the
// configured Sampler, OTEL_TRACES_SAMPLER), are OpenTelemetry's:
// TestEncodedSpanIsTheSDKs holds the encoding to the SDK's span of the
// same calls.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"reflect"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router"
)

// ScopeName is the instrumentation scope of walrelay's spans.
const ScopeName = "github.com/walrelay/walrelay"

// Span event names on a producer span: where the relay first read the
// event (the end of its wait in the WAL), where it handed the record to
// the Kafka producer (the end of its wait in the relay), and, with
// exactly-once delivery, where Kafka had the record in its open
// transaction (the span ends at the commit).
const (
	EventRead     = "walrelay.read"
	EventProduce  = "walrelay.produce"
	EventKafkaAck = "walrelay.kafka_ack"
)

// AttrDeadLetterReason is the dead-letter reason of a dead-lettered
// event's span (deadletter.Reason, also its error.type).
const AttrDeadLetterReason = attribute.Key("walrelay.dead_letter.reason")

// The attribute keys of a producer span (the messaging conventions).
var (
	keyMessageID        = string(semconv.MessagingMessageIDKey)
	keyMessageKey       = string(semconv.MessagingKafkaMessageKeyKey)
	keyErrorType        = string(semconv.ErrorTypeKey)
	keyPartitionID      = string(semconv.MessagingDestinationPartitionIDKey)
	keyOffset           = string(semconv.MessagingKafkaOffsetKey)
	keyExceptionType    = string(semconv.ExceptionTypeKey)
	keyExceptionMessage = string(semconv.ExceptionMessageKey)
)

// constAttrs are the attributes every producer span has, encoded once.
var constAttrs = func() []byte {
	var b []byte
	for _, kv := range []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationName("send"),
		semconv.MessagingOperationTypeSend,
	} {
		b = appendAttr(b, fSpanAttributes, kv, -1)
	}
	return b
}()

// Producer is the router's Tracer: a producer span per event, parented on
// the W3C trace context its record carries (the writer's), whose context
// then replaces it in the record's headers. Safe for concurrent use.
// Provider.Producer returns the one of a Provider.
type Producer struct {
	sampler sdktrace.Sampler
	q       *queue
	limit   int      // the attribute value length limit (OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT)
	topics  sync.Map // topic → *topicSpan
}

var _ router.Tracer = (*Producer)(nil)

// topicSpan is what the spans of one topic share, made once per topic
// (the router bounds the topics).
type topicSpan struct {
	span        string // the span's name, "send <topic>"
	name        []byte // the Span's encoded name field
	destination []byte // the encoded messaging.destination.name attribute
}

// span is one event's producer span, from Start to the export. It is
// the record's Context from Start to End (embedding the background
// context: the producer asks a record's context for no deadline, value or
// cancellation of the relay's).
type span struct {
	context.Context

	topic        *topicSpan
	traceID      trace.TraceID
	spanID       trace.SpanID
	parentID     trace.SpanID // invalid for a root span
	flags        trace.TraceFlags
	remoteParent bool
	hasKey       bool
	placed       bool // partition and offset set
	partition    int32
	offset       int64

	// Times in Unix nanoseconds (0: none): the commit, read, produce and
	// Kafka's acknowledgement events, the end.
	start, read, produce, acked, end int64

	// idKey holds the event's id then the record's key, copied (the
	// event's memory is not the span's to keep): into short when they
	// fit, as a uuid and a short key do.
	idKey []byte
	idLen int
	short [64]byte

	more  *spanMore // what few spans have
	ended atomic.Bool
	// traceparent is the record's traceparent header's value while the
	// record lives.
	traceparent [traceparentLen]byte
}

// spanMore is what few spans have: kept apart, so that the queue holds
// small spans.
type spanMore struct {
	state        string // the W3C tracestate
	samplerAttrs []attribute.KeyValue
	reason       deadletter.Reason // a dead letter's
	detail       string

	errType, errMessage string // set when a failure ended the span
	errAt               int64
}

// extra is s.more, made when first needed.
func (s *span) extra() *spanMore {
	if s.more == nil {
		s.more = &spanMore{}
	}
	return s.more
}

func (s *span) id() string  { return unsafe.String(unsafe.SliceData(s.idKey), s.idLen) }
func (s *span) key() string { return string(s.idKey[s.idLen:]) }

// Start implements router.Tracer: the span begins at the commit, named
// "send <topic>" as the messaging conventions name a producer's span.
// A span the sampler does not sample costs its span id and the record's
// trace headers, and nothing else.
func (p *Producer) Start(rec *kgo.Record, st router.TraceStart) {
	t := p.topic(rec.Topic)
	parent := parentOf(rec.Headers)
	psc := trace.SpanContextFromContext(parent)
	tid, sid := psc.TraceID(), newSpanID()
	if !psc.IsValid() {
		tid = newTraceID()
	}
	sr := p.sampler.ShouldSample(sdktrace.SamplingParameters{ParentContext: parent, TraceID: tid, Name: t.span, Kind: trace.SpanKindProducer})
	flags := psc.TraceFlags() &^ trace.FlagsSampled
	if sr.Decision == sdktrace.RecordAndSample {
		flags |= trace.FlagsSampled
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: flags, TraceState: sr.Tracestate})
	if !sc.IsSampled() {
		// Not exported (a span the sampler records without sampling is
		// not exported either): only the record's headers change.
		SetTraceHeaders(rec, sc, st.Grow)
		return
	}
	s := &span{
		Context: context.Background(), topic: t, traceID: tid, spanID: sid, parentID: psc.SpanID(), remoteParent: psc.IsRemote(),
		flags: flags, start: st.Commit.UnixNano(), produce: time.Now().UnixNano(), idLen: len(st.ID), hasKey: rec.Key != nil,
	}
	if ts := sr.Tracestate; ts.Len() > 0 {
		s.extra().state = ts.String()
	}
	if len(sr.Attributes) > 0 {
		s.extra().samplerAttrs = sr.Attributes
	}
	if st.Reason != "" {
		s.extra().reason, s.more.detail = st.Reason, st.Detail
	}
	if !st.Read.IsZero() {
		s.read = st.Read.UnixNano()
	}
	s.idKey = s.short[:0]
	if n := len(st.ID) + len(rec.Key); n > len(s.short) {
		s.idKey = make([]byte, 0, n)
	}
	s.idKey = append(append(s.idKey, st.ID...), rec.Key...)
	setTraceHeaders(rec, sc, st.Grow, s.traceparent[:0])
	rec.Context = s
}

// spanOf is the span Start gave rec, nil when none (not sampled).
func spanOf(rec *kgo.Record) *span {
	s, _ := rec.Context.(*span)
	return s
}

// topic is what the spans of topic share.
func (p *Producer) topic(topic string) *topicSpan {
	if t, ok := p.topics.Load(topic); ok {
		return t.(*topicSpan)
	}
	t := &topicSpan{span: "send " + topic}
	t.name = appendStringField(nil, fSpanName, t.span)
	t.destination = appendStringAttr(nil, fSpanAttributes, string(semconv.MessagingDestinationNameKey), topic, p.limit)
	p.topics.Store(topic, t)
	return t
}

// Acked implements router.Tracer.
func (p *Producer) Acked(rec *kgo.Record) {
	s := spanOf(rec)
	if s == nil || s.ended.Load() {
		return
	}
	s.acked = time.Now().UnixNano()
	s.placed, s.partition, s.offset = true, rec.Partition, rec.Offset
}

// End implements router.Tracer: the span goes to the export queue (once:
// a record ended again is ignored).
func (p *Producer) End(rec *kgo.Record, err error) {
	s := spanOf(rec)
	if s == nil || !s.ended.CompareAndSwap(false, true) {
		return
	}
	s.end = time.Now().UnixNano()
	if err != nil {
		m := s.extra()
		m.errType, m.errMessage, m.errAt = typeName(err), err.Error(), s.end
		s.placed = false
	} else {
		s.placed, s.partition, s.offset = true, rec.Partition, rec.Offset
	}
	p.q.add(entry{relay: s})
}

// typeName is the exception.type of err as OpenTelemetry's RecordError
// names it.
func typeName(err error) string {
	t := reflect.TypeOf(err)
	if t.PkgPath() == "" && t.Name() == "" {
		return t.String()
	}
	return fmt.Sprintf("%s.%s", t.PkgPath(), t.Name())
}

// newTraceID and newSpanID are random ids, as the SDK's default
// generator makes them (never all zero).
func newTraceID() (id trace.TraceID) {
	for !id.IsValid() {
		binary.NativeEndian.PutUint64(id[:8], rand.Uint64())
		binary.NativeEndian.PutUint64(id[8:], rand.Uint64())
	}
	return id
}

func newSpanID() (id trace.SpanID) {
	for !id.IsValid() {
		binary.NativeEndian.PutUint64(id[:], rand.Uint64())
	}
	return id
}

// parentOf is the background context with the W3C trace context a
// record's headers carry as its remote parent, read by OpenTelemetry's
// propagator (the background context alone when they carry none, or a
// malformed one).
func parentOf(headers []kgo.RecordHeader) context.Context {
	c := recordCarrier(headers)
	if c.Get(decoder.HeaderTraceParent) == "" {
		return context.Background()
	}
	return propagation.TraceContext{}.Extract(context.Background(), c)
}

// recordCarrier reads a record's headers for the propagator without
// copying the traceparent, which it only parses (a tracestate is copied:
// the parsed one keeps its strings).
type recordCarrier []kgo.RecordHeader

func (c recordCarrier) Get(key string) string {
	for _, h := range c {
		if h.Key == key {
			if key == decoder.HeaderTraceParent {
				return unsafe.String(unsafe.SliceData(h.Value), len(h.Value))
			}
			return string(h.Value)
		}
	}
	return ""
}
func (c recordCarrier) Set(string, string) {}
func (c recordCarrier) Keys() []string {
	keys := make([]string, len(c))
	for i, h := range c {
		keys[i] = h.Key
	}
	return keys
}
