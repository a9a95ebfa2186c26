// Package outbox writes events into a transactional outbox table, inside
// the caller's database transaction, in the shape walrelay publishes to
// Kafka: topic from the aggregate type, key from the aggregate id, the
// event id in the record's id header.
//
// The event and the business change commit or roll back together, because
// the Writer only accepts a transaction (pgx.Tx or *sql.Tx), never a
// connection or a pool. By default the row is deleted again in the same
// transaction: the INSERT is already in the write-ahead log, which is what
// walrelay reads, so the table stays empty and needs no cleanup.
//
// When the caller's ctx carries an OpenTelemetry span, its W3C trace
// context goes into the traceparent and tracestate columns, which walrelay
// sends as the record's headers: the relay's and the consumer's spans
// then join the writer's trace.
//
// Table holds the DDL of the table and its publication; walrelay's own
// `dev` and `setup` commands and deploy/outbox.sql use the same definition.
package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
)

// Event is one outbox row.
type Event struct {
	// ID identifies the event for consumers (the record's id header). Zero
	// means a new UUIDv7 chosen by Write.
	ID ID
	// AggregateType chooses the topic (walrelay's --topic-template).
	AggregateType string
	// AggregateID is the record key: events of one aggregate share a
	// partition, so consumers see them in commit order.
	AggregateID string
	// Type is the event type (the record's type header).
	Type string
	// Payload is the record value: JSON text for a jsonb column (the
	// default), any bytes for a bytea column. Nil writes NULL, which
	// becomes a tombstone.
	Payload []byte
	// Headers sets extra header columns of this event (column name to
	// value); they override the Writer's HeaderFuncs. The columns must
	// exist (Table.HeaderColumns) and be mapped with walrelay's
	// --header-column.
	Headers map[string]string
}

// HeaderFunc takes a header value from the context, e.g. a tenant id;
// ok false writes NULL (walrelay then omits the header).
type HeaderFunc func(ctx context.Context) (value string, ok bool)

// Options configure a Writer.
type Options struct {
	// Keep leaves the row in the table. By default it is deleted in the
	// same transaction, which walrelay does not mind (it publishes INSERTs
	// only): the table never grows.
	Keep bool
	// HeaderFuncs fill extra header columns from the context of every
	// Write (column name to function). The trace context needs none: the
	// Propagator writes it.
	HeaderFuncs map[string]HeaderFunc
	// Propagator writes the trace context of Write's ctx into the
	// traceparent and tracestate columns (see Table.NoTraceColumns).
	// Default: the program's global propagator (otel.SetTextMapPropagator),
	// or W3C trace context when it set none. A HeaderFuncs entry or an
	// event's Headers for one of those columns wins over it.
	Propagator propagation.TextMapPropagator
	// Check, when set, checks every payload before the insert: with
	// schema.WriterCheck, against the schema the relay frames the event's
	// value with (walrelay --value-format), so that a payload the relay
	// would dead-letter fails the business transaction instead, with an
	// error naming the subject and version. A NULL payload is not checked.
	Check PayloadChecker
}

// PayloadChecker checks an event's payload before it is written
// (Options.Check); schema.WriterCheck is one.
type PayloadChecker interface {
	CheckPayload(ctx context.Context, aggregateType, eventType string, payload []byte) error
}

// Writer writes events into one outbox table. It is safe for concurrent
// use and holds no connection.
type Writer struct {
	table   Table
	opts    Options
	columns []string // extra header columns, sorted, from the table
	// trace holds the trace columns the table has beyond columns, once
	// learned (trace.go).
	trace atomic.Pointer[[]string]
}

var columnName = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// NewWriter returns a Writer for t. Every header column a HeaderFunc fills
// must be one of t.HeaderColumns; the error says which is not.
func NewWriter(t Table, opts Options) (*Writer, error) {
	if err := t.check(); err != nil {
		return nil, err
	}
	for c := range opts.HeaderFuncs {
		if !t.hasHeader(c) {
			return nil, fmt.Errorf("outbox: HeaderFuncs fills column %q, which is not in Table.HeaderColumns %v: add it there (and to the table)", c, t.HeaderColumns)
		}
	}
	return &Writer{table: t, opts: opts, columns: t.HeaderColumns}, nil
}

// Write inserts ev in tx (and, unless Options.Keep, deletes it again in
// tx) and returns its id. When ctx carries a trace context (an
// OpenTelemetry span), it is stored in the table's traceparent and
// tracestate columns, those it has (see Table.NoTraceColumns). Nothing is visible to walrelay until tx commits;
// if tx rolls back, the event never existed.
func (w *Writer) Write(ctx context.Context, tx pgx.Tx, ev Event) (ID, error) {
	if tx == nil {
		return ID{}, errors.New("outbox: Write needs the business transaction, got nil")
	}
	tv, extra, err := w.traced(ctx, func(q string, args ...any) rowScanner { return tx.QueryRow(ctx, q, args...) })
	if err != nil {
		return ID{}, err
	}
	q, args, id, err := w.insert(ctx, ev, tv, extra)
	if err != nil {
		return ID{}, err
	}
	if w.opts.Keep {
		_, err = tx.Exec(ctx, q, args...)
		return w.result(id, err)
	}
	b := &pgx.Batch{}
	b.Queue(q, args...)
	b.Queue(w.delete(), id.String())
	err = tx.SendBatch(ctx, b).Close()
	return w.result(id, err)
}

// WriteSQL is Write for database/sql, with a PostgreSQL driver that takes
// $n placeholders (pgx's stdlib, lib/pq).
func (w *Writer) WriteSQL(ctx context.Context, tx *sql.Tx, ev Event) (ID, error) {
	if tx == nil {
		return ID{}, errors.New("outbox: WriteSQL needs the business transaction, got nil")
	}
	tv, extra, err := w.traced(ctx, func(q string, args ...any) rowScanner { return tx.QueryRowContext(ctx, q, args...) })
	if err != nil {
		return ID{}, err
	}
	q, args, id, err := w.insert(ctx, ev, tv, extra)
	if err != nil {
		return ID{}, err
	}
	if _, err := tx.ExecContext(ctx, q, args...); err != nil {
		return w.result(id, err)
	}
	if !w.opts.Keep {
		_, err = tx.ExecContext(ctx, w.delete(), id.String())
	}
	return w.result(id, err)
}

func (w *Writer) result(id ID, err error) (ID, error) {
	if err != nil {
		return ID{}, fmt.Errorf("outbox: write to %s (the transaction is unusable now; roll it back): %w", w.table.name(), err)
	}
	return id, nil
}

// traced returns ctx's trace context and the trace columns beyond
// HeaderColumns to store it in (nil, nil: nothing to store).
func (w *Writer) traced(ctx context.Context, query func(q string, args ...any) rowScanner) (*traceValues, []string, error) {
	tv := w.traceContext(ctx)
	if tv == nil {
		return nil, nil, nil
	}
	extra, err := w.traceColumnsOf(query)
	if err != nil {
		return nil, nil, fmt.Errorf("%w (the transaction is unusable now; roll it back)", err)
	}
	return tv, extra, nil
}

// insert builds the INSERT of ev: tv is the trace context to store, in
// the HeaderColumns of its names and in extra (trace columns the table
// has beyond them).
func (w *Writer) insert(ctx context.Context, ev Event, tv *traceValues, extra []string) (string, []any, ID, error) {
	if ev.AggregateType == "" || ev.AggregateID == "" || ev.Type == "" {
		return "", nil, ID{}, fmt.Errorf("outbox: event needs AggregateType, AggregateID and Type (got %q, %q, %q)", ev.AggregateType, ev.AggregateID, ev.Type)
	}
	for c := range ev.Headers {
		if !w.table.hasHeader(c) {
			return "", nil, ID{}, fmt.Errorf("outbox: event header %q is not in Table.HeaderColumns %v", c, w.table.HeaderColumns)
		}
	}
	if w.opts.Check != nil && ev.Payload != nil {
		if err := w.opts.Check.CheckPayload(ctx, ev.AggregateType, ev.Type, ev.Payload); err != nil {
			return "", nil, ID{}, fmt.Errorf("outbox: the payload of %s event %s was refused, nothing was written: %w", ev.AggregateType, ev.Type, err)
		}
	}
	id := ev.ID
	if id.IsZero() {
		id = NewID()
	}
	var payload any
	switch {
	case ev.Payload == nil:
		payload = nil
	case w.table.BytesPayload:
		payload = ev.Payload
	default:
		payload = string(ev.Payload)
	}
	cols := []string{"id", "aggregate_type", "aggregate_id", "type", "payload"}
	args := []any{id.String(), ev.AggregateType, ev.AggregateID, ev.Type, payload}
	for _, c := range w.columns {
		v, ok := ev.Headers[c]
		if !ok {
			if f := w.opts.HeaderFuncs[c]; f != nil {
				v, ok = f(ctx)
			}
		}
		if !ok {
			v, ok = tv.value(c)
		}
		cols = append(cols, c)
		if ok {
			args = append(args, v)
		} else {
			args = append(args, nil)
		}
	}
	for _, c := range extra {
		if v, ok := tv.value(c); ok {
			cols = append(cols, c)
			args = append(args, v)
		}
	}
	ph := make([]string, len(cols))
	for i := range cols {
		ph[i] = fmt.Sprintf("$%d", i+1)
	}
	ph[0] += "::uuid"
	if w.table.BytesPayload {
		ph[4] += "::bytea"
	} else {
		ph[4] += "::jsonb"
	}
	q := fmt.Sprintf("INSERT INTO %s (%s) VALUES (%s)", w.table.name(), strings.Join(cols, ", "), strings.Join(ph, ", "))
	return q, args, id, nil
}

func (w *Writer) delete() string {
	return fmt.Sprintf("DELETE FROM %s WHERE id = $1::uuid", w.table.name())
}
