package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/outbox"
)

func TestNewIDSortsAndIsV7(t *testing.T) {
	prev := outbox.NewID()
	for range 20000 {
		id := outbox.NewID()
		if bytes.Compare(id[:], prev[:]) <= 0 {
			t.Fatalf("%s is not after %s", id, prev)
		}
		if id[6]>>4 != 7 || id[8]>>6 != 2 {
			t.Fatalf("%s: version %d variant %b, want 7 and 10", id, id[6]>>4, id[8]>>6)
		}
		prev = id
	}
}

func TestDDLMatchesDeploy(t *testing.T) {
	b, err := os.ReadFile("../deploy/outbox.sql")
	if err != nil {
		t.Fatal(err)
	}
	if want := (outbox.Table{}).DDL(); !strings.Contains(string(b), want) {
		t.Errorf("deploy/outbox.sql does not contain outbox.Table{}.DDL():\n%s", want)
	}
}

func TestNewWriterRefusesUnknownHeaderColumn(t *testing.T) {
	_, err := outbox.NewWriter(outbox.Table{}, outbox.Options{HeaderFuncs: map[string]outbox.HeaderFunc{"traceparent": nil}})
	if err == nil || !strings.Contains(err.Error(), "HeaderColumns") {
		t.Fatalf("err = %v, want one naming Table.HeaderColumns", err)
	}
}

// TestWriteInTransaction writes through pgx and database/sql into a real
// PostgreSQL table: a committed event with Keep is in the table with its
// header column from the context; the default deletes it in the same
// transaction; a rolled-back one leaves nothing.
func TestWriteInTransaction(t *testing.T) {
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
	table := outbox.Table{Name: "app.events", HeaderColumns: []string{"traceparent"}}
	if _, err := conn.Exec(ctx, "CREATE SCHEMA app; "+table.DDL()); err != nil {
		t.Fatal(err)
	}
	type key struct{}
	opts := outbox.Options{Keep: true, HeaderFuncs: map[string]outbox.HeaderFunc{
		"traceparent": func(ctx context.Context) (string, bool) { v, ok := ctx.Value(key{}).(string); return v, ok },
	}}
	keep, err := outbox.NewWriter(table, opts)
	if err != nil {
		t.Fatal(err)
	}
	del, err := outbox.NewWriter(table, outbox.Options{})
	if err != nil {
		t.Fatal(err)
	}
	payload, _ := json.Marshal(map[string]int{"total": 42})
	ev := outbox.Event{AggregateType: "order", AggregateID: "7", Type: "OrderPlaced", Payload: payload}
	tctx := context.WithValue(ctx, key{}, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")

	// pgx, kept.
	tx, _ := conn.Begin(ctx)
	kept, err := keep.Write(tctx, tx, ev)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// pgx, deleted in the transaction; and one rolled back.
	tx, _ = conn.Begin(ctx)
	deleted, err := del.Write(ctx, tx, ev)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	tx, _ = conn.Begin(ctx)
	rolled, err := keep.Write(ctx, tx, ev)
	if err != nil {
		t.Fatal(err)
	}
	tx.Rollback(ctx)

	// database/sql, kept and deleted.
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	stx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	sqlKept, err := keep.WriteSQL(tctx, stx, outbox.Event{AggregateType: "order", AggregateID: "8", Type: "OrderPaid", Headers: map[string]string{"traceparent": "explicit"}})
	if err != nil {
		t.Fatal(err)
	}
	sqlDeleted, err := del.WriteSQL(ctx, stx, ev)
	if err != nil {
		t.Fatal(err)
	}
	if err := stx.Commit(); err != nil {
		t.Fatal(err)
	}

	rows, _ := conn.Query(ctx, "SELECT id::text, aggregate_id, payload::text, traceparent FROM app.events ORDER BY id")
	type row struct {
		ID, Agg     string
		Payload, TP *string
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].ID != kept.String() || got[1].ID != sqlKept.String() {
		t.Fatalf("rows %+v, want only %s and %s (not the deleted %s, %s nor the rolled back %s)", got, kept, sqlKept, deleted, sqlDeleted, rolled)
	}
	if got[0].TP == nil || *got[0].TP != "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" || *got[0].Payload != `{"total": 42}` {
		t.Errorf("pgx row %+v: traceparent from the context and the JSON payload expected", got[0])
	}
	if got[1].TP == nil || *got[1].TP != "explicit" || got[1].Payload != nil {
		t.Errorf("sql row %+v: the event's own header and a NULL payload expected", got[1])
	}
}
