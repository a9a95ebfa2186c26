package integration

// Decoding on a standby of a standby (cascading, PostgreSQL 16+): P → S1
// → S2, the relay on S2 with --primary-url naming P, the top of the chain
// (S2 replays what P writes, through S1). S2's physical slot is on S1,
// which the relay does not reach: the preflight finds the cascade (S2
// streams, P has no slot of S2's primary_slot_name) and checks that
// hot_standby_feedback reaches P, which it does only through S1's own
// feedback (S1's physical slot on P carries S2's xmin and catalog_xmin).

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/internal/devcluster"
)

func TestStandbyDecodeCascade(t *testing.T) {
	needPG(t, 16)
	start := time.Now()
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	rs.waitReplayed()
	s1 := rs.standby
	s2, err := s1.StartStandby(e.ctx, devcluster.StandbyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s2.Close() })
	if err := s2.WaitReplayed(e.ctx); err != nil {
		t.Fatal(err)
	}
	s2URL := s2.URL(e.name)
	logs := e.observeLogs()
	c := e.consume()
	cfg := e.config()
	cfg.PGURL, cfg.PrimaryURL = s2URL, e.url
	cfg.HeartbeatInterval = 200 * time.Millisecond
	cfg.SlotPollInterval = time.Second
	rr, reg := e.startRelayGathered(cfg)
	if n := logs.FilterMessageSnippet("streams from another standby (cascading)").Len(); n == 0 {
		t.Errorf("the preflight did not find the cascade")
	}
	for _, url := range []string{rs.primary.URL(e.name), s1.URL(e.name)} {
		if i, err := e.standbySlot(url); err == nil {
			t.Fatalf("the slot is on %s (%+v): it must be on S2 only", url, i)
		}
	}
	// S2's logical slot holds catalog rows on P through S1's physical
	// slot there.
	e.waitFor("S2's catalog_xmin on P's physical slot of S1", 30*time.Second, func() (bool, error) {
		i, err := e.standbySlot(s2URL)
		if err != nil {
			return false, err
		}
		if i.CatalogXmin == nil {
			return false, fmt.Errorf("S2's slot has no catalog_xmin yet")
		}
		var held bool
		err = queryAt(e.ctx, rs.primary.URL("postgres"), "SELECT coalesce(bool_or(catalog_xmin::text::bigint <= $2), false) FROM pg_replication_slots WHERE slot_name = $1",
			[]any{s1.Slot, *i.CatalogXmin}, &held)
		return err == nil && held, fmt.Errorf("held %v (%v), S2's slot catalog_xmin %d", held, err, *i.CatalogXmin)
	})

	fw := e.startFailoverWriters(4, 5*time.Millisecond)
	defer fw.halt()
	e.waitFor("records through the cascade", time.Minute, func() (bool, error) {
		if ok, err := rr.returned(); ok {
			return false, fmt.Errorf("the relay stopped: %v", err)
		}
		got := len(distinctIDs(c.records()))
		return got >= 300, fmt.Errorf("%d ids read", got)
	})
	fw.halt()
	committed := rs.waitCommittedRead(e, c)
	recs := c.records()
	dups, _, inv := checkSurvivingHistory(t, "at-least-once", committed, recs)

	// On a quiet outbox the heartbeat, written on P, moves S2's slot past
	// P's WAL.
	e.exec("CREATE TABLE noise (x int)")
	e.exec("INSERT INTO noise SELECT generate_series(1, 1000)")
	target := e.currentLSN(e.conn())
	beats0 := gathered(reg, "walrelay_heartbeats_total")["wal"]
	e.waitFor("S2's slot confirmed past P's WAL by a heartbeat", time.Minute, func() (bool, error) {
		i, err := e.standbySlot(s2URL)
		if err != nil {
			return false, err
		}
		beats := gathered(reg, "walrelay_heartbeats_total")["wal"]
		return i.ConfirmedLSN >= target && beats > beats0, fmt.Errorf("confirmed %s, target %s, heartbeats %v (from %v)", i.ConfirmedLSN, target, beats, beats0)
	})
	if err := rr.stop(t); err != nil {
		t.Errorf("the relay stopped with %v", err)
	}
	// status on S2 names S1 as what it streams from.
	status := []string{"status", "--pg-url", s2URL, "--primary-url", e.url, "--slot", e.name, "--explain"}
	if out, code := runOutput(t, status...); !strings.Contains(out, fmt.Sprintf("streams from 127.0.0.1:%d", s1.Port)) {
		t.Errorf("walrelay status (exit %d) does not name S1 (port %d) as S2's upstream:\n%s", code, s1.Port, out)
	}
	t.Logf("cascade P → S1 → S2, PostgreSQL %d: %d committed, %d delivered, 0 lost, %d duplicates, %d order inversions",
		pgVersion/10000, len(committed), len(distinctIDs(recs)), dups, inv)

	// S1 without hot_standby_feedback: S2's feedback stops at S1, P's slot
	// of S1 loses its xmin, and a start on S2 is refused, naming the fix.
	execAt(t, e.ctx, s1.URL("postgres"), "ALTER SYSTEM SET hot_standby_feedback = off", "SELECT pg_reload_conf()")
	noXmin := func(slot string) func() (bool, error) {
		return func() (bool, error) {
			var xmin, catalogXmin *string
			err := queryAt(e.ctx, rs.primary.URL("postgres"), "SELECT xmin::text, catalog_xmin::text FROM pg_replication_slots WHERE slot_name = $1", []any{slot}, &xmin, &catalogXmin)
			return err == nil && xmin == nil && catalogXmin == nil, fmt.Errorf("xmin %v, catalog_xmin %v (%v)", xmin, catalogXmin, err)
		}
	}
	e.waitFor("P's physical slot of S1 without xmin", 30*time.Second, noXmin(s1.Slot))
	args := e.standbyArgs(s2URL, e.url)
	fix := "set hot_standby_feedback = on on the intermediate standby"
	// A first start (no slot yet on S2): nothing on P shows any feedback.
	refused := time.Now()
	refusedWith(t, withFlag(args, "--slot", e.name+"_new"), "streams from another standby (cascading", "no physical slot there had an xmin", fix)
	t.Logf("misconfigured cascade, new slot, refused in %v", time.Since(refused).Round(time.Millisecond))

	// A direct standby of P with feedback on gives P an xmin, but not the
	// catalog_xmin of the relay's slot on S2: a restart is still refused.
	d, err := rs.primary.StartStandby(e.ctx, devcluster.StandbyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	e.waitFor("P's physical slot of the direct standby with an xmin", 30*time.Second, func() (bool, error) {
		var xmin *string
		err := queryAt(e.ctx, rs.primary.URL("postgres"), "SELECT xmin::text FROM pg_replication_slots WHERE slot_name = $1", []any{d.Slot}, &xmin)
		return err == nil && xmin != nil, fmt.Errorf("xmin %v (%v)", xmin, err)
	})
	refused = time.Now()
	refusedWith(t, args, "streams from another standby (cascading", "held the slot's catalog_xmin", fix)
	t.Logf("misconfigured cascade, existing slot, another standby's feedback on P, refused in %v", time.Since(refused).Round(time.Millisecond))

	// S1 stopped: S2 streams from nowhere, and status --explain says so.
	if err := s1.Stop(); err != nil {
		t.Fatal(err)
	}
	e.waitFor("status --explain naming S2 not streaming", 30*time.Second, func() (bool, error) {
		out, code := runOutput(t, status...)
		ok := strings.Contains(out, "NOT STREAMING") && strings.Contains(out, "standby_not_streaming") && strings.Contains(out, "primary_conninfo")
		return ok, fmt.Errorf("exit %d:\n%s", code, out)
	})
	t.Logf("test %v", time.Since(start).Round(time.Millisecond))
}

// queryAt reads one row of sql on a connection of its own to url.
func queryAt(ctx context.Context, url, sql string, args []any, dest ...any) error {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	return c.QueryRow(ctx, sql, args...).Scan(dest...)
}
