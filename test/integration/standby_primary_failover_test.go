package integration

// Decoding on a hot standby (PostgreSQL 16+) while its primary fails over
// to another server: primary P with two standbys, S1 (the relay decodes
// there, its logical slot on S1) and S2. Under load from writers on P, P
// is killed, S2 promoted and S1 repointed to S2 (primary_conninfo and
// primary_slot_name by ALTER SYSTEM and pg_reload_conf(), which 16+ applies
// without a restart); the writers go on on S2. Every committed row is
// delivered, duplicates counted, per-key order kept. With --primary-url a
// multi-host URL the relay's heartbeat and record follow the new primary;
// with --primary-url naming the dead P alone, decoding goes on and the
// relay says, once, that the primary is unreachable and what to do.

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// TestStandbyDecodePrimaryFailoverMultiHost: --primary-url names P and S2
// with target_session_attrs=read-write; after the failover the relay's
// heartbeat lands on S2 and moves the slot on S1 past it, with no restart;
// a relay killed and started after the failover resumes (duplicates
// counted).
func TestStandbyDecodePrimaryFailoverMultiHost(t *testing.T) {
	needPG(t, 16)
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) { standbyPrimaryFailover(t, mode, sbFailoverOptions{multiHost: true}) })
	}
}

// TestStandbyDecodePrimaryFailoverPrimaryGone: --primary-url names the
// dead P alone. The relay goes on streaming what S1 replays and says once
// (a WARN, walrelay_standby_primary_reachable 0, status --explain) that
// the primary is unreachable and --primary-url must be repointed: no
// silent stall, no line per heartbeat. A start with the dead P gives up
// at --startup-timeout naming the fix; one repointed to S2 resumes.
func TestStandbyDecodePrimaryFailoverPrimaryGone(t *testing.T) {
	needPG(t, 16)
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			standbyPrimaryFailover(t, mode, sbFailoverOptions{restartGone: mode == "at-least-once"})
		})
	}
}

// TestStandbyDecodePrimaryFailoverRepointFirst: S1 is repointed to S2
// before S2's promotion (a cascading standby of S2 for a moment), the
// order that leaves no window in which S2 takes writes without S1's
// hot_standby_feedback: S2's physical slot for S1 holds S1's catalog_xmin
// before S2 is promoted, so S2 cannot vacuum catalog rows the slot on S1
// needs (rows_removed).
func TestStandbyDecodePrimaryFailoverRepointFirst(t *testing.T) {
	needPG(t, 16)
	standbyPrimaryFailover(t, "at-least-once", sbFailoverOptions{multiHost: true, repointFirst: true})
}

// sbFailoverOptions vary standbyPrimaryFailover.
type sbFailoverOptions struct {
	// multiHost: --primary-url names P and S2 with
	// target_session_attrs=read-write; else P alone.
	multiHost bool
	// repointFirst: S1 follows S2 before S2's promotion, not after.
	repointFirst bool
	// restartGone: without multiHost, the relay is started again with
	// --primary-url still naming the dead P, then repointed to S2.
	restartGone bool
}

// sbFailoverHeartbeat is the relay's heartbeat in these tests: a row
// noting the server and its WAL position, so that the test knows where a
// heartbeat written on the new primary is and can wait for the slot past
// it (pg_logical_emit_message leaves nothing to read back).
const sbFailoverHeartbeat = "INSERT INTO beats (port, lsn) SELECT inet_server_port(), pg_current_wal_insert_lsn()"

func standbyPrimaryFailover(t *testing.T, mode string, o sbFailoverOptions) {
	multiHost := o.multiHost
	began := time.Now()
	ctx := context.Background()
	rs := startReplicaSet(t, replicaSetOptions{})
	p, s1 := rs.primary, rs.standby
	s2, err := p.StartStandby(ctx, devcluster.StandbyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if rs.primary != s2 {
			s2.Close()
		}
	})
	// The writers' URL (and the env's) follows the primary from P to S2.
	rs.ports = []int{p.Port, s2.Port}
	e := rs.newEnv()
	e.exec("CREATE TABLE beats (port int NOT NULL, lsn pg_lsn NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())")
	rs.waitReplayed()
	if err := s2.WaitReplayed(ctx); err != nil {
		t.Fatal(err)
	}
	// S1's physical slot on S2, made while S2 is a standby: it keeps the
	// WAL S1 needs from S2's promotion on.
	execAt(t, ctx, s2.URL("postgres"), fmt.Sprintf("SELECT pg_create_physical_replication_slot('%s', true)", s1.Slot))

	s1URL := s1.URL(e.name)
	primaryURL := p.URL(e.name)
	if multiHost {
		primaryURL = e.url
	}
	addr := freeAddr(t)
	args := e.standbyArgs(s1URL, primaryURL, "--heartbeat-interval", "500ms", "--heartbeat-query", sbFailoverHeartbeat,
		"--metrics-addr", addr)
	c := e.consume()
	if mode == "exactly-once" {
		c = e.consumeWith(kgo.FetchIsolationLevel(kgo.ReadCommitted()))
		args = append(args, "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic())
	}
	relay := startProc(t, nil, args...)
	e.waitStandbySlotActive(relay, s1URL)
	metric := func(name string) float64 {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return -1
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return metricValue(string(b), name)
	}

	fw := e.startFailoverWriters(4, 5*time.Millisecond)
	defer fw.halt()
	waitMore := func(what string, more int) {
		t.Helper()
		n := len(distinctIDs(c.records()))
		e.waitFor(what, 2*time.Minute, func() (bool, error) {
			select {
			case <-relay.done:
				return false, fmt.Errorf("the relay exited: %s", finalLines(relay.out.String()))
			default:
			}
			got := len(distinctIDs(c.records()))
			return got >= n+more, fmt.Errorf("%d ids read", got)
		})
	}
	waitMore("records streamed from S1", 300)

	// P fails with S2 the standby that received the most, as a failover
	// manager picks it: S1 must not have replayed WAL S2 never got, or it
	// could not follow S2's timeline (and the relay would have published
	// transactions S2 lacks). P's walsender to S1 is frozen, S2 catches
	// up past what S1 received, then P dies.
	failStart := time.Now()
	sbFailoverFreezeS1(t, e, p, s1, s2)
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	// S1 follows S2: recovery_target_timeline = latest (the default)
	// takes S2's new timeline; 16+ applies primary_conninfo on reload.
	repoint := func() {
		t.Helper()
		execAt(t, ctx, s1.URL("postgres"),
			fmt.Sprintf("ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=%d user=postgres dbname=postgres application_name=%s'", s2.Port, s1.Slot),
			fmt.Sprintf("ALTER SYSTEM SET primary_slot_name = '%s'", s1.Slot),
			"SELECT pg_reload_conf()")
		s1.Upstream = s2
		if err := s1.WaitStreaming(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if o.repointFirst {
		repoint()
		// S1's feedback reached S2's slot for it before S2 takes writes.
		e.waitFor("S1's catalog_xmin on S2's physical slot for it", 30*time.Second, func() (bool, error) {
			var xmin *string
			err := sbQuery(e, s2.URL("postgres"), fmt.Sprintf("SELECT catalog_xmin::text FROM pg_replication_slots WHERE slot_name = '%s'", s1.Slot), &xmin)
			return err == nil && xmin != nil, fmt.Errorf("catalog_xmin %v (%v)", xmin, err)
		})
	}
	if err := s2.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	rs.primary = s2
	p.Close()
	if !o.repointFirst {
		repoint()
	}
	// S1's feedback holds the catalog rows its slot needs on S2 from now
	// on.
	e.waitFor("S1's catalog_xmin on S2", 30*time.Second, func() (bool, error) {
		var xmin *string
		err := sbQuery(e, s2.URL("postgres"), fmt.Sprintf("SELECT catalog_xmin::text FROM pg_replication_slots WHERE slot_name = '%s' AND active", s1.Slot), &xmin)
		return err == nil && xmin != nil, fmt.Errorf("catalog_xmin %v (%v)", xmin, err)
	})
	repointed := time.Since(failStart)
	waitMore("records written on S2, decoded on S1", 300)

	if multiHost {
		// A heartbeat on S2, the only server that takes writes now, and the
		// slot on S1 confirmed past it.
		var beat string
		e.waitFor("a heartbeat written on S2", time.Minute, func() (bool, error) {
			c, err := pgx.Connect(e.ctx, s2.URL(e.name))
			if err != nil {
				return false, err
			}
			defer c.Close(context.Background())
			err = c.QueryRow(e.ctx, "SELECT max(lsn)::text FROM beats WHERE port = $1", s2.Port).Scan(&beat)
			return err == nil, err
		})
		e.waitFor("the slot on S1 confirmed past a heartbeat written on S2", time.Minute, func() (bool, error) {
			i, err := e.standbySlot(s1URL)
			if err != nil {
				return false, err
			}
			return lsnAtLeast(i.ConfirmedLSN.String(), beat), fmt.Errorf("confirmed %s, heartbeat at %s", i.ConfirmedLSN, beat)
		})
		// Unreachable between P's death and S2's promotion, said once, and
		// back with S2.
		e.waitFor("walrelay_standby_primary_reachable 1 (the multi-host URL reaches S2)", time.Minute, func() (bool, error) {
			v := metric("walrelay_standby_primary_reachable")
			return v == 1, fmt.Errorf("walrelay_standby_primary_reachable = %v", v)
		})
		out := relay.out.String()
		if n := strings.Count(out, "is unreachable or takes no writes"); n > 1 {
			t.Errorf("%d lines say the primary is unreachable across one failover, want at most 1", n)
		} else if n == 1 && !strings.Contains(out, "is reachable again") {
			t.Errorf("the relay said the primary was unreachable, never that it is back:\n%s", finalLines(out))
		}
		// A start after the failover (kill -9, then the same flags): its
		// checks pair S1 with S2, reached through the same URL, and it
		// resumes from the slot on S1, now on S2's timeline.
		if err := relay.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		<-relay.done
		relay = startProc(t, nil, args...)
		e.waitStandbySlotActive(relay, s1URL)
		waitMore("records after a restart of the relay on S1 following S2", 200)
	} else {
		e.waitFor("walrelay_standby_primary_reachable 0", time.Minute, func() (bool, error) {
			v := metric("walrelay_standby_primary_reachable")
			return v == 0, fmt.Errorf("walrelay_standby_primary_reachable = %v", v)
		})
		// The relay still decodes what S1 replays.
		waitMore("records after the primary was found unreachable", 300)
		out := relay.out.String()
		var warns []string
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, "primary") && strings.Contains(l, "unreachable") && strings.Contains(l, `"level":"warn"`) {
				warns = append(warns, l)
			}
		}
		if len(warns) != 1 {
			t.Errorf("%d WARN lines say the primary is unreachable, want 1:\n%s", len(warns), strings.Join(warns, "\n"))
		} else {
			for _, w := range []string{"heartbeat", "record", "repoint --primary-url", "target_session_attrs=read-write"} {
				if !strings.Contains(warns[0], w) {
					t.Errorf("the warning does not say %q: %s", w, warns[0])
				}
			}
		}
		// Heartbeats and record writes fail every 500 ms and every poll:
		// not a line each.
		for _, loop := range []string{"heartbeat WAL nudge failed", "cannot move walrelay's record forward"} {
			if n := strings.Count(out, loop); n > 1 {
				t.Errorf("%d lines %q: a failure repeated every beat or poll, want at most one", n, loop)
			}
		}
		st, code := runOutput(t, "status", "--pg-url", s1URL, "--primary-url", primaryURL, "--slot", e.name, "--explain")
		for _, want := range []string{"primary_unreachable", "repoint --primary-url"} {
			if !strings.Contains(st, want) {
				t.Errorf("walrelay status --explain (exit %d) does not say %q:\n%s", code, want, st)
			}
		}
		// A start needs the primary (its checks, the record): it retries,
		// naming the fix, and gives up at --startup-timeout (exit 4).
		if o.restartGone {
			if err := relay.cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			<-relay.done
			relay = startProc(t, nil, withFlag(args, "--startup-timeout", "5s")...)
			code, elapsed, ok := relay.wait(time.Minute)
			out := finalLines(relay.out.String())
			if !ok || code != 4 || !strings.Contains(out, "repoint --primary-url") || !strings.Contains(out, "target_session_attrs=read-write") {
				t.Errorf("a start with --primary-url naming the dead primary: exit %d after %v (in time: %v), want 4 naming the fix (repoint --primary-url):\n%s", code, elapsed, ok, out)
			}
			relay = startProc(t, nil, withFlag(args, "--primary-url", s2.URL(e.name))...)
			e.waitStandbySlotActive(relay, s1URL)
			waitMore("records after the relay started with --primary-url repointed to S2", 200)
		}
	}

	fw.halt()
	committed := rs.waitCommittedRead(e, c)
	select {
	case <-relay.done:
		t.Fatalf("the relay exited: %s", finalLines(relay.out.String()))
	default:
	}
	recs := c.records()
	dups, phantoms, inv := checkSurvivingHistory(t, mode, committed, recs)
	t.Logf("decoding on S1 while P failed over to S2 (--primary-url multi-host: %v, S1 repointed before the promotion: %v), %s, PostgreSQL %d: %d committed, %d delivered, 0 lost, %d duplicates, %d delivered without committing, %d order inversions; kill to S1 streaming from S2 %s; test %s",
		multiHost, o.repointFirst, mode, pgVersion/10000, len(committed), len(distinctIDs(recs)), dups, phantoms, inv,
		repointed.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
}

// sbFailoverFreezeS1 stops (SIGSTOP) P's walsender to S1 and waits until
// S2 has received all that walsender sent and S1 received: S2 then holds
// every WAL record S1 can replay.
func sbFailoverFreezeS1(t *testing.T, e *env, p, s1, s2 *devcluster.Postgres) {
	t.Helper()
	pc, err := pgx.Connect(e.ctx, p.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close(context.Background())
	var pid int
	if err := pc.QueryRow(e.ctx, "SELECT pid FROM pg_stat_replication WHERE application_name = $1", s1.Slot).Scan(&pid); err != nil {
		t.Fatalf("P's walsender to S1: %v", err)
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// What the frozen walsender had sent (its sent_lsn, moved as it
	// queues data) and what S1 flushed once the wire is drained (stable
	// over a few polls) bound what S1 can replay; S2 must have both.
	var sent string
	if err := pc.QueryRow(e.ctx, "SELECT sent_lsn::text FROM pg_stat_replication WHERE pid = $1", pid).Scan(&sent); err != nil {
		t.Fatalf("P's walsender to S1: %v", err)
	}
	var s1Received string
	stable := 0
	e.waitFor("S1's receive position settled", 30*time.Second, func() (bool, error) {
		var got string
		if err := sbQuery(e, s1.URL("postgres"), "SELECT pg_last_wal_receive_lsn()::text", &got); err != nil {
			return false, err
		}
		if got == s1Received {
			stable++
		} else {
			s1Received, stable = got, 0
		}
		return stable >= 10, fmt.Errorf("S1 received %s", got)
	})
	e.waitFor("S2 past what P sent S1 and what S1 received", 30*time.Second, func() (bool, error) {
		var ok bool
		err := sbQuery(e, s2.URL("postgres"), fmt.Sprintf("SELECT pg_last_wal_receive_lsn() >= greatest('%s'::pg_lsn, '%s'::pg_lsn)", sent, s1Received), &ok)
		return err == nil && ok, fmt.Errorf("P sent S1 up to %s, S1 received %s (%v)", sent, s1Received, err)
	})
}

func sbQuery(e *env, url, sql string, dest ...any) error {
	ctx, cancel := context.WithTimeout(e.ctx, 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	return c.QueryRow(ctx, sql).Scan(dest...)
}

// lsnAtLeast compares two LSNs in PostgreSQL's text form.
func lsnAtLeast(a, b string) bool {
	var ah, al, bh, bl uint64
	if _, err := fmt.Sscanf(a, "%X/%X", &ah, &al); err != nil {
		return false
	}
	if _, err := fmt.Sscanf(b, "%X/%X", &bh, &bl); err != nil {
		return false
	}
	return ah<<32|al >= bh<<32|bl
}
