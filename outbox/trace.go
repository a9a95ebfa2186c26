package outbox

// trace.go: the writer's trace context in the outbox row. Write stores
// the W3C trace context of its ctx (traceparent, tracestate, written by
// the configured OpenTelemetry propagator) in columns of those names,
// which walrelay sends as the record's traceparent and tracestate headers
// and parents its producer span on: one trace from the business
// transaction to the consumer's effect. A table created before these
// columns keeps working: the Writer asks PostgreSQL once which of them
// the table has and writes only those, and writes none when ctx carries
// no trace context (the INSERT is then the same as without tracing).

import (
	"context"
	"fmt"
	"slices"

	"go.opentelemetry.io/otel/trace"

	"github.com/walrelay/walrelay/internal/tracectx"
)

// The trace context columns, named as the W3C headers they become.
const (
	ColumnTraceParent = "traceparent"
	ColumnTraceState  = "tracestate"
)

var traceColumns = []string{ColumnTraceParent, ColumnTraceState}

// traceValues is what the propagator writes of a context: a
// propagation.TextMapCarrier that keeps the two W3C fields and ignores
// any other (baggage, another format's fields).
type traceValues struct{ parent, state string }

func (v *traceValues) Get(string) string { return "" }
func (v *traceValues) Keys() []string    { return nil }
func (v *traceValues) Set(key, value string) {
	switch key {
	case ColumnTraceParent:
		v.parent = value
	case ColumnTraceState:
		v.state = value
	}
}

// value is the column c's value, and whether there is one.
func (v *traceValues) value(c string) (string, bool) {
	switch {
	case v == nil:
	case c == ColumnTraceParent && v.parent != "":
		return v.parent, true
	case c == ColumnTraceState && v.state != "":
		return v.state, true
	}
	return "", false
}

// traceContext is what Write stores of ctx's trace context, nil when ctx
// carries none or the table has no trace columns: nothing is asked of the
// propagator then.
func (w *Writer) traceContext(ctx context.Context) *traceValues {
	if w.table.NoTraceColumns || !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	v := &traceValues{}
	tracectx.Propagator(w.opts.Propagator).Inject(ctx, v)
	if v.parent == "" && v.state == "" {
		return nil
	}
	return v
}

// rowScanner is a row of pgx or database/sql.
type rowScanner interface{ Scan(dest ...any) error }

// traceColumnsQuery says which trace columns a table has; one row always,
// also for a table that does not exist (whose INSERT then fails as it
// would have).
const traceColumnsQuery = `SELECT coalesce(bool_or(attname = 'traceparent'), false), coalesce(bool_or(attname = 'tracestate'), false)
	FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped`

// traceColumnsOf returns the trace columns the table has, beyond its
// HeaderColumns, learning them once with query (in the caller's
// transaction: a catalog read). A column added later is written by
// Writers made after it.
func (w *Writer) traceColumnsOf(query func(q string, args ...any) rowScanner) ([]string, error) {
	if cols := w.trace.Load(); cols != nil {
		return *cols, nil
	}
	var missing []string
	for _, c := range traceColumns {
		if !w.table.hasHeader(c) {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		var parent, state bool
		if err := query(traceColumnsQuery, w.table.name()).Scan(&parent, &state); err != nil {
			return nil, fmt.Errorf("outbox: read the trace columns of %s: %w", w.table.name(), err)
		}
		missing = slices.DeleteFunc(missing, func(c string) bool {
			return c == ColumnTraceParent && !parent || c == ColumnTraceState && !state
		})
	}
	w.trace.Store(&missing)
	return missing, nil
}
