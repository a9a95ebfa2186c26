package tracing

// encode.go: the relay's producer spans written straight into OTLP's wire
// format. The OTLP clients (otlptracegrpc, otlptracehttp) send messages
// of go.opentelemetry.io/proto/otlp; OpenTelemetry's exporter builds one
// message per span, attribute and event from the SDK's span (some forty
// allocations) and protobuf then encodes them by reflection: 4-5 µs a
// span, as much as the relay spends on an event (BenchmarkSpan). The
// relay's spans all have one shape, so each is encoded here once, with
// protowire, into the fields of its OTLP Span, and the clients carry
// those bytes as the Span message's fields (protobuf marshals a
// message's unrecognised fields as they are): the request on the wire is
// the one OpenTelemetry's exporter would send (TestEncodedSpanIsTheSDKs).

import (
	"math"
	"reflect"
	"strconv"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// The field numbers of the OTLP messages a span is made of, read from
// their generated descriptors rather than written out.
var (
	fSpanTraceID      = field(&tracepb.Span{}, "trace_id")
	fSpanSpanID       = field(&tracepb.Span{}, "span_id")
	fSpanTraceState   = field(&tracepb.Span{}, "trace_state")
	fSpanParentSpanID = field(&tracepb.Span{}, "parent_span_id")
	fSpanFlags        = field(&tracepb.Span{}, "flags")
	fSpanName         = field(&tracepb.Span{}, "name")
	fSpanKind         = field(&tracepb.Span{}, "kind")
	fSpanStart        = field(&tracepb.Span{}, "start_time_unix_nano")
	fSpanEnd          = field(&tracepb.Span{}, "end_time_unix_nano")
	fSpanAttributes   = field(&tracepb.Span{}, "attributes")
	fSpanEvents       = field(&tracepb.Span{}, "events")
	fSpanStatus       = field(&tracepb.Span{}, "status")

	fEventTime       = field(&tracepb.Span_Event{}, "time_unix_nano")
	fEventName       = field(&tracepb.Span_Event{}, "name")
	fEventAttributes = field(&tracepb.Span_Event{}, "attributes")

	fStatusMessage = field(&tracepb.Status{}, "message")
	fStatusCode    = field(&tracepb.Status{}, "code")

	fKVKey   = field(&commonpb.KeyValue{}, "key")
	fKVValue = field(&commonpb.KeyValue{}, "value")

	fAnyString = field(&commonpb.AnyValue{}, "string_value")
	fAnyBool   = field(&commonpb.AnyValue{}, "bool_value")
	fAnyInt    = field(&commonpb.AnyValue{}, "int_value")
	fAnyDouble = field(&commonpb.AnyValue{}, "double_value")
	fAnyArray  = field(&commonpb.AnyValue{}, "array_value")
	fAnyKVList = field(&commonpb.AnyValue{}, "kvlist_value")
	fAnyBytes  = field(&commonpb.AnyValue{}, "bytes_value")

	fArrayValues  = field(&commonpb.ArrayValue{}, "values")
	fKVListValues = field(&commonpb.KeyValueList{}, "values")
)

func field(m protoreflect.ProtoMessage, name protoreflect.Name) protowire.Number {
	f := m.ProtoReflect().Descriptor().Fields().ByName(name)
	if f == nil {
		panic("tracing: OTLP message " + string(m.ProtoReflect().Descriptor().FullName()) + " has no field " + string(name))
	}
	return f.Number()
}

// The span flags OpenTelemetry's exporter sets beside the W3C trace
// flags: whether the parent is remote is known, and whether it is.
const (
	flagHasIsRemote = uint32(tracepb.SpanFlags_SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK)
	flagIsRemote    = uint32(tracepb.SpanFlags_SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK)
)

// appendSpan appends the fields of s's OTLP Span message to b.
func appendSpan(b []byte, s *span, valueLimit int) []byte {
	var more spanMore
	if s.more != nil {
		more = *s.more
	}
	b = appendBytesField(b, fSpanTraceID, s.traceID[:])
	b = appendBytesField(b, fSpanSpanID, s.spanID[:])
	if more.state != "" {
		b = appendStringField(b, fSpanTraceState, more.state)
	}
	flags := uint32(s.flags) | flagHasIsRemote
	if s.parentID.IsValid() {
		b = appendBytesField(b, fSpanParentSpanID, s.parentID[:])
		if s.remoteParent {
			flags |= flagIsRemote
		}
	}
	b = protowire.AppendTag(b, fSpanFlags, protowire.Fixed32Type)
	b = protowire.AppendFixed32(b, flags)
	b = append(b, s.topic.name...) // the name field, encoded once per topic
	b = protowire.AppendTag(b, fSpanKind, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(tracepb.Span_SPAN_KIND_PRODUCER))
	b = protowire.AppendTag(b, fSpanStart, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, unixNano(s.start))
	b = protowire.AppendTag(b, fSpanEnd, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, unixNano(s.end))

	b = append(b, constAttrs...)
	b = append(b, s.topic.destination...)
	b = appendStringAttr(b, fSpanAttributes, keyMessageID, s.id(), valueLimit)
	if s.hasKey {
		b = appendStringAttr(b, fSpanAttributes, keyMessageKey, s.key(), valueLimit)
	}
	if more.reason != "" {
		b = appendStringAttr(b, fSpanAttributes, keyErrorType, string(more.reason), valueLimit)
		b = appendStringAttr(b, fSpanAttributes, string(AttrDeadLetterReason), string(more.reason), valueLimit)
	}
	if s.placed {
		var n [20]byte
		b = appendStringAttr(b, fSpanAttributes, keyPartitionID, string(strconv.AppendInt(n[:0], int64(s.partition), 10)), valueLimit)
		b = appendIntAttr(b, fSpanAttributes, keyOffset, s.offset)
	}
	for _, kv := range more.samplerAttrs {
		b = appendAttr(b, fSpanAttributes, kv, valueLimit)
	}

	if s.read != 0 {
		b = appendEvent(b, EventRead, s.read)
	}
	b = appendEvent(b, EventProduce, s.produce)
	if s.acked != 0 {
		b = appendEvent(b, EventKafkaAck, s.acked)
	}
	if more.errType != "" {
		b = appendExceptionEvent(b, &more, valueLimit)
	}

	// The exporter always sends a status, empty when unset.
	var code tracepb.Status_StatusCode
	msg := ""
	switch {
	case more.errType != "":
		code, msg = tracepb.Status_STATUS_CODE_ERROR, more.errMessage
	case more.reason != "":
		code, msg = tracepb.Status_STATUS_CODE_ERROR, "dead-lettered ("+string(more.reason)+"): "+more.detail
	}
	msg = validUTF8(msg)
	size := 0
	if msg != "" {
		size += protowire.SizeTag(fStatusMessage) + protowire.SizeBytes(len(msg))
	}
	if code != 0 {
		size += protowire.SizeTag(fStatusCode) + protowire.SizeVarint(uint64(code))
	}
	b = protowire.AppendTag(b, fSpanStatus, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	if msg != "" {
		b = appendStringField(b, fStatusMessage, msg)
	}
	if code != 0 {
		b = protowire.AppendTag(b, fStatusCode, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(code))
	}
	return b
}

// unixNano is a span time as OTLP has it: nanoseconds since the epoch,
// none before it.
func unixNano(t int64) uint64 { return uint64(max(t, 0)) }

// appendEvent appends a span event without attributes.
func appendEvent(b []byte, name string, at int64) []byte {
	size := protowire.SizeTag(fEventTime) + protowire.SizeFixed64() + protowire.SizeTag(fEventName) + protowire.SizeBytes(len(name))
	b = protowire.AppendTag(b, fSpanEvents, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	b = protowire.AppendTag(b, fEventTime, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, unixNano(at))
	return appendStringField(b, fEventName, name)
}

// appendExceptionEvent appends the event OpenTelemetry's RecordError
// adds: "exception", with the error's type and message.
func appendExceptionEvent(b []byte, s *spanMore, valueLimit int) []byte {
	var attrs []byte
	attrs = appendStringAttr(attrs, fEventAttributes, keyExceptionType, s.errType, valueLimit)
	attrs = appendStringAttr(attrs, fEventAttributes, keyExceptionMessage, s.errMessage, valueLimit)
	const name = "exception"
	size := protowire.SizeTag(fEventTime) + protowire.SizeFixed64() + protowire.SizeTag(fEventName) + protowire.SizeBytes(len(name)) + len(attrs)
	b = protowire.AppendTag(b, fSpanEvents, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	b = protowire.AppendTag(b, fEventTime, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, unixNano(s.errAt))
	b = appendStringField(b, fEventName, name)
	return append(b, attrs...)
}

func appendBytesField(b []byte, f protowire.Number, v []byte) []byte {
	b = protowire.AppendTag(b, f, protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

func appendStringField(b []byte, f protowire.Number, v string) []byte {
	b = protowire.AppendTag(b, f, protowire.BytesType)
	return protowire.AppendString(b, v)
}

// appendStringAttr appends a KeyValue of a string as field f.
func appendStringAttr(b []byte, f protowire.Number, key, v string, limit int) []byte {
	v = truncate(validUTF8(v), limit)
	anySize := protowire.SizeTag(fAnyString) + protowire.SizeBytes(len(v))
	kvSize := protowire.SizeTag(fKVKey) + protowire.SizeBytes(len(key)) + protowire.SizeTag(fKVValue) + protowire.SizeBytes(anySize)
	b = protowire.AppendTag(b, f, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(kvSize))
	b = appendStringField(b, fKVKey, key)
	b = protowire.AppendTag(b, fKVValue, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(anySize))
	return appendStringField(b, fAnyString, v)
}

// appendIntAttr appends a KeyValue of an int as field f.
func appendIntAttr(b []byte, f protowire.Number, key string, v int64) []byte {
	anySize := protowire.SizeTag(fAnyInt) + protowire.SizeVarint(uint64(v))
	kvSize := protowire.SizeTag(fKVKey) + protowire.SizeBytes(len(key)) + protowire.SizeTag(fKVValue) + protowire.SizeBytes(anySize)
	b = protowire.AppendTag(b, f, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(kvSize))
	b = appendStringField(b, fKVKey, key)
	b = protowire.AppendTag(b, fKVValue, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(anySize))
	b = protowire.AppendTag(b, fAnyInt, protowire.VarintType)
	return protowire.AppendVarint(b, uint64(v))
}

// appendAttr appends any attribute as a KeyValue in field f (a sampler's
// attributes: rare, so built through a scratch buffer).
func appendAttr(b []byte, f protowire.Number, kv attribute.KeyValue, limit int) []byte {
	var m []byte
	m = appendStringField(m, fKVKey, string(kv.Key))
	if v := appendAnyValue(nil, kv.Value, limit); v != nil {
		m = protowire.AppendTag(m, fKVValue, protowire.BytesType)
		m = protowire.AppendBytes(m, v)
	}
	b = protowire.AppendTag(b, f, protowire.BytesType)
	return protowire.AppendBytes(b, m)
}

// appendAnyValue appends the fields of v's OTLP AnyValue, as
// OpenTelemetry's exporter converts each type.
func appendAnyValue(b []byte, v attribute.Value, limit int) []byte {
	switch v.Type() {
	case attribute.BOOL:
		b = protowire.AppendTag(b, fAnyBool, protowire.VarintType)
		return protowire.AppendVarint(b, protowire.EncodeBool(v.AsBool()))
	case attribute.INT64:
		b = protowire.AppendTag(b, fAnyInt, protowire.VarintType)
		return protowire.AppendVarint(b, uint64(v.AsInt64()))
	case attribute.FLOAT64:
		b = protowire.AppendTag(b, fAnyDouble, protowire.Fixed64Type)
		return protowire.AppendFixed64(b, math.Float64bits(v.AsFloat64()))
	case attribute.STRING:
		return appendStringField(b, fAnyString, truncate(validUTF8(v.AsString()), limit))
	case attribute.BYTESLICE:
		return appendBytesField(b, fAnyBytes, v.AsByteSlice())
	case attribute.BOOLSLICE, attribute.INT64SLICE, attribute.FLOAT64SLICE, attribute.STRINGSLICE, attribute.SLICE:
		var arr []byte
		for _, x := range sliceValues(v) {
			arr = protowire.AppendTag(arr, fArrayValues, protowire.BytesType)
			arr = protowire.AppendBytes(arr, appendAnyValue(nil, x, limit))
		}
		return appendBytesField(b, fAnyArray, arr)
	case attribute.MAP:
		var list []byte
		for _, kv := range v.AsMap() {
			list = appendAttr(list, fKVListValues, kv, limit)
		}
		return appendBytesField(b, fAnyKVList, list)
	case attribute.EMPTY:
		return b
	}
	return appendStringField(b, fAnyString, "INVALID")
}

// sliceValues is a slice attribute's elements as values.
func sliceValues(v attribute.Value) []attribute.Value {
	if v.Type() == attribute.SLICE {
		return v.AsSlice()
	}
	rv := reflect.ValueOf(v.AsInterface())
	out := make([]attribute.Value, rv.Len())
	for i := range out {
		switch x := rv.Index(i).Interface().(type) {
		case bool:
			out[i] = attribute.BoolValue(x)
		case int64:
			out[i] = attribute.Int64Value(x)
		case float64:
			out[i] = attribute.Float64Value(x)
		case string:
			out[i] = attribute.StringValue(x)
		}
	}
	return out
}

// validUTF8 is s with invalid UTF-8 replaced: protobuf's strings must be
// UTF-8 (a receiver refuses the request otherwise), and a row's key or id
// may be any bytes.
func validUTF8(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	return toValidUTF8(s)
}

func toValidUTF8(s string) string {
	out := make([]byte, 0, len(s)+8)
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		if r == utf8.RuneError && n == 1 {
			out = append(out, "\uFFFD"...)
		} else {
			out = append(out, s[:n]...)
		}
		s = s[n:]
	}
	return string(out)
}

// truncate cuts s to limit characters at most, as the SDK applies
// OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT (limit < 0: none).
func truncate(s string, limit int) string {
	if limit < 0 || len(s) <= limit {
		return s
	}
	n := 0
	for i := range s {
		if n == limit {
			return s[:i]
		}
		n++
	}
	return s
}

// request is the export request of a batch of the relay's spans. Its
// messages and buffers serve one batch after the other: the client is
// done with them when UploadTraces returns.
type request struct {
	limit int                      // the attribute value length limit
	spans []*span                  // the batch's spans (the queue's scratch)
	rss   []*tracepb.ResourceSpans // the request: the resource, the scope, the spans
	ss    *tracepb.ScopeSpans      // rss's one scope
	msgs  []*tracepb.Span          // the Span messages, each carrying its encoded fields
	buf   []byte                   // the encoded fields of every span
	ends  []int                    // where each span's fields end in buf
}

// newRequest makes the request of spans of res, their resource (its
// attributes encoded once), and of walrelay's scope.
func newRequest(res *resource.Resource, limit int) request {
	r := &resourcepb.Resource{}
	var attrs []byte
	for _, kv := range res.Attributes() {
		attrs = appendAttr(attrs, fResourceAttributes, kv, -1)
	}
	r.ProtoReflect().SetUnknown(attrs)
	ss := &tracepb.ScopeSpans{Scope: &commonpb.InstrumentationScope{Name: ScopeName}, SchemaUrl: semconv.SchemaURL}
	return request{limit: limit, ss: ss, rss: []*tracepb.ResourceSpans{{Resource: r, ScopeSpans: []*tracepb.ScopeSpans{ss}, SchemaUrl: res.SchemaURL()}}}
}

var fResourceAttributes = field(&resourcepb.Resource{}, "attributes")

// encode makes the request of spans.
func (r *request) encode(spans []*span) []*tracepb.ResourceSpans {
	r.buf, r.ends = r.buf[:0], r.ends[:0]
	for _, s := range spans {
		r.buf = appendSpan(r.buf, s, r.limit)
		r.ends = append(r.ends, len(r.buf))
	}
	for len(r.msgs) < len(spans) {
		r.msgs = append(r.msgs, &tracepb.Span{})
	}
	start := 0
	for i, end := range r.ends {
		r.msgs[i].ProtoReflect().SetUnknown(r.buf[start:end:end])
		start = end
	}
	r.ss.Spans = r.msgs[:len(spans)]
	return r.rss
}

// release lets go of the last batch's spans.
func (r *request) release() {
	clear(r.spans)
	r.spans = r.spans[:0]
}
