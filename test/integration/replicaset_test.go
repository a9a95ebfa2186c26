package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// replicaSet is a primary with a streaming physical standby, both of the
// server the package's cluster runs (WALRELAY_TEST_PG), for one test of
// failover. Its URLs name both ports with target_session_attrs=read-write:
// failover kills the primary, promotes the standby and starts a new
// standby of it on the dead primary's port, so they stay valid across any
// number of failovers.
type replicaSet struct {
	t       *testing.T
	primary *devcluster.Postgres
	standby *devcluster.Postgres
	ports   []int
	opts    devcluster.StandbyOptions
	// failovers counts the failovers done so far.
	failovers int
}

// replicaSetOptions configures startReplicaSet.
type replicaSetOptions struct {
	// FailoverSlots: the standby synchronizes the primary's failover
	// logical slots (sync_replication_slots = on; PostgreSQL 17+).
	FailoverSlots bool
	// SynchronizedStandbySlots: the primary's synchronized_standby_slots
	// names the standby's physical slot (PostgreSQL 17+).
	SynchronizedStandbySlots bool
	// Settings are extra postgresql.conf lines of the primary (copied to
	// every standby made from it).
	Settings map[string]string
}

// startReplicaSet starts a primary and a standby streaming from it, closed
// when the test ends. Skipped against an external PostgreSQL.
func startReplicaSet(t *testing.T, o replicaSetOptions) *replicaSet {
	t.Helper()
	if pgCluster == nil {
		t.Skip("needs PostgreSQL clusters of its own; skipped against an external PostgreSQL")
	}
	if o.FailoverSlots || o.SynchronizedStandbySlots {
		needPG(t, 17)
	}
	settings := map[string]string{"wal_sender_timeout": "'10s'"}
	for k, v := range o.Settings {
		settings[k] = v
	}
	ctx := context.Background()
	p, err := devcluster.StartPostgres(ctx, devcluster.PostgresOptions{BinDir: pgCluster.BinDir(), Settings: settings})
	if err != nil {
		t.Fatal(err)
	}
	rs := &replicaSet{t: t, primary: p, opts: devcluster.StandbyOptions{SyncSlots: o.FailoverSlots, SynchronizedStandbySlots: o.SynchronizedStandbySlots}}
	// Registered first, so it runs after the cleanups of the envs made on
	// the set (they drop their slots through its URL).
	t.Cleanup(func() {
		for _, pg := range []*devcluster.Postgres{rs.standby, rs.primary} {
			if pg != nil {
				pg.Close()
			}
		}
	})
	rs.standby = rs.startStandby(0)
	rs.ports = []int{p.Port, rs.standby.Port}
	return rs
}

func (rs *replicaSet) startStandby(port int) *devcluster.Postgres {
	rs.t.Helper()
	o := rs.opts
	o.Port = port
	s, err := rs.primary.StartStandby(context.Background(), o)
	if err != nil {
		rs.t.Fatal(err)
	}
	return s
}

// adminURL is the multi-host superuser URL of the set's postgres database:
// it reaches whichever server accepts writes.
func (rs *replicaSet) adminURL() string { return devcluster.MultiHostURL("postgres", rs.ports...) }

// newEnv is newEnv on the set: the test's database (reached through the
// multi-host URL) with its outbox table, and a broker of its own.
func (rs *replicaSet) newEnv() *env { return newEnvOn(rs.t, rs.adminURL()) }

// failover kills the primary with SIGKILL (its machine gone), promotes the
// standby, and starts a new standby of the promoted server on the dead
// primary's port, streaming (and, with FailoverSlots, synchronizing slots)
// before it returns. promoted, when set, runs right after the promotion,
// before the new standby exists: the window in which the new primary has
// no standby.
func (rs *replicaSet) failover(promoted func()) {
	rs.t.Helper()
	ctx := context.Background()
	old := rs.primary
	if err := old.Kill(); err != nil {
		rs.t.Fatalf("failover %d: kill the primary: %v", rs.failovers+1, err)
	}
	if err := rs.standby.Promote(ctx); err != nil {
		rs.t.Fatalf("failover %d: %v", rs.failovers+1, err)
	}
	rs.primary, rs.standby = rs.standby, nil
	old.Close()
	if promoted != nil {
		promoted()
	}
	rs.standby = rs.startStandby(old.Port)
	rs.failovers++
}

// waitReplayed waits until the standby has replayed all the primary wrote.
func (rs *replicaSet) waitReplayed() {
	rs.t.Helper()
	if err := rs.standby.WaitReplayed(context.Background()); err != nil {
		rs.t.Fatal(err)
	}
}

// replicationState describes the primary and the standby for a failure
// message: what each holds of db's outbox and where replay stands.
func (rs *replicaSet) replicationState(db string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	probe := func(url, sql string, settings ...string) string {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			return err.Error()
		}
		defer c.Close(context.Background())
		for _, set := range settings {
			if _, err := c.Exec(ctx, "SET "+set+" = off"); err != nil {
				return err.Error()
			}
		}
		var out string
		if err := c.QueryRow(ctx, sql).Scan(&out); err != nil {
			return err.Error()
		}
		return out
	}
	return fmt.Sprintf("primary (port %d): %s; standby (port %d): %s; standby without index scans: %s",
		rs.primary.Port, probe(rs.primary.URL(db), `SELECT format('%s rows, wal %s, timeline %s, standbys %s', (SELECT count(*) FROM outbox),
			pg_current_wal_lsn(), (SELECT timeline_id FROM pg_control_checkpoint()),
			(SELECT coalesce(string_agg(application_name || ' ' || state || ' replay ' || coalesce(replay_lsn::text, '-'), ', '), 'none') FROM pg_stat_replication))`),
		rs.standby.Port, probe(rs.standby.URL(db), `SELECT format('%s rows, receive %s, replay %s, in recovery %s, receiver %s', (SELECT count(*) FROM outbox),
			pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn(), pg_is_in_recovery(),
			(SELECT coalesce(string_agg(status || ' tli ' || received_tli, ', '), 'none') FROM pg_stat_wal_receiver))`),
		probe(rs.standby.URL(db), `SELECT count(*)::text FROM outbox`, "enable_indexscan", "enable_indexonlyscan", "enable_bitmapscan"))
}

// TestReplicaSetFailovers is the harness's own test: rows written through
// an env's multi-host URL survive two failovers in a row, each promoted
// server takes writes through the same URL, and the standby of each round
// has every row.
func TestReplicaSetFailovers(t *testing.T) {
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	insert := func(n int) {
		t.Helper()
		c, err := pgx.Connect(e.ctx, e.url)
		if err != nil {
			t.Fatalf("connect through %s: %v", e.url, err)
		}
		defer c.Close(context.Background())
		if _, err := c.Exec(e.ctx, "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) SELECT 'order', 'o', 'created', '{}', g FROM generate_series(1, $1) g", n); err != nil {
			t.Fatal(err)
		}
		var port int
		if err := c.QueryRow(e.ctx, "SELECT inet_server_port()").Scan(&port); err != nil || port != rs.primary.Port {
			t.Fatalf("the env's URL reached port %d (%v), want the primary's %d", port, err, rs.primary.Port)
		}
	}
	count := func(url string) int {
		t.Helper()
		c, err := pgx.Connect(e.ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(context.Background())
		var n int
		if err := c.QueryRow(e.ctx, "SELECT count(*) FROM outbox").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	insert(10)
	for i := 1; i <= 2; i++ {
		// Replication is asynchronous: a commit the standby has not
		// received when the primary dies is lost with it (seen: the
		// promoted server held 10 of 20 rows). The harness's subject is
		// what was replicated surviving.
		rs.waitReplayed()
		start := time.Now()
		rs.failover(nil)
		t.Logf("failover %d (kill, promote, new standby streaming) took %s", i, time.Since(start).Round(time.Millisecond))
		insert(10)
		rs.waitReplayed()
		standbyURL := rs.standby.URL(e.name)
		// Replayed is not always visible at once to a new hot standby's
		// queries: wait for the rows, then hold them to the exact count.
		want := 10 * (i + 1)
		err := devcluster.WaitFor(30*time.Second, 50*time.Millisecond, func() (bool, error) {
			got := count(standbyURL)
			return got >= want, fmt.Errorf("the new standby holds %d rows", got)
		})
		if err != nil {
			t.Fatalf("after failover %d: %v, want %d; %s", i, err, want, rs.replicationState(e.name))
		}
		if got := count(standbyURL); got != want {
			t.Fatalf("after failover %d the new standby holds %d rows, want %d", i, got, want)
		}
	}
	if rs.failovers != 2 {
		t.Fatalf("failovers = %d", rs.failovers)
	}
}
