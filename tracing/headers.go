package tracing

import (
	"context"
	"encoding/hex"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/walrelay/walrelay/decoder"
)

// Headers reads a Kafka record's headers as a propagation.TextMapCarrier:
// Get returns the first header of a key. Set appends (use SetTraceHeaders
// to rewrite a record's trace context in place).
type Headers struct{ H *[]kgo.RecordHeader }

// Get implements propagation.TextMapCarrier.
func (h Headers) Get(key string) string {
	for _, x := range *h.H {
		if x.Key == key {
			return string(x.Value)
		}
	}
	return ""
}

// Set implements propagation.TextMapCarrier.
func (h Headers) Set(key, value string) {
	*h.H = append(*h.H, kgo.RecordHeader{Key: key, Value: []byte(value)})
}

// Keys implements propagation.TextMapCarrier.
func (h Headers) Keys() []string {
	keys := make([]string, len(*h.H))
	for i, x := range *h.H {
		keys[i] = x.Key
	}
	return keys
}

// Extract returns ctx with the W3C trace context of a record's headers as
// its remote parent (ctx unchanged when they carry none, or an invalid
// one).
func Extract(ctx context.Context, headers []kgo.RecordHeader) context.Context {
	return propagation.TraceContext{}.Extract(ctx, Headers{&headers})
}

// traceparentLen is the length of a version 00 W3C traceparent.
const traceparentLen = len("00-") + 32 + len("-") + 16 + len("-") + 2

// appendTraceparent appends sc's W3C traceparent to b, as OpenTelemetry's
// propagator writes it (version 00; the sampled and random flags).
func appendTraceparent(b []byte, sc trace.SpanContext) []byte {
	tid, sid := sc.TraceID(), sc.SpanID()
	flags := sc.TraceFlags() & (trace.FlagsSampled | trace.FlagsRandom)
	b = append(b, "00-"...)
	b = hex.AppendEncode(b, tid[:])
	b = append(b, '-')
	b = hex.AppendEncode(b, sid[:])
	b = append(b, '-')
	return hex.AppendEncode(b, []byte{byte(flags)})
}

// SetTraceHeaders makes rec carry sc as its W3C trace headers: each
// header present is rewritten in place (a tracestate sc does not have is
// removed), and a missing one added when grow is true. Without grow a
// header is never added nor lengthened: the record's size, fitted to its
// topic, does not grow.
func SetTraceHeaders(rec *kgo.Record, sc trace.SpanContext, grow bool) {
	setTraceHeaders(rec, sc, grow, nil)
}

// setTraceHeaders is SetTraceHeaders writing the traceparent into buf's
// memory when it has room (a span's, which outlives the record).
func setTraceHeaders(rec *kgo.Record, sc trace.SpanContext, grow bool, buf []byte) {
	if !sc.IsValid() {
		return
	}
	if cap(buf) < traceparentLen {
		buf = make([]byte, 0, traceparentLen)
	}
	parent := appendTraceparent(buf[:0], sc)
	var state []byte
	if ts := sc.TraceState(); ts.Len() > 0 {
		state = []byte(ts.String())
	}
	hs := rec.Headers
	hasParent, hasState := false, false
	for i := 0; i < len(hs); i++ {
		switch hs[i].Key {
		case decoder.HeaderTraceParent:
			if hasParent || !grow && len(parent) > len(hs[i].Value) {
				continue
			}
			hs[i].Value, hasParent = parent, true
		case decoder.HeaderTraceState:
			switch {
			case state == nil || hasState:
				hs = append(hs[:i], hs[i+1:]...)
				i--
			case grow || len(state) <= len(hs[i].Value):
				hs[i].Value, hasState = state, true
			}
		}
	}
	if grow && !hasParent {
		hs = append(hs, kgo.RecordHeader{Key: decoder.HeaderTraceParent, Value: parent})
	}
	if grow && !hasState && state != nil {
		hs = append(hs, kgo.RecordHeader{Key: decoder.HeaderTraceState, Value: state})
	}
	rec.Headers = hs
}
