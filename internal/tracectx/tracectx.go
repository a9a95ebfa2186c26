// Package tracectx is the one rule the outbox, inbox and tracing packages
// share for choosing the OpenTelemetry propagator that reads and writes a
// trace context: it imports the OpenTelemetry API only, so that the
// outbox, which services link, does not pull in an SDK or an exporter.
package tracectx

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
)

// Propagator returns p when set; else the program's global propagator
// (otel.SetTextMapPropagator); else, when the program set none (the
// global default propagates nothing, which would silently drop every
// trace context), W3C trace context. It is asked per use rather than once,
// so that a propagator set after a Writer or Consumer was made still
// counts.
func Propagator(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p != nil {
		return p
	}
	if g := otel.GetTextMapPropagator(); len(g.Fields()) > 0 {
		return g
	}
	return propagation.TraceContext{}
}
