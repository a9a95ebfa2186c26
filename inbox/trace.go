package inbox

// trace.go: a consumer span per handled message. Its parent is the trace
// context the record carries (walrelay's producer span, whose parent is
// the writer's span), and the handler's ctx carries it, so that the
// effect's own database calls, instrumented or not, join the trace. A
// duplicate, a failed attempt, a dead letter and a rewind are marked on
// it.

import (
	"context"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/walrelay/walrelay/internal/tracectx"
)

// Attributes and events of the consumer span beyond the messaging
// conventions.
const (
	// AttrDuplicate is true on the span of a message whose id was in the
	// inbox already: its handler did not run.
	AttrDuplicate = attribute.Key("inbox.duplicate")
	// AttrDeadLetterReason is the reason of a dead-lettered message
	// (handler-failed, no-id), also its error.type.
	AttrDeadLetterReason = attribute.Key("inbox.dead_letter.reason")
	// AttrAttempt is the attempt of a failed handler call (an event).
	AttrAttempt = attribute.Key("inbox.attempt")
	// EventHandlerFailed marks each failed attempt; EventRewound a
	// transaction that found the partition's position moved (the record
	// is handled again after a rewind).
	EventHandlerFailed = "inbox.handler_failed"
	EventRewound       = "inbox.rewound"
)

// recordHeaders reads a record's headers as a propagation carrier.
type recordHeaders []kgo.RecordHeader

func (h recordHeaders) Get(key string) string {
	for _, x := range h {
		if x.Key == key {
			return string(x.Value)
		}
	}
	return ""
}
func (h recordHeaders) Set(string, string) {}
func (h recordHeaders) Keys() []string {
	keys := make([]string, len(h))
	for i, x := range h {
		keys[i] = x.Key
	}
	return keys
}

// tracer is the consumer's tracer: Config.TracerProvider's, or the
// program's global provider's (which follows an SDK installed later).
func (c *Consumer) newTracer() trace.Tracer {
	tp := c.cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer("github.com/walrelay/walrelay/inbox", trace.WithSchemaURL(semconv.SchemaURL))
}

// startSpan begins the span of handling r, the child of the trace
// context r carries; ctx carries it to the handler.
func (c *Consumer) startSpan(ctx context.Context, r *kgo.Record, id string) (context.Context, trace.Span) {
	ctx = tracectx.Propagator(c.cfg.Propagator).Extract(ctx, recordHeaders(r.Headers))
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationName("process"),
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingDestinationName(r.Topic),
		semconv.MessagingConsumerGroupName(c.cfg.Group),
		semconv.MessagingDestinationPartitionID(strconv.Itoa(int(r.Partition))),
		semconv.MessagingKafkaOffset(int(r.Offset)),
	}
	if id != "" {
		attrs = append(attrs, semconv.MessagingMessageID(id))
	}
	if r.Key != nil {
		attrs = append(attrs, semconv.MessagingKafkaMessageKey(string(r.Key)))
	}
	return c.tracer.Start(ctx, "process "+r.Topic, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}

// endSpan ends the span of a record process left as p.
func endSpan(span trace.Span, p processed) {
	switch p {
	case stopped:
		span.SetStatus(codes.Error, "stopped before the record's transaction committed: it is handled again")
	case moved:
		span.AddEvent(EventRewound)
	}
	span.End()
}

// markDuplicate marks the span of ctx as a duplicate's.
func markDuplicate(ctx context.Context) {
	trace.SpanFromContext(ctx).SetAttributes(AttrDuplicate.Bool(true))
}

// markFailure records a failed handler attempt on the span of ctx.
func markFailure(ctx context.Context, err error, attempt int) {
	span := trace.SpanFromContext(ctx)
	if span.IsRecording() {
		span.RecordError(err, trace.WithAttributes(AttrAttempt.Int(attempt)))
		span.AddEvent(EventHandlerFailed, trace.WithAttributes(AttrAttempt.Int(attempt)))
	}
}

// markDeadLettered gives the span of ctx an error status and the reason.
func markDeadLettered(ctx context.Context, reason, why string) {
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(semconv.ErrorTypeKey.String(reason), AttrDeadLetterReason.String(reason))
	span.SetStatus(codes.Error, "dead-lettered ("+reason+"): "+why)
}
