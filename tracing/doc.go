// Package tracing is walrelay's OpenTelemetry tracing: one trace from the
// business transaction to the consumer's effect, with the relay's hop in
// it.
//
// The writer's trace context travels in the outbox row (outbox.Writer
// stores it in the traceparent and tracestate columns), and every record
// carries it as the W3C headers traceparent and tracestate (the decoder
// maps those columns). With tracing on, the relay gives each event a
// producer span (Producer, the router's Tracer), parented on the writer's
// context, named and attributed by the OpenTelemetry messaging semantic
// conventions, from the transaction's commit to Kafka's acknowledgement,
// with an event where the relay first read it (the end of its wait in the
// WAL) and where it handed it to the producer (the end of its wait in the
// relay); the record's trace headers then carry the producer span, so the
// consumer's span (inbox) is its child. A dead-lettered event's span has
// an error status and the reason.
//
// One span per event rather than one per Kafka transaction with a link per
// event: each event belongs to its writer's trace, and a span has one
// parent, so only a span per event puts the relay's hop between the
// writer's span and the consumer's in the same trace; a span per Kafka
// transaction would leave each trace without the relay and show the wait
// of none of its events. BENCHMARKS.md measures what it costs.
//
// The producer span is not an SDK span but a small record of the same
// content (producer.go), sampled by the configured OpenTelemetry Sampler
// and written straight into OTLP's wire format (encode.go): the SDK's
// general span and its export cost the relay more per event than the
// relay's own work, these 1-2 µs (BenchmarkSpan).
//
// Tracing is configured by the standard OpenTelemetry environment
// variables (FromEnv) and off by default: with it off the router has no
// Tracer and does no tracing work. Spans are exported over OTLP (gRPC or
// HTTP, OpenTelemetry's clients) through a bounded queue that never
// blocks: a slow or dead collector costs spans, counted in
// walrelay_trace_spans_dropped_total and logged once per streak of
// drops, never an event or its pace.
package tracing
