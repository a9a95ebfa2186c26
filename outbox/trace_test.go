package outbox_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/outbox"
)

// spanContext is a sampled span context with a trace state, as a
// service's OpenTelemetry span would have.
func spanContext(t *testing.T) trace.SpanContext {
	t.Helper()
	ts, err := trace.ParseTraceState("vendor=abc,other=1")
	if err != nil {
		t.Fatal(err)
	}
	return trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x0a, 0xf7, 0x65, 0x19, 0x16, 0xcd, 0x43, 0xdd, 0x84, 0x48, 0xeb, 0x21, 0x1c, 0x80, 0x31, 0x9c},
		SpanID:     trace.SpanID{0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31},
		TraceFlags: trace.FlagsSampled,
		TraceState: ts,
	})
}

const wantTraceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

// TestWriteStoresTraceContext writes with a context that carries a span
// into tables with both trace columns, with traceparent only, and with
// neither (a table created before them): each gets the columns it has,
// through pgx and database/sql; a context without a span writes NULLs.
func TestWriteStoresTraceContext(t *testing.T) {
	if testing.Short() {
		t.Skip("starts PostgreSQL")
	}
	ctx := context.Background()
	pg, err := devcluster.StartPostgres(ctx, devcluster.PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	url := pg.URL("postgres")
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()

	both := outbox.Table{Name: "both"}
	old := outbox.Table{Name: "old", NoTraceColumns: true}
	if _, err := conn.Exec(ctx, both.DDL()+old.DDL()+
		`CREATE TABLE parent_only (LIKE old INCLUDING ALL); ALTER TABLE parent_only ADD COLUMN traceparent text;`); err != nil {
		t.Fatal(err)
	}
	traced := trace.ContextWithSpanContext(ctx, spanContext(t))
	ev := outbox.Event{AggregateType: "order", AggregateID: "1", Type: "OrderPlaced", Payload: []byte(`{}`)}

	for _, tc := range []struct {
		table             string
		wantParent, state bool // the columns the table has
	}{
		{"both", true, true},
		{"parent_only", true, false},
		{"old", false, false},
	} {
		// The Writer is made for the default table shape: it finds out
		// which trace columns the table has.
		w, err := outbox.NewWriter(outbox.Table{Name: tc.table}, outbox.Options{Keep: true, Propagator: propagation.TraceContext{}})
		if err != nil {
			t.Fatal(err)
		}
		var ids []outbox.ID
		for _, c := range []context.Context{traced, ctx} {
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			id, err := w.Write(c, tx, ev)
			if err != nil {
				t.Fatalf("%s: pgx write: %v", tc.table, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
			stx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if id, err = w.WriteSQL(c, stx, ev); err != nil {
				t.Fatalf("%s: database/sql write: %v", tc.table, err)
			}
			if err := stx.Commit(); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		for i, id := range ids {
			row := conn.QueryRow(ctx, "SELECT to_jsonb(t) ->> 'traceparent', to_jsonb(t) ->> 'tracestate' FROM "+pgx.Identifier{tc.table}.Sanitize()+" t WHERE id = $1", id.String())
			var parent, state *string
			if err := row.Scan(&parent, &state); err != nil {
				t.Fatal(err)
			}
			withSpan := i < 2
			if got, want := parent != nil, withSpan && tc.wantParent; got != want || got && *parent != wantTraceparent {
				t.Errorf("%s row %d: traceparent %v, want it set (%s): %v", tc.table, i, deref(parent), wantTraceparent, want)
			}
			if got, want := state != nil, withSpan && tc.state; got != want || got && *state != "vendor=abc,other=1" {
				t.Errorf("%s row %d: tracestate %v, want it set: %v", tc.table, i, deref(state), want)
			}
		}
	}
}

func deref(s *string) string {
	if s == nil {
		return "NULL"
	}
	return *s
}
