package outbox_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/walrelay/walrelay/outbox"
)

// The table walrelay expects by default, and its publication.
func ExampleTable_DDL() {
	t := outbox.Table{}
	fmt.Println(t.DDL())
	fmt.Println(t.PublicationDDL("walrelay_outbox"))
	// Output:
	// CREATE TABLE "public"."outbox" (
	//     id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
	//     aggregate_type text        NOT NULL,
	//     aggregate_id   text        NOT NULL,
	//     type           text        NOT NULL,
	//     payload        jsonb,
	//     created_at     timestamptz NOT NULL DEFAULT now(),
	//     traceparent    text,
	//     tracestate     text
	// );
	// CREATE PUBLICATION "walrelay_outbox" FOR TABLE "public"."outbox" WITH (publish = 'insert');
}

// A table with an extra header column, the tenant, and without the
// trace context columns.
func ExampleTable_DDL_headerColumn() {
	fmt.Println(outbox.Table{Name: "sales.outbox", HeaderColumns: []string{"tenant"}, NoTraceColumns: true}.DDL())
	// Output:
	// CREATE TABLE "sales"."outbox" (
	//     id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
	//     aggregate_type text        NOT NULL,
	//     aggregate_id   text        NOT NULL,
	//     type           text        NOT NULL,
	//     payload        jsonb,
	//     created_at     timestamptz NOT NULL DEFAULT now(),
	//     tenant         text
	// );
}

// Ids are UUIDv7: version 7, sorted by time.
func ExampleNewID() {
	a, b := outbox.NewID(), outbox.NewID()
	fmt.Println(a.String()[14:15], a.String() < b.String())
	// Output: 7 true
}

// The business change and the event commit together, or neither does.
func ExampleWriter_Write() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@localhost/shop")
	if err != nil {
		panic(err)
	}
	w, err := outbox.NewWriter(outbox.Table{}, outbox.Options{})
	if err != nil {
		panic(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "UPDATE orders SET status = 'paid' WHERE id = $1", 42); err != nil {
			return err
		}
		payload, _ := json.Marshal(map[string]any{"order": 42, "total": 99.5})
		_, err := w.Write(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: "42", Type: "OrderPaid", Payload: payload})
		return err
	})
	if err != nil {
		panic(err)
	}
}

// An extra header column, taken from the context by a function the
// caller supplies (here a context value). walrelay maps the column with
// --header-column tenant. The trace context needs no such function: Write
// stores ctx's OpenTelemetry span context in the traceparent and
// tracestate columns by itself.
func ExampleOptions_headerFuncs() {
	type tenantKey struct{}
	table := outbox.Table{HeaderColumns: []string{"tenant"}}
	w, err := outbox.NewWriter(table, outbox.Options{HeaderFuncs: map[string]outbox.HeaderFunc{
		"tenant": func(ctx context.Context) (string, bool) {
			t, ok := ctx.Value(tenantKey{}).(string)
			return t, ok
		},
	}})
	if err != nil {
		panic(err)
	}
	// Every w.Write(ctx, tx, ev) now stores ctx's tenant, e.g. in a
	// request handler whose ctx came from
	// context.WithValue(ctx, tenantKey{}, r.Header.Get("X-Tenant")).
	_ = w
}

// With database/sql (here pgx's stdlib driver), in a *sql.Tx.
func ExampleWriter_WriteSQL() {
	ctx := context.Background()
	db, err := sql.Open("pgx", "postgres://app@localhost/shop")
	if err != nil {
		panic(err)
	}
	w, _ := outbox.NewWriter(outbox.Table{}, outbox.Options{})
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback() // a no-op after Commit
	if _, err := tx.ExecContext(ctx, "UPDATE orders SET status = 'shipped' WHERE id = $1", 42); err != nil {
		panic(err)
	}
	if _, err := w.WriteSQL(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: "42", Type: "OrderShipped", Payload: []byte(`{"order": 42}`)}); err != nil {
		panic(err)
	}
	if err := tx.Commit(); err != nil {
		panic(err)
	}
}
