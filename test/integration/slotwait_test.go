package integration

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// A first start creates the slot, and PostgreSQL creates a logical slot
// only once every transaction that held an xid when the creation began has
// ended, prepared transactions included. These tests hold such a
// transaction open on a cluster of their own (it would hold every other
// test's slot creation; prepared transactions need
// max_prepared_transactions) and check what the relay and status say while
// the creation waits, that --startup-timeout ends the wait without leaving
// anything behind, and that nothing is lost once the relay streams.

// slotWaitInterval is the tests' relay.Config.SlotPollInterval: how often
// the relay warns while the creation waits (10s by default).
const slotWaitInterval = 300 * time.Millisecond

// blocker is a transaction holding an xid: open in a session of its own,
// or prepared.
type blocker struct {
	e    *env
	conn *pgx.Conn
	pid  uint32
	gid  string // a prepared transaction's gid, "" for an open one
}

// holdOpen begins a transaction in a session named nightly-batch and
// writes a row in it (the write gives it an xid), leaving it open.
func (e *env) holdOpen() *blocker {
	e.t.Helper()
	e.exec(`CREATE TABLE IF NOT EXISTS batch (i int)`)
	cfg, err := pgx.ParseConfig(e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = "nightly-batch"
	conn, err := pgx.ConnectConfig(e.ctx, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { conn.Close(context.Background()) })
	for _, q := range []string{"BEGIN", "INSERT INTO batch (i)\n  SELECT g FROM generate_series(1, 10) g"} {
		if _, err := conn.Exec(e.ctx, q); err != nil {
			e.t.Fatal(err)
		}
	}
	return &blocker{e: e, conn: conn, pid: conn.PgConn().PID()}
}

// holdPrepared prepares a transaction that wrote a row, as a transaction
// manager that then crashed leaves it: no session holds it.
func (e *env) holdPrepared(gid string) *blocker {
	e.t.Helper()
	e.exec(`CREATE TABLE IF NOT EXISTS batch (i int)`)
	conn, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(context.Background())
	for _, q := range []string{"BEGIN", "INSERT INTO batch VALUES (1)", "PREPARE TRANSACTION '" + gid + "'"} {
		if _, err := conn.Exec(e.ctx, q); err != nil {
			e.t.Fatal(err)
		}
	}
	e.t.Cleanup(func() {
		// Left prepared, it would hold every later slot creation of the
		// cluster.
		if c, err := pgx.Connect(context.Background(), e.url); err == nil {
			_, _ = c.Exec(context.Background(), "ROLLBACK PREPARED '"+gid+"'")
			c.Close(context.Background())
		}
	})
	return &blocker{e: e, gid: gid}
}

// names are what a warning about the blocker must say: who it is and the
// fix.
func (b *blocker) names() []string {
	if b.gid != "" {
		return []string{"prepared transaction '" + b.gid + "'", fmt.Sprintf("database %q", b.e.name), "ROLLBACK PREPARED '" + b.gid + "'"}
	}
	return []string{fmt.Sprintf("pid %d", b.pid), `application "nightly-batch"`, `"INSERT INTO batch (i) …"`,
		fmt.Sprintf("pg_terminate_backend(%d)", b.pid)}
}

// end commits the open transaction, or rolls the prepared one back.
func (b *blocker) end() {
	b.e.t.Helper()
	if b.gid != "" {
		b.e.exec("ROLLBACK PREPARED '" + b.gid + "'")
		return
	}
	if _, err := b.conn.Exec(b.e.ctx, "COMMIT"); err != nil {
		b.e.t.Fatal(err)
	}
}

// entryText is a log entry's message and fields, as one string.
func entryText(l observer.LoggedEntry) string {
	var b strings.Builder
	b.WriteString(l.Message)
	m := l.ContextMap()
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%v", k, m[k])
	}
	return b.String()
}

// creationWarnings are the relay's WARNs that creating the slot waits.
func creationWarnings(logs *observer.ObservedLogs) []observer.LoggedEntry {
	return logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet("creating the replication slot waits").All()
}

// slotWaitCluster starts the cluster of the test's own.
func slotWaitCluster(t *testing.T) *devcluster.Postgres {
	t.Helper()
	if pgCluster == nil {
		t.Skip("holds transactions that hold every slot creation of the cluster: needs a cluster of its own; skipped with WALRELAY_TEST_PG_URL")
	}
	pg, err := devcluster.StartPostgres(context.Background(), devcluster.PostgresOptions{Settings: map[string]string{
		"max_prepared_transactions": "4",
		"wal_sender_timeout":        "'10s'",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })
	return pg
}

// TestSlotCreationWaits: a transaction open with an xid (a batch job's)
// or prepared (an XA manager's, orphaned) holds the first start's slot
// creation. Meanwhile the relay warns every relay.Config.SlotPollInterval
// naming it (pid, application and first query line, or gid) with the fix,
// status --explain says the same, and walrelay_slot_creation_wait_seconds
// counts the wait; once it ends, the relay streams and publishes the rows
// already there and written during the wait (with the initial snapshot) and
// those written after. With --startup-timeout shorter than the wait, run
// gives up naming the transaction, exits 4 (a restart helps once it ended),
// and leaves no slot, temporary slot, walsender or advisory lock behind.
func TestSlotCreationWaits(t *testing.T) {
	pg := slotWaitCluster(t)
	for _, tc := range []struct {
		name     string
		prepared bool
		snapshot bool
	}{
		{"open transaction, initial snapshot", false, true},
		{"open transaction, no snapshot", false, false},
		{"prepared transaction, initial snapshot", true, true},
		{"prepared transaction, no snapshot", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnvOn(t, pg.URL("postgres"))
			logs := e.observeLogs()
			e.insertOutbox("before", 3)
			var b *blocker
			if tc.prepared {
				b = e.holdPrepared("xa-" + e.name)
			} else {
				b = e.holdOpen()
			}
			c := e.consume()
			cfg := e.config()
			cfg.InitialSnapshot = tc.snapshot
			cfg.SlotPollInterval = slotWaitInterval
			rr, reg := e.launchRelay(cfg)

			e.waitFor("two warnings that creating the slot waits", 60*time.Second, func() (bool, error) {
				if ok, err := rr.returned(); ok {
					return false, fmt.Errorf("relay stopped: %v", err)
				}
				n := len(creationWarnings(logs))
				return n >= 2, fmt.Errorf("%d warnings", n)
			})
			w := creationWarnings(logs)
			t.Logf("WARN: %s", entryText(w[len(w)-1]))
			mustContain(t, "the warning", entryText(w[len(w)-1]), b.names()...)

			text, causes := e.explain()
			t.Logf("status --explain:\n%s", text)
			mustContain(t, "status --explain", text, append(b.names(), "is creating replication slot")...)
			var kinds []string
			for _, c := range causes {
				kinds = append(kinds, c.Kind)
			}
			want := "open_transaction"
			if tc.prepared {
				want = "prepared_transaction"
			}
			if len(kinds) != 2 || kinds[0] != "slot_creation" || kinds[1] != want {
				t.Errorf("status --explain --json causes %v, want [slot_creation %s]", kinds, want)
			}
			if v := metricOf(reg, "walrelay_slot_creation_wait_seconds"); v <= 0 {
				t.Errorf("walrelay_slot_creation_wait_seconds = %v while the creation waits, want > 0", v)
			}

			e.insertOutbox("during", 3)
			if rr.relay.Streaming() {
				t.Fatal("the relay streams while the transaction is still open")
			}
			b.end()
			e.waitFor("relay streaming", 60*time.Second, func() (bool, error) {
				if ok, err := rr.returned(); ok {
					return false, fmt.Errorf("relay stopped: %v", err)
				}
				return rr.relay.Streaming(), nil
			})
			if v := metricOf(reg, "walrelay_slot_creation_wait_seconds"); v != 0 {
				t.Errorf("walrelay_slot_creation_wait_seconds = %v once streaming, want 0", v)
			}
			e.insertOutbox("after", 3)
			// Without the snapshot the slot starts at its consistent point,
			// after the wait: what was committed before is not published
			// (--snapshot never), as on any first start.
			wantByAgg := map[string]int{"before": 3, "during": 3, "after": 3}
			if !tc.snapshot {
				wantByAgg = map[string]int{"after": 3}
			}
			total := 0
			for _, n := range wantByAgg {
				total += n
			}
			recs := c.waitIDs(total, 60*time.Second)
			byAgg := map[string]map[string]bool{}
			for _, r := range recs {
				agg := strings.TrimPrefix(r.Topic, e.topicPrefix())
				id, _ := header(r, "id")
				if byAgg[agg] == nil {
					byAgg[agg] = map[string]bool{}
				}
				byAgg[agg][id] = true
			}
			for agg, n := range wantByAgg {
				if len(byAgg[agg]) != n {
					t.Errorf("%d distinct %q events published, want %d", len(byAgg[agg]), agg, n)
				}
			}
		})
	}

	// nothingLeft waits until the test database has no slot (the
	// snapshot's temporary one included), no walsender and no advisory
	// lock (the one serialising the creation with the initial snapshot).
	nothingLeft := func(t *testing.T, e *env) {
		t.Helper()
		conn := e.conn()
		e.waitFor("no slot, walsender or advisory lock left in the database", 20*time.Second, func() (bool, error) {
			var slots, walsenders, locks int
			err := conn.QueryRow(e.ctx, `SELECT
				(SELECT count(*) FROM pg_replication_slots WHERE database = current_database()),
				(SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname = current_database()),
				(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))`).
				Scan(&slots, &walsenders, &locks)
			return err == nil && slots+walsenders+locks == 0, fmt.Errorf("%d slots, %d walsenders, %d advisory locks (%v)", slots, walsenders, locks, err)
		})
	}

	for _, snapshot := range []bool{true, false} {
		t.Run(fmt.Sprintf("startup timeout, initial snapshot %v", snapshot), func(t *testing.T) {
			e := newEnvOn(t, pg.URL("postgres"))
			b := e.holdOpen()
			cfg := e.config()
			cfg.InitialSnapshot = snapshot
			cfg.SlotPollInterval = slotWaitInterval
			cfg.StartupTimeout = 3 * time.Second
			rr, _ := e.launchRelay(cfg)
			var runErr error
			e.waitFor("the relay to give up at relay.Config.StartupTimeout", 60*time.Second, func() (bool, error) {
				ok, err := rr.returned()
				runErr = err
				return ok, nil
			})
			if runErr == nil {
				t.Fatal("Run returned nil, want the startup timeout's error")
			}
			t.Logf("Run: %v", runErr)
			mustContain(t, "Run's error", runErr.Error(), append(b.names(), "relay.Config.StartupTimeout 3s")...)
			nothingLeft(t, e)

			// A restart helps once the transaction ended.
			b.end()
			e.startRelay(cfg)
		})
	}

	t.Run("startup timeout, walrelay run exits 4", func(t *testing.T) {
		e := newEnvOn(t, pg.URL("postgres"))
		b := e.holdOpen()
		r := e.runCLI(60*time.Second, nil, withFlag(withFlag(e.args(), "--startup-timeout", "3s"), "--slot-poll-interval", slotWaitInterval.String())...)
		if r.code != 4 {
			t.Errorf("exit code %d, want 4 (gave up at --startup-timeout)", r.code)
		}
		mustContain(t, "the last line", finalLines(r.stderr), append(b.names(), "--startup-timeout 3s")...)
		nothingLeft(t, e)
	})
}
