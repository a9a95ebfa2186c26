package integration

// Tests of what the publication publishes: partitioned outbox tables, rows
// of tables that are not mapped, tables added to a publication later, row
// filters and column lists, FOR ALL TABLES, and publications walrelay did
// not create.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/decoder"
)

// observeLogs makes relays started in-process afterwards also log (at
// every level) to the returned logs.
func (e *env) observeLogs() *observer.ObservedLogs {
	core, logs := observer.New(zapcore.DebugLevel)
	e.logCore = core
	return logs
}

// warnings are the WARN entries whose message contains snippet and that
// carry every field of want.
func warnings(logs *observer.ObservedLogs, snippet string, want ...zap.Field) []observer.LoggedEntry {
	l := logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet(snippet)
	for _, f := range want {
		l = l.FilterField(f)
	}
	return l.All()
}

// partitionOutbox replaces the test's outbox table by one partitioned by
// created_at, with one partition for everything before 2030.
func (e *env) partitionOutbox() {
	e.t.Helper()
	e.exec(`DROP TABLE outbox`)
	e.exec(`CREATE TABLE outbox (
		id uuid NOT NULL DEFAULT gen_random_uuid(),
		aggregate_type text,
		aggregate_id text,
		type text,
		payload jsonb,
		created_at timestamptz NOT NULL DEFAULT now(),
		PRIMARY KEY (id, created_at)
	) PARTITION BY RANGE (created_at)`)
	e.exec(`CREATE TABLE outbox_before_2030 PARTITION OF outbox FOR VALUES FROM (MINVALUE) TO ('2030-01-01')`)
}

// refusedWith runs the binary with args and asserts that it refuses to
// start: exit 2 within 30s, with one line containing every want.
func refusedWith(t *testing.T, args []string, want ...string) {
	t.Helper()
	out, code, elapsed, exited := runBounded(t, 30*time.Second, nil, args...)
	if !exited {
		t.Errorf("walrelay did not refuse to start: still running after 30s (stopped with SIGTERM)")
	}
	if code != 2 {
		t.Errorf("exit code %d, want 2 (setup refused)", code)
	}
	final := finalLines(out)
	if strings.Count(final, "\n") > 0 {
		t.Errorf("the error spans several lines, want one:\n%s", final)
	}
	for _, w := range want {
		if !strings.Contains(final, w) {
			t.Errorf("the error lacks %q: %q", w, final)
		}
	}
	t.Logf("exit %d after %s: %s", code, elapsed.Round(time.Millisecond), final)
}

// publishedTables lists the tables pg_publication_tables shows for the
// test's publication, as schema.table.
func (e *env) publishedTables() []string {
	e.t.Helper()
	rows, err := e.conn().Query(e.ctx, `SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1`, e.name)
	if err != nil {
		e.t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		e.t.Fatal(err)
	}
	return names
}

// TestPartitionedOutbox runs a partitioned outbox end to end: setup says
// the table is partitioned and published via its root, the publication it
// creates has publish_via_partition_root, and rows inserted into a
// partition present at start, a partition created while the relay runs and
// a table attached as a partition while it runs all arrive, none counted as
// unmapped.
func TestPartitionedOutbox(t *testing.T) {
	e := newEnv(t)
	e.partitionOutbox()
	out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--table", "public.outbox")
	if code != 0 {
		t.Fatalf("setup exit %d:\n%s", code, out)
	}
	t.Logf("setup:\n%s", out)
	for _, w := range []string{"partitioned", "via root", "row filter: none", "columns: all"} {
		if !strings.Contains(out, w) {
			t.Errorf("setup output does not say %q:\n%s", w, out)
		}
	}
	var viaRoot bool
	if err := e.conn().QueryRow(e.ctx, `SELECT pubviaroot FROM pg_publication WHERE pubname = $1`, e.name).Scan(&viaRoot); err != nil {
		t.Fatal(err)
	}
	if !viaRoot {
		t.Error("the publication walrelay created has publish_via_partition_root = false")
	}

	_, reg := e.startRelayGathered(e.config())
	c := e.consume()
	insert := func(createdAt string) {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, created_at) VALUES ('p', 'k', 'T', '{}', $1)`, createdAt)
	}
	insert("2026-06-01")
	c.waitIDs(1, 30*time.Second)

	// Partitions that appear while the relay runs: one created as a
	// partition, one attached.
	e.exec(`CREATE TABLE outbox_2030 PARTITION OF outbox FOR VALUES FROM ('2030-01-01') TO ('2031-01-01')`)
	insert("2030-06-01")
	e.exec(`CREATE TABLE outbox_2031 (LIKE outbox INCLUDING DEFAULTS)`)
	e.exec(`ALTER TABLE outbox ATTACH PARTITION outbox_2031 FOR VALUES FROM ('2031-01-01') TO ('2032-01-01')`)
	insert("2031-06-01")
	insert("2026-07-01")
	recs := c.waitIDs(4, 30*time.Second)
	for _, r := range recs {
		if r.Topic != e.topic("p") {
			t.Errorf("record on topic %q, want %q", r.Topic, e.topic("p"))
		}
	}
	if u := gathered(reg, "walrelay_unmapped_inserts_total"); len(u) != 0 {
		t.Errorf("unmapped inserts %v, want none", u)
	}
}

// TestPartitionedWithoutViaRootRefused: a publication of a partitioned
// outbox without publish_via_partition_root streams the rows under the
// partitions' names; walrelay refuses to start and names the fix.
func TestPartitionedWithoutViaRootRefused(t *testing.T) {
	e := newEnv(t)
	e.partitionOutbox()
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE outbox WITH (publish = 'insert')`, pgx.Identifier{e.name}.Sanitize()))
	refusedWith(t, e.args(), "public.outbox", "partitioned",
		fmt.Sprintf("ALTER PUBLICATION %s SET (publish_via_partition_root = true)", pgx.Identifier{e.name}.Sanitize()))
}

// TestUnmappedInsertsLoggedAndCounted: a publication that lists another
// table when walrelay first streams from it (a shared publication), or
// covers every table (FOR ALL TABLES), streams inserts of tables that are
// not outbox tables: they are counted per table and logged once at WARN
// naming it; the outbox rows still arrive.
func TestUnmappedInsertsLoggedAndCounted(t *testing.T) {
	for _, pub := range []string{"FOR TABLE outbox, other_table", "FOR ALL TABLES"} {
		t.Run(pub, func(t *testing.T) {
			e := newEnv(t)
			e.exec(`CREATE TABLE other_table (id int PRIMARY KEY, v text)`)
			e.exec(fmt.Sprintf(`CREATE PUBLICATION %s %s WITH (publish = 'insert')`, pgx.Identifier{e.name}.Sanitize(), pub))
			logs := e.observeLogs()
			_, reg := e.startRelayGathered(e.config())
			c := e.consume()
			for i := range 3 {
				e.exec(`INSERT INTO other_table VALUES ($1, 'x')`, i)
			}
			e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', '{}')`)
			c.waitIDs(1, 30*time.Second)
			e.waitFor("3 unmapped inserts counted", 10*time.Second, func() (bool, error) {
				got := gathered(reg, "walrelay_unmapped_inserts_total")
				return got["public.other_table"] == 3 && len(got) == 1, fmt.Errorf("walrelay_unmapped_inserts_total %v", got)
			})
			if n := len(warnings(logs, "not an outbox table", zap.String("table", "public.other_table"))); n != 1 {
				t.Errorf("%d WARN lines about public.other_table, want exactly 1; all logs: %v", n, logs.All())
			}
		})
	}
}

// TestTableAddedToPublicationWhileStreaming is a migration that adds a
// table to the publication while the relay streams under load, then
// writes rows to it, half deleted in the transaction that inserts them
// (the outbox pattern's own habit): the relay stops before the slot is
// confirmed past the first of them, naming the table and both fixes. A
// restart with the table among the outbox tables publishes every one of
// them from the slot; one after the table was taken out of the publication
// publishes none of them, counting them. No outbox row is lost either way.
func TestTableAddedToPublicationWhileStreaming(t *testing.T) {
	for _, fix := range []string{"add to tables", "drop from publication"} {
		t.Run(fix, func(t *testing.T) {
			e := newEnv(t)
			e.exec(`CREATE TABLE outbox2 (LIKE outbox INCLUDING DEFAULTS)`)
			cfg := e.config()
			rr := e.startRelay(cfg)
			c := e.consume()

			// The outbox under load throughout.
			ctx, stopWriting := context.WithCancel(e.ctx)
			var wg sync.WaitGroup
			stop := func() { stopWriting(); wg.Wait() }
			defer stop()
			wg.Go(func() {
				conn, err := pgx.Connect(ctx, e.url)
				if err != nil {
					t.Error(err)
					return
				}
				defer conn.Close(context.Background())
				for i := 0; ctx.Err() == nil; i++ {
					if _, err := conn.Exec(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
						SELECT 'o', 'k' || g, 'T', '{}', $1 * 10 + g FROM generate_series(0, 9) g`, i); err != nil {
						if ctx.Err() == nil {
							t.Error(err)
						}
						return
					}
				}
			})
			c.waitIDs(50, 30*time.Second)

			conn := e.conn()
			e.exec(fmt.Sprintf(`ALTER PUBLICATION %s ADD TABLE outbox2`, pgx.Identifier{e.name}.Sanitize()))
			e.exec(`INSERT INTO outbox2 (aggregate_type, aggregate_id, type, payload, seq) SELECT 'n', 'kept' || g, 'T', '{}', g FROM generate_series(1, 100) g`)
			// The first transaction of outbox2 ends before this.
			firstEnds := e.currentLSN(conn)
			tx, err := conn.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(e.ctx, `INSERT INTO outbox2 (aggregate_type, aggregate_id, type, payload, seq) SELECT 'n', 'gone' || g, 'T', '{}', g FROM generate_series(1, 100) g`); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(e.ctx, `DELETE FROM outbox2 WHERE aggregate_id LIKE 'gone%'`); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(e.ctx); err != nil {
				t.Fatal(err)
			}
			e.waitFor("the relay to stop on the table", 60*time.Second, func() (bool, error) {
				done, err := rr.returned()
				return done, err
			})
			_, err = rr.returned()
			for _, w := range []string{"public.outbox2", "relay.Config.Tables", "DROP TABLE"} {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Fatalf("the relay stopped with %v, want an error naming %q", err, w)
				}
			}
			if got := e.slotInfo().ConfirmedLSN; got >= firstEnds {
				t.Fatalf("the slot was confirmed to %s, past the first transaction of the added table (it ends before %s)", got, firstEnds)
			}
			// A restart that changed nothing is refused at once, naming
			// the table added since walrelay recorded the publication.
			refusedWith(t, e.args(), "public.outbox2", "added to it after walrelay first streamed", "--table",
				fmt.Sprintf(`ALTER PUBLICATION %s DROP TABLE "public"."outbox2"`, pgx.Identifier{e.name}.Sanitize()))
			stop()

			var outboxRows int
			if err := conn.QueryRow(e.ctx, `SELECT count(*) FROM outbox`).Scan(&outboxRows); err != nil {
				t.Fatal(err)
			}
			switch fix {
			case "add to tables":
				cfg.Tables = append(cfg.Tables, decoder.Table{Schema: "public", Name: "outbox2"})
				e.startRelay(cfg)
				recs := c.waitIDs(outboxRows+200, 60*time.Second)
				var n int
				for _, r := range recs {
					if r.Topic == e.topic("n") {
						n++
					}
				}
				if n < 200 {
					t.Fatalf("%d records of outbox2, want its 200 rows", n)
				}
			case "drop from publication":
				e.exec(fmt.Sprintf(`ALTER PUBLICATION %s DROP TABLE outbox2`, pgx.Identifier{e.name}.Sanitize()))
				_, reg := e.startRelayGathered(cfg)
				c.waitIDs(outboxRows, 60*time.Second)
				e.waitFor("outbox2's 200 inserts counted", 30*time.Second, func() (bool, error) {
					got := gathered(reg, "walrelay_unmapped_inserts_total")
					return got["public.outbox2"] == 200, fmt.Errorf("walrelay_unmapped_inserts_total %v", got)
				})
				for _, r := range c.records() {
					if r.Topic == e.topic("n") {
						t.Fatalf("a row of outbox2 was published after it left the publication: %s", r.Value)
					}
				}
			}
		})
	}
}

// TestColumnListWithoutMappedColumnRefused: a publication whose column
// list leaves out a mapped column is refused at startup, naming it.
func TestColumnListWithoutMappedColumnRefused(t *testing.T) {
	needPG(t, 15) // publication column lists are new in 15
	e := newEnv(t)
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE outbox (id, aggregate_type, aggregate_id, type) WITH (publish = 'insert')`, pgx.Identifier{e.name}.Sanitize()))
	refusedWith(t, e.args(), "column list", `"payload"`, "public.outbox")
}

// TestRowFilter: a row filter on the outbox is refused without
// --allow-row-filter; with it, walrelay starts, logs the expression at
// WARN and streams the rows the filter passes.
func TestRowFilter(t *testing.T) {
	needPG(t, 15) // publication row filters are new in 15
	e := newEnv(t)
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE outbox WHERE (aggregate_type <> 'internal') WITH (publish = 'insert')`, pgx.Identifier{e.name}.Sanitize()))
	refusedWith(t, e.args(), "row filter", "internal", "--allow-row-filter")

	logs := e.observeLogs()
	cfg := e.config()
	cfg.AllowRowFilter = true
	e.startRelay(cfg)
	if ws := warnings(logs, "row filter", zap.String("table", "public.outbox")); len(ws) != 1 || !strings.Contains(fmt.Sprint(ws[0].ContextMap()), "internal") {
		t.Errorf("WARN lines about the row filter: %v, want one with its expression; all logs: %v", ws, logs.All())
	}
	c := e.consume()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', '{}')`)
	c.waitIDs(1, 30*time.Second)
}

// TestForAllTablesWarns: a FOR ALL TABLES publication streams every
// table's rows to the relay; walrelay says so at WARN and still works.
func TestForAllTablesWarns(t *testing.T) {
	e := newEnv(t)
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR ALL TABLES WITH (publish = 'insert')`, pgx.Identifier{e.name}.Sanitize()))
	logs := e.observeLogs()
	e.startRelay(e.config())
	if n := len(warnings(logs, "FOR ALL TABLES", zap.String("publication", e.name))); n != 1 {
		t.Errorf("%d WARN lines about FOR ALL TABLES, want 1; all logs: %v", n, logs.All())
	}
	c := e.consume()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', '{}')`)
	c.waitIDs(1, 30*time.Second)
}

// TestForeignPublicationNotAltered: a publication walrelay did not create
// that lacks the outbox is left alone (refused, naming the ALTER and
// --alter-publication); with --alter-publication the table is added, with
// a WARN naming it and the rows it already held, which will not be
// streamed.
func TestForeignPublicationNotAltered(t *testing.T) {
	e := newEnv(t)
	e.exec(`CREATE TABLE other_table (id int PRIMARY KEY, v text)`)
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE other_table WITH (publish = 'insert')`, pgx.Identifier{e.name}.Sanitize()))
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', '{}'), ('o', 'k', 'T', '{}')`)
	refusedWith(t, e.args(), "ALTER PUBLICATION", "ADD TABLE", "--alter-publication")
	if got := e.publishedTables(); fmt.Sprint(got) != "[public.other_table]" {
		t.Fatalf("publication tables %v after the refusal, want it unchanged: [public.other_table]", got)
	}

	// The slot exists, as when a relay ran before the table was added.
	e.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, e.name)
	logs := e.observeLogs()
	cfg := e.config()
	cfg.AlterPublication = true
	e.startRelay(cfg)
	if got := e.publishedTables(); fmt.Sprint(got) != "[public.other_table public.outbox]" {
		t.Errorf("publication tables %v with --alter-publication, want [public.other_table public.outbox]", got)
	}
	if n := len(warnings(logs, "will not be streamed", zap.String("table", "public.outbox"), zap.Int64("rows_not_streamed", 2),
		zap.String("fix", "walrelay snapshot --table public.outbox"))); n != 1 {
		t.Errorf("%d WARN lines naming public.outbox and its 2 rows, want 1; all logs: %v", n, logs.All())
	}
}

// TestTableAddedLaterWarns: a new --table added to the publication walrelay
// created gets a WARN naming the table and the rows it already held.
func TestTableAddedLaterWarns(t *testing.T) {
	e := newEnv(t)
	if out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name); code != 0 {
		t.Fatalf("setup exit %d:\n%s", code, out)
	}
	e.exec(`CREATE TABLE outbox2 (LIKE outbox INCLUDING ALL)`)
	e.exec(`INSERT INTO outbox2 (aggregate_type, aggregate_id, type, payload) SELECT 'o', 'k', 'T', '{}' FROM generate_series(1, 3)`)
	logs := e.observeLogs()
	cfg := e.config()
	cfg.Tables = append(cfg.Tables, decoder.Table{Schema: "public", Name: "outbox2"})
	e.startRelay(cfg)
	if n := len(warnings(logs, "will not be streamed", zap.String("table", "public.outbox2"), zap.Int64("rows_not_streamed", 3))); n != 1 {
		t.Errorf("%d WARN lines naming public.outbox2 and its 3 rows, want 1; all logs: %v", n, logs.All())
	}
	c := e.consume()
	e.exec(`INSERT INTO outbox2 (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', '{}')`)
	c.waitIDs(1, 30*time.Second)
}

// TestPublicationPermissionHint: a role that owns the outbox but lacks
// CREATE on the database cannot create the publication; the error names
// both requirements and the GRANT.
func TestPublicationPermissionHint(t *testing.T) {
	e := newEnv(t)
	role := e.name + "_owner"
	u := e.createRole(role, "REPLICATION NOSUPERUSER", "owner-pw")
	e.exec(fmt.Sprintf("ALTER TABLE outbox OWNER TO %s", pgx.Identifier{role}.Sanitize()))
	refusedWith(t, withFlag(e.args(), "--pg-url", u), "ownership of the outbox tables", "CREATE on the database",
		fmt.Sprintf("GRANT CREATE ON DATABASE %s TO %s", pgx.Identifier{e.name}.Sanitize(), pgx.Identifier{role}.Sanitize()))
}
