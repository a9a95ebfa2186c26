package relay

// pg_test.go: the real PostgreSQL of the tests of what the relay asks the
// server itself (the guard, the slot poller, a whole Run): one throwaway
// cluster (devcluster, run as the postgres user when the tests run as
// root), started by the first test that needs it (newPGEnv) so that the
// unit tests stay fast, and stopped once the package's tests end. Under
// -short (make unit) those tests are skipped. WALRELAY_TEST_PG picks the
// server as for the integration tests.

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
	"github.com/walrelay/walrelay/test/testdb"
	"github.com/walrelay/walrelay/test/testkit"
)

// pg is the package's cluster, once started.
var pg struct {
	once    sync.Once
	cluster *devcluster.Postgres
	err     error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if pg.cluster != nil {
		if err := pg.cluster.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "stop PostgreSQL:", err)
		}
	}
	os.Exit(code)
}

// pgAdminURL is the superuser URL of the package's cluster, started on
// first use; the test is skipped under -short.
func pgAdminURL(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("starts PostgreSQL: skipped under -short (make unit); run without -short")
	}
	pg.once.Do(func() {
		bin, err := devcluster.TestBinDir()
		if err != nil {
			pg.err = err
			return
		}
		pg.cluster, pg.err = devcluster.StartPostgres(context.Background(), devcluster.PostgresOptions{BinDir: bin, Settings: map[string]string{
			"max_prepared_transactions": "10", // TestSlotPollerReadsWhatHoldsTheSlot prepares one
		}})
	})
	if pg.err != nil {
		t.Fatalf("start PostgreSQL: %v", pg.err)
	}
	return pg.cluster.URL("postgres")
}

// pgEnv is one test's database on the package's cluster, with an outbox
// table, and a slot name of its own (slots are the cluster's).
type pgEnv struct {
	t    *testing.T
	name string // the database and the slot
	url  string // the database, as the superuser
	ctx  context.Context
}

// newPGEnv creates the test's database with an outbox table (testdb: its
// slots are dropped when the test ends).
func newPGEnv(t *testing.T) *pgEnv {
	t.Helper()
	admin := pgAdminURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	// Short: the relay's connection names (doctor.RelayAppName) must fit
	// the 63 bytes PostgreSQL keeps.
	name, url := testdb.Create(t, ctx, admin, "r", 24)
	e := &pgEnv{t: t, name: name, url: url, ctx: ctx}
	e.exec(`CREATE TABLE outbox (
		id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
		aggregate_type text NOT NULL DEFAULT 'order',
		aggregate_id text NOT NULL DEFAULT 'a1',
		type text NOT NULL DEFAULT 'created',
		payload jsonb NOT NULL DEFAULT '{}'
	)`)
	return e
}

// exec runs statements on the test's database.
func (e *pgEnv) exec(sql string, args ...any) {
	e.t.Helper()
	conn := e.conn()
	defer conn.Close(context.Background())
	if _, err := conn.Exec(e.ctx, sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

// conn is a new connection to the test's database; the caller closes it.
func (e *pgEnv) conn() *pgx.Conn {
	e.t.Helper()
	conn, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	return conn
}

// insert commits one outbox row per id (uuids) in one transaction and
// returns the WAL position after its commit.
func (e *pgEnv) insert(ids ...string) decoder.LSN {
	e.t.Helper()
	conn := e.conn()
	defer conn.Close(context.Background())
	tx, err := conn.Begin(e.ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	for _, id := range ids {
		if _, err := tx.Exec(e.ctx, "INSERT INTO outbox (id) VALUES ($1)", id); err != nil {
			e.t.Fatal(err)
		}
	}
	if err := tx.Commit(e.ctx); err != nil {
		e.t.Fatal(err)
	}
	return e.lsn(conn, "pg_current_wal_lsn()")
}

func (e *pgEnv) lsn(conn *pgx.Conn, expr string) decoder.LSN {
	e.t.Helper()
	var s *string
	if err := conn.QueryRow(e.ctx, "SELECT ("+expr+")::text").Scan(&s); err != nil {
		e.t.Fatal(err)
	}
	if s == nil {
		return 0
	}
	l, err := slot.ParseLSN(*s)
	if err != nil {
		e.t.Fatal(err)
	}
	return l
}

// slotConfirmed is the slot's confirmed_flush_lsn (0 when there is no slot).
func (e *pgEnv) slotConfirmed() decoder.LSN {
	e.t.Helper()
	conn := e.conn()
	defer conn.Close(context.Background())
	return e.lsn(conn, "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '"+e.name+"'")
}

// record is walrelay's record of the test's slot.
func (e *pgEnv) record() source.Record {
	e.t.Helper()
	conn := e.conn()
	defer conn.Close(context.Background())
	rec, ok, err := source.ReadRecord(e.ctx, conn, source.DefaultRecordSchema, e.name)
	if err != nil || !ok {
		e.t.Fatalf("read walrelay's record of slot %s: found %v, %v", e.name, ok, err)
	}
	return rec
}

// appNames are the application_names of the database's connections.
func (e *pgEnv) appNames() []string {
	e.t.Helper()
	conn := e.conn()
	defer conn.Close(context.Background())
	rows, err := conn.Query(e.ctx, "SELECT application_name FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", e.name)
	if err != nil {
		e.t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		e.t.Fatal(err)
	}
	return names
}

// waitFor polls cond (every 20ms) until it holds, failing the test after
// patience.
func (e *pgEnv) waitFor(what string, cond func() bool) {
	e.t.Helper()
	if err := devcluster.WaitFor(pgPatience, 20*time.Millisecond, func() (bool, error) { return cond(), nil }); err != nil {
		e.t.Fatalf("waiting for %s: %v", what, err)
	}
}

// pgPatience bounds a wait on PostgreSQL and Kafka in these tests: long,
// because the machine may be loaded; a passing test never waits it out.
const pgPatience = 60 * time.Second

// pgConfig is a relay configuration for the test's database and slot,
// with the background work's intervals short so that the tests see it act,
// and no heartbeat; its Kafka is config's.
func (e *pgEnv) pgConfig() Config {
	cfg := validConfig()
	cfg.PGURL = e.url
	cfg.Slot = e.name
	cfg.StatusInterval, cfg.ConfirmDelay = 200*time.Millisecond, 10*time.Millisecond
	cfg.SlotPollInterval = 50 * time.Millisecond
	cfg.BackoffMin, cfg.BackoffMax = 20*time.Millisecond, 200*time.Millisecond
	cfg.HeartbeatInterval = 0
	cfg.ShutdownTimeout = 10 * time.Second
	return cfg
}

// config is pgConfig producing to a new kfake cluster, whose seed brokers
// it returns too.
func (e *pgEnv) config() (Config, []string) {
	e.t.Helper()
	seeds := testkit.Kfake(e.t).ListenAddrs()
	cfg := e.pgConfig()
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(seeds...)}
	return cfg, seeds
}

// consume reads topic from the start until cond holds of every record read
// so far, failing the test after pgPatience; it returns those records.
func consume(t *testing.T, seeds []string, topic string, cond func([]*kgo.Record) bool, opts ...kgo.Opt) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(seeds...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), pgPatience)
	defer cancel()
	var recs []*kgo.Record
	for !cond(recs) {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %d records of topic %s, then timed out waiting for more", len(recs), topic)
		}
		fs.EachRecord(func(r *kgo.Record) { recs = append(recs, r) })
	}
	return recs
}

// ids are the id headers of recs, in order.
func ids(recs []*kgo.Record) []string {
	var out []string
	for _, r := range recs {
		for _, h := range r.Headers {
			if h.Key == "id" {
				out = append(out, string(h.Value))
			}
		}
	}
	return out
}
