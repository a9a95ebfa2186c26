package devcluster

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walrelay/walrelay/test/testkit"
)

// startTestPrimary starts a cluster of the server WALRELAY_TEST_PG picks
// (the local one by default), closed when the test ends.
func startTestPrimary(t *testing.T) *Postgres {
	t.Helper()
	if testing.Short() {
		t.Skip("starts PostgreSQL clusters")
	}
	bin, err := TestBinDir()
	if err != nil {
		t.Fatal(err)
	}
	p, err := StartPostgres(context.Background(), PostgresOptions{BinDir: bin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func startTestStandby(t *testing.T, p *Postgres, opts StandbyOptions) *Postgres {
	t.Helper()
	s, err := p.StartStandby(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func mustExec(t *testing.T, c *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := c.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// waitRows waits until the server on url holds want rows in t.
func waitRows(t *testing.T, url string, want int) {
	t.Helper()
	err := WaitFor(60*time.Second, 20*time.Millisecond, func() (bool, error) {
		c, err := pgx.Connect(context.Background(), url)
		if err != nil {
			return false, err
		}
		defer c.Close(context.Background())
		var n int
		if err := c.QueryRow(context.Background(), "SELECT count(*) FROM t").Scan(&n); err != nil {
			return false, err
		}
		return n == want, fmt.Errorf("%d rows", n)
	})
	if err != nil {
		t.Fatalf("rows on %s: %v", url, err)
	}
}

// writeThrough connects with the multi-host URL, inserts row v and returns
// the port of the server that took it.
func writeThrough(t *testing.T, url string, v int) int {
	t.Helper()
	c := connect(t, url)
	mustExec(t, c, "INSERT INTO t VALUES ($1)", v)
	var port int
	if err := c.QueryRow(context.Background(), "SELECT inet_server_port()").Scan(&port); err != nil {
		t.Fatal(err)
	}
	return port
}

// TestStandbyFailoverTwice: a primary and a streaming standby; a row
// written on the primary shows on the read-only standby; kill -9 of the
// primary, promotion, writes on the new primary through a multi-host URL;
// a new standby of it on the dead primary's port; the same failover again,
// and the URL still finds the primary.
func TestStandbyFailoverTwice(t *testing.T) {
	ctx := context.Background()
	a := startTestPrimary(t)
	mustExec(t, connect(t, a.URL("postgres")), "CREATE TABLE t (v int)")
	b := startTestStandby(t, a, StandbyOptions{})
	if b.Upstream != a || b.Slot == "" {
		t.Fatalf("standby's upstream %v, slot %q", b.Upstream, b.Slot)
	}
	url := MultiHostURL("postgres", a.Port, b.Port)

	if port := writeThrough(t, url, 1); port != a.Port {
		t.Fatalf("the multi-host URL wrote on port %d, want the primary's %d", port, a.Port)
	}
	waitRows(t, b.URL("postgres"), 1)
	var pgErr *pgconn.PgError
	if _, err := connect(t, b.URL("postgres")).Exec(ctx, "INSERT INTO t VALUES (0)"); !errors.As(err, &pgErr) || pgErr.Code != "25006" {
		t.Fatalf("insert on the standby: %v, want read_only_sql_transaction (25006)", err)
	}
	var slotActive bool
	if err := connect(t, a.URL("postgres")).QueryRow(ctx, "SELECT active FROM pg_replication_slots WHERE slot_name = $1 AND slot_type = 'physical'", b.Slot).Scan(&slotActive); err != nil || !slotActive {
		t.Fatalf("physical slot %q on the primary: active %v, %v", b.Slot, slotActive, err)
	}

	for round, nodes := range [][2]**Postgres{{&a, &b}, {&b, &a}} {
		primary, standby := *nodes[0], *nodes[1]
		if err := primary.Kill(); err != nil {
			t.Fatalf("round %d: kill: %v", round, err)
		}
		if c, err := pgx.Connect(ctx, primary.URL("postgres")); err == nil {
			c.Close(ctx)
			t.Fatalf("round %d: the killed primary on port %d still accepts connections", round, primary.Port)
		}
		if _, err := pgx.Connect(ctx, url); err == nil {
			t.Fatalf("round %d: the multi-host URL found a read-write server with the primary dead and the standby not promoted", round)
		}
		if err := standby.Promote(ctx); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if standby.Upstream != nil {
			t.Fatalf("round %d: promoted server still has an upstream", round)
		}
		if port := writeThrough(t, url, 10+round); port != standby.Port {
			t.Fatalf("round %d: the multi-host URL wrote on port %d, want the promoted server's %d", round, port, standby.Port)
		}
		dead := primary.Port
		primary.Close()
		next := startTestStandby(t, standby, StandbyOptions{Port: dead})
		if next.Port != dead {
			t.Fatalf("round %d: new standby on port %d, want %d", round, next.Port, dead)
		}
		if err := next.WaitReplayed(ctx); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		waitRows(t, next.URL("postgres"), 2+round)
		*nodes[0] = next
	}
	// a is the server promoted in the second round, b its standby.
	if port := writeThrough(t, url, 99); port != a.Port {
		t.Fatalf("after two failovers the multi-host URL wrote on port %d, want %d", port, a.Port)
	}
	waitRows(t, b.URL("postgres"), 4)
}

// TestFailoverSlotSyncedAndPromoted (PostgreSQL 17 and later): a logical
// slot created with failover = true on the primary appears on a standby
// with sync_replication_slots as synced and not temporary, survives kill -9
// of the primary and the promotion, decodes there, and reaches the next
// standby of the promoted server.
func TestFailoverSlotSyncedAndPromoted(t *testing.T) {
	ctx := context.Background()
	a := startTestPrimary(t)
	if major, err := a.Major(ctx); err != nil {
		t.Fatal(err)
	} else if major < 17 {
		t.Skipf("failover slots need PostgreSQL 17 or later; this server is %d (run with %s=17 or 18)", major, TestPGEnv)
	}
	ac := connect(t, a.URL("postgres"))
	mustExec(t, ac, "CREATE TABLE t (v int PRIMARY KEY)")
	mustExec(t, ac, "CREATE PUBLICATION p FOR TABLE t")
	b := startTestStandby(t, a, StandbyOptions{SyncSlots: true, SynchronizedStandbySlots: true})
	var sss string
	if err := ac.QueryRow(ctx, "SELECT setting FROM pg_settings WHERE name = 'synchronized_standby_slots'").Scan(&sss); err != nil || sss != b.Slot {
		t.Fatalf("primary's synchronized_standby_slots = %q, %v; want %q", sss, err, b.Slot)
	}
	mustExec(t, ac, "SELECT pg_create_logical_replication_slot('fo', 'pgoutput', false, false, true)")
	waitSynced(t, b, ac, "fo")

	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := b.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	bc := connect(t, b.URL("postgres"))
	var failover bool
	if err := bc.QueryRow(ctx, "SELECT failover FROM pg_replication_slots WHERE slot_name = 'fo'").Scan(&failover); err != nil || !failover {
		t.Fatalf("slot fo on the promoted server: failover %v, %v", failover, err)
	}
	mustExec(t, bc, "INSERT INTO t SELECT max(v) + 1 FROM t")
	// The promoted server decodes from the synced slot: the row written
	// after promotion is in its stream.
	var changes int
	if err := bc.QueryRow(ctx, "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('fo', NULL, NULL, 'proto_version', '1', 'publication_names', 'p')").Scan(&changes); err != nil || changes == 0 {
		t.Fatalf("decoding slot fo on the promoted server: %d changes, %v", changes, err)
	}
	dead := a.Port
	a.Close()
	c := startTestStandby(t, b, StandbyOptions{Port: dead, SyncSlots: true, SynchronizedStandbySlots: true})
	waitSynced(t, c, bc, "fo")
}

// waitSynced waits until slot is on the standby s as a synced, persistent
// (not temporary) failover slot: one its promotion keeps. Meanwhile it
// moves the slot on the primary (conn) as a consumer would: the standby
// keeps its copy temporary until the primary's slot needs no WAL and no
// catalog rows older than the standby has (what the standby had when the
// copy was made may be newer).
func waitSynced(t *testing.T, s *Postgres, primary *pgx.Conn, slot string) {
	t.Helper()
	ctx := context.Background()
	err := WaitFor(90*time.Second, 100*time.Millisecond, func() (bool, error) {
		// A transaction, a snapshot of running transactions for decoding
		// to move catalog_xmin past it, and the slot confirmed up to here.
		for _, sql := range []string{
			"INSERT INTO t SELECT coalesce(max(v), 0) + 1 FROM t",
			"SELECT pg_log_standby_snapshot()",
			"SELECT pg_replication_slot_advance('" + slot + "', pg_current_wal_lsn())",
		} {
			if _, err := primary.Exec(ctx, sql); err != nil {
				return false, fmt.Errorf("%s: %w", sql, err)
			}
		}
		var synced, temporary, failover bool
		err := s.withConn(ctx, func(c *pgx.Conn) error {
			return c.QueryRow(ctx, "SELECT synced, temporary, failover FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&synced, &temporary, &failover)
		})
		if err != nil {
			return false, err
		}
		return synced && !temporary && failover, fmt.Errorf("synced %v, temporary %v, failover %v", synced, temporary, failover)
	})
	if err != nil {
		t.Fatalf("slot %s on the standby on port %d: %v\n%s", slot, s.Port, err, testkit.LastLines(s.tailLog(), 20))
	}
}

// TestKillThenStart: a killed server starts again, recovering from the
// crash, with what it had committed. The killed postmaster may still be a
// zombie then, whose PID in the lock files made the start refuse.
func TestKillThenStart(t *testing.T) {
	p := startTestPrimary(t)
	c := connect(t, p.URL("postgres"))
	mustExec(t, c, "CREATE TABLE survives (id int)")
	mustExec(t, c, "INSERT INTO survives VALUES (1)")
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := p.Start(context.Background()); err != nil {
		t.Fatalf("start after kill: %v", err)
	}
	var n int
	if err := p.queryRow(context.Background(), "SELECT count(*) FROM survives", &n); err != nil || n != 1 {
		t.Fatalf("after the crash: %d rows, %v; want 1", n, err)
	}
}

// TestStandbyOfStandby: a standby of a standby (cascading, P → S1 → S2)
// streams from S1 through a physical slot there, not on P, and replays
// what P writes; WaitReplayed on S2 waits for S1's replay position.
func TestStandbyOfStandby(t *testing.T) {
	ctx := context.Background()
	p := startTestPrimary(t)
	mustExec(t, connect(t, p.URL("postgres")), "CREATE TABLE t (v int)")
	s1 := startTestStandby(t, p, StandbyOptions{})
	s2 := startTestStandby(t, s1, StandbyOptions{})
	if s2.Upstream != s1 {
		t.Fatalf("S2's upstream is port %d, want S1's %d", s2.Upstream.Port, s1.Port)
	}
	var onS1, onP bool
	if err := connect(t, s1.URL("postgres")).QueryRow(ctx, "SELECT count(*) = 1 FROM pg_replication_slots WHERE slot_name = $1 AND active", s2.Slot).Scan(&onS1); err != nil || !onS1 {
		t.Fatalf("S2's physical slot %q on S1: active %v, %v", s2.Slot, onS1, err)
	}
	if err := connect(t, p.URL("postgres")).QueryRow(ctx, "SELECT count(*) > 0 FROM pg_replication_slots WHERE slot_name = $1", s2.Slot).Scan(&onP); err != nil || onP {
		t.Fatalf("S2's physical slot %q on P: %v, %v", s2.Slot, onP, err)
	}
	mustExec(t, connect(t, p.URL("postgres")), "INSERT INTO t SELECT generate_series(1, 10)")
	if err := s1.WaitReplayed(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s2.WaitReplayed(ctx); err != nil {
		t.Fatal(err)
	}
	waitRows(t, s2.URL("postgres"), 10)
}
