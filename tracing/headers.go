package tracing

import (
	"context"

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

// traceValues is what the W3C propagator writes of a span context.
type traceValues struct{ parent, state string }

func (v *traceValues) Get(string) string { return "" }
func (v *traceValues) Keys() []string    { return nil }
func (v *traceValues) Set(key, value string) {
	switch key {
	case decoder.HeaderTraceParent:
		v.parent = value
	case decoder.HeaderTraceState:
		v.state = value
	}
}

// SetTraceHeaders makes rec carry sc as its W3C trace headers: each
// header present is rewritten in place (a tracestate sc does not have is
// removed), and a missing one added when grow is true. Without grow a
// header is never added nor lengthened: the record's size, fitted to its
// topic, does not grow.
func SetTraceHeaders(rec *kgo.Record, sc trace.SpanContext, grow bool) {
	if !sc.IsValid() {
		return
	}
	var v traceValues
	propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(context.Background(), sc), &v)
	hs := rec.Headers
	hasParent, hasState := false, false
	for i := 0; i < len(hs); i++ {
		switch hs[i].Key {
		case decoder.HeaderTraceParent:
			if hasParent || !grow && len(v.parent) > len(hs[i].Value) {
				continue
			}
			hs[i].Value, hasParent = []byte(v.parent), true
		case decoder.HeaderTraceState:
			switch {
			case v.state == "" || hasState:
				hs = append(hs[:i], hs[i+1:]...)
				i--
			case grow || len(v.state) <= len(hs[i].Value):
				hs[i].Value, hasState = []byte(v.state), true
			}
		}
	}
	if grow && !hasParent {
		hs = append(hs, kgo.RecordHeader{Key: decoder.HeaderTraceParent, Value: []byte(v.parent)})
	}
	if grow && !hasState && v.state != "" {
		hs = append(hs, kgo.RecordHeader{Key: decoder.HeaderTraceState, Value: []byte(v.state)})
	}
	rec.Headers = hs
}
