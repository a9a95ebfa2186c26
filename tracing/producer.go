package tracing

import (
	"context"
	"strconv"
	"sync"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

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

// Producer is the router's Tracer: a producer span per event, parented on
// the W3C trace context its record carries (the writer's), whose context
// then replaces it in the record's headers. Safe for concurrent use.
type Producer struct {
	tracer trace.Tracer
	names  sync.Map // topic → span name
}

var _ router.Tracer = (*Producer)(nil)

// NewProducer returns a Producer making its spans with tp.
func NewProducer(tp trace.TracerProvider) *Producer {
	return &Producer{tracer: tp.Tracer(ScopeName, trace.WithSchemaURL(semconv.SchemaURL))}
}

// Start implements router.Tracer: the span begins at the commit, named
// "send <topic>" as the messaging conventions name a producer's span.
func (p *Producer) Start(rec *kgo.Record, s router.TraceStart) {
	parent := Extract(context.Background(), rec.Headers)
	// The attributes go to a recording span only: an event whose trace
	// is not sampled costs the span's ids and its headers, no more.
	ctx, span := p.tracer.Start(parent, p.spanName(rec.Topic), trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(s.Commit))
	if span.IsRecording() {
		attrs := []attribute.KeyValue{
			semconv.MessagingSystemKafka,
			semconv.MessagingOperationName("send"),
			semconv.MessagingOperationTypeSend,
			semconv.MessagingDestinationName(rec.Topic),
			semconv.MessagingMessageID(string(s.ID)),
		}
		if rec.Key != nil {
			attrs = append(attrs, semconv.MessagingKafkaMessageKey(string(rec.Key)))
		}
		if s.Reason != "" {
			attrs = append(attrs, semconv.ErrorTypeKey.String(string(s.Reason)), AttrDeadLetterReason.String(string(s.Reason)))
			span.SetStatus(codes.Error, "dead-lettered ("+string(s.Reason)+"): "+s.Detail)
		}
		span.SetAttributes(attrs...)
		if !s.Read.IsZero() {
			span.AddEvent(EventRead, trace.WithTimestamp(s.Read))
		}
		span.AddEvent(EventProduce)
	}
	SetTraceHeaders(rec, span.SpanContext(), s.Grow)
	rec.Context = ctx
}

// spanName is "send <topic>", made once per topic (the router bounds the
// topics).
func (p *Producer) spanName(topic string) string {
	if n, ok := p.names.Load(topic); ok {
		return n.(string)
	}
	n := "send " + topic
	p.names.Store(topic, n)
	return n
}

// Acked implements router.Tracer.
func (p *Producer) Acked(rec *kgo.Record) {
	span := trace.SpanFromContext(rec.Context)
	if !span.IsRecording() {
		return
	}
	span.AddEvent(EventKafkaAck)
	span.SetAttributes(placed(rec)...)
}

// End implements router.Tracer.
func (p *Producer) End(rec *kgo.Record, err error) {
	span := trace.SpanFromContext(rec.Context)
	if !span.IsRecording() {
		return
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	} else {
		span.SetAttributes(placed(rec)...)
	}
	span.End()
}

// placed is where Kafka put rec.
func placed(rec *kgo.Record) []attribute.KeyValue {
	return []attribute.KeyValue{
		semconv.MessagingDestinationPartitionID(strconv.Itoa(int(rec.Partition))),
		semconv.MessagingKafkaOffset(int(rec.Offset)),
	}
}
