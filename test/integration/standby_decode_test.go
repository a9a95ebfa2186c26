package integration

// Decoding on a hot standby (PostgreSQL 16+, --primary-url): the relay's
// slot and replication connection are on the standby, its writes (the
// heartbeat, the publication, walrelay's record, pg_log_standby_snapshot
// while the slot is created) on the primary. Under load from writers on
// the primary: every committed row delivered while the relay streams from
// the standby, after the relay is killed and restarted (duplicates
// counted), and after the standby is promoted (the slot is local to it).
// Each preflight refusal of a bad standby and primary pair is one line
// naming the fix.

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/slot"
)

// standbyArgs are e.args() reading from the standby at standbyURL, with
// the primary at primaryURL.
func (e *env) standbyArgs(standbyURL, primaryURL string, extra ...string) []string {
	args := e.args()
	for i := range args {
		if args[i] == "--pg-url" {
			args[i+1] = standbyURL
		}
	}
	args = append(args, "--primary-url", primaryURL, "--slot-poll-interval", "1s")
	return append(args, extra...)
}

// standbySlot reads the slot on the server of url (the standby).
func (e *env) standbySlot(url string) (slot.Info, error) {
	ctx, cancel := context.WithTimeout(e.ctx, 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return slot.Info{}, err
	}
	defer c.Close(context.Background())
	return slot.ReadInfo(ctx, c, e.name)
}

// waitStandbySlotActive waits until p streams from the slot on the
// standby at url.
func (e *env) waitStandbySlotActive(p *proc, url string) {
	e.t.Helper()
	e.waitFor("slot active on the standby", 2*time.Minute, func() (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("walrelay exited: %v: %s", p.err, finalLines(p.out.String()))
		default:
		}
		i, err := e.standbySlot(url)
		return err == nil && i.Active, err
	})
}

func TestStandbyDecodeUnderLoad(t *testing.T) {
	needPG(t, 16)
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			rs := startReplicaSet(t, replicaSetOptions{})
			e := rs.newEnv()
			rs.waitReplayed() // the standby has the test's database
			standbyURL := rs.standby.URL(e.name)
			c := e.consume()
			args := e.standbyArgs(standbyURL, e.url, "--heartbeat-interval", "1s")
			if mode == "exactly-once" {
				c = e.consumeWith(kgo.FetchIsolationLevel(kgo.ReadCommitted()))
				args = append(args, "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic())
			}
			p := startProc(t, nil, args...)
			e.waitStandbySlotActive(p, standbyURL)
			if i, err := e.standbySlot(rs.primary.URL(e.name)); err == nil {
				t.Fatalf("the slot is on the primary too (%+v): it must be on the standby only", i)
			}

			fw := e.startFailoverWriters(4, 5*time.Millisecond)
			defer fw.halt()
			waitMore := func(what string, more int, p *proc) {
				t.Helper()
				n := len(distinctIDs(c.records()))
				e.waitFor(what, 2*time.Minute, func() (bool, error) {
					select {
					case <-p.done:
						return false, fmt.Errorf("the relay exited: %s", finalLines(p.out.String()))
					default:
					}
					got := len(distinctIDs(c.records()))
					return got >= n+more, fmt.Errorf("%d ids read", got)
				})
			}
			waitMore("records streamed from the standby", 300, p)
			// What a failover does is said of the slot decoded on the standby, not
			// of a stale copy of the primary's to drop.
			if out := p.out.String(); !strings.Contains(out, "the slot is this standby's own, decoded on it") || strings.Contains(out, "not a synchronized copy") {
				t.Errorf("the relay's failover line does not describe a slot decoded on the standby:\n%s", finalLines(out))
			}

			// The relay killed and started again: it resumes from the slot on the
			// standby.
			if err := p.cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			<-p.done
			p = startProc(t, nil, args...)
			e.waitStandbySlotActive(p, standbyURL)
			waitMore("records after the relay's restart", 300, p)

			// The standby promoted: the old primary is gone, the writers reach the
			// promoted server through the multi-host URL, and the slot, local to
			// it, goes on.
			oldStandby := rs.standby.Port
			rs.failover(nil)
			if rs.primary.Port != oldStandby {
				t.Fatalf("the promoted server is on port %d, want the standby's %d", rs.primary.Port, oldStandby)
			}
			waitMore("records after the standby's promotion", 300, p)
			// The relay notices the promotion at its next slot poll
			// (--slot-poll-interval), which the stream does not wait for:
			// on a quiet machine the records can come before the poll.
			e.waitFor("the relay's line saying the standby was promoted", time.Minute, func() (bool, error) {
				select {
				case <-p.done:
					return false, fmt.Errorf("the relay exited: %s", finalLines(p.out.String()))
				default:
				}
				return strings.Contains(p.out.String(), "the standby the relay decodes on was promoted"), fmt.Errorf("no line of the relay says the standby was promoted")
			})
			// And a start after the promotion, --primary-url still given, goes
			// on: the promoted server holds the slot.
			_ = p.cmd.Process.Kill()
			<-p.done
			p = startProc(t, nil, args...)
			e.waitStandbySlotActive(p, standbyURL)
			waitMore("records after a restart on the promoted standby", 100, p)

			fw.halt()
			committed := rs.waitCommittedRead(e, c)
			recs := c.records()
			dups, phantoms, inv := checkSurvivingHistory(t, mode, committed, recs)
			t.Logf("decoding on a standby, %s, PostgreSQL %d: %d committed, %d delivered, 0 lost, %d duplicates (1 relay kill -9, 1 promotion, 1 restart), %d delivered without committing, %d order inversions",
				mode, pgVersion/10000, len(committed), len(distinctIDs(recs)), dups, phantoms, inv)
		})
	}
}

// TestStandbyDecodeRefusals: each bad standby and primary pair is refused
// at start, in one line naming the fix, and leaves no slot behind.
func TestStandbyDecodeRefusals(t *testing.T) {
	needPG(t, 16)
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	rs.waitReplayed()
	standbyURL, primaryURL := rs.standby.URL(e.name), rs.primary.URL(e.name)
	otherSystem, err := devcluster.CreateDatabase(e.ctx, pgAdminURL, e.name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if c, err := pgx.Connect(context.Background(), pgAdminURL); err == nil {
			_, _ = c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{e.name}.Sanitize())
			c.Close(context.Background())
		}
	})
	set := func(url string, settings ...string) {
		t.Helper()
		execAt(t, e.ctx, url, append(settings, "SELECT pg_reload_conf()")...)
	}
	// showing waits until a reload took effect.
	showing := func(url, name, want string) {
		t.Helper()
		e.waitFor(name+" = "+want, 30*time.Second, func() (bool, error) {
			c, err := pgx.Connect(e.ctx, url)
			if err != nil {
				return false, err
			}
			defer c.Close(context.Background())
			var v string
			if err := c.QueryRow(e.ctx, "SELECT current_setting($1)", name).Scan(&v); err != nil {
				return false, err
			}
			return v == want, fmt.Errorf("%s = %q", name, v)
		})
	}
	cases := []struct {
		name   string
		args   []string
		before func()
		after  func()
		want   []string
	}{
		{name: "standby without --primary-url", args: nil, // e.args() on the standby
			want: []string{"is a hot standby", "--primary-url"}},
		{name: "--primary-url with a primary", args: e.standbyArgs(primaryURL, primaryURL),
			want: []string{"is not a hot standby", "leave --primary-url out"}},
		{name: "primary of another system", args: e.standbyArgs(standbyURL, otherSystem),
			want: []string{"not primary and standby of one cluster", "name the standby's own primary in --primary-url"}},
		{name: "primary URL names a standby", args: e.standbyArgs(standbyURL, standbyURL),
			want: []string{"is a hot standby too", "name the primary that accepts writes"}},
		{name: "hot_standby_feedback off", args: e.standbyArgs(standbyURL, primaryURL),
			before: func() {
				set(standbyURL, "ALTER SYSTEM SET hot_standby_feedback = off")
				showing(standbyURL, "hot_standby_feedback", "off")
			},
			after: func() {
				set(standbyURL, "ALTER SYSTEM RESET hot_standby_feedback")
				showing(standbyURL, "hot_standby_feedback", "on")
			},
			want: []string{"hot_standby_feedback is off", "rows_removed", "set hot_standby_feedback = on on the standby"}},
		{name: "no primary_slot_name", args: e.standbyArgs(standbyURL, primaryURL),
			before: func() {
				set(standbyURL, "ALTER SYSTEM SET primary_slot_name = ''")
				showing(standbyURL, "primary_slot_name", "")
			},
			after: func() {
				set(standbyURL, "ALTER SYSTEM RESET primary_slot_name")
				showing(standbyURL, "primary_slot_name", rs.standby.Slot)
			},
			want: []string{"primary_slot_name is empty", "pg_create_physical_replication_slot"}},
		// The standby names a slot its primary does not have: its wal
		// receiver fails (the slot does not exist) and it streams nothing,
		// nor would the primary hold its WAL and xmin if it did.
		{name: "primary_slot_name not on the primary", args: e.standbyArgs(standbyURL, primaryURL),
			before: func() {
				set(standbyURL, "ALTER SYSTEM SET primary_slot_name = 'walrelay_nowhere'")
				showing(standbyURL, "primary_slot_name", "walrelay_nowhere")
				// The wal receiver restarts on the change and fails on the
				// slot: until then it streams through the old one.
				e.waitFor("the standby not streaming", 30*time.Second, func() (bool, error) {
					c, err := pgx.Connect(e.ctx, standbyURL)
					if err != nil {
						return false, err
					}
					defer c.Close(context.Background())
					var status string
					err = c.QueryRow(e.ctx, "SELECT coalesce((SELECT status FROM pg_stat_wal_receiver), 'absent')").Scan(&status)
					return err == nil && status != "streaming", fmt.Errorf("wal receiver %s (%v)", status, err)
				})
			},
			after: func() {
				set(standbyURL, "ALTER SYSTEM RESET primary_slot_name")
				showing(standbyURL, "primary_slot_name", rs.standby.Slot)
				if err := rs.standby.WaitStreaming(e.ctx); err != nil {
					t.Fatal(err)
				}
			},
			want: []string{`primary_slot_name "walrelay_nowhere"`, "no physical slot on the primary", "SELECT pg_create_physical_replication_slot('walrelay_nowhere')"}},
		{name: "wal_level replica on the primary", args: e.standbyArgs(standbyURL, primaryURL),
			before: func() {
				set(primaryURL, "ALTER SYSTEM SET wal_level = replica")
				if err := rs.primary.Restart(e.ctx); err != nil {
					t.Fatal(err)
				}
			},
			after: func() {
				set(primaryURL, "ALTER SYSTEM RESET wal_level")
				if err := rs.primary.Restart(e.ctx); err != nil {
					t.Fatal(err)
				}
			},
			want: []string{`wal_level is "replica" on the primary`, "set wal_level = logical on the primary"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			args := tc.args
			if len(args) == 0 {
				args = e.args()
				for i := range args {
					if args[i] == "--pg-url" {
						args[i+1] = standbyURL
					}
				}
			}
			if tc.before != nil {
				tc.before()
			}
			if tc.after != nil {
				defer tc.after()
			}
			p := startProc(t, nil, args...)
			code, elapsed, ok := p.wait(60 * time.Second)
			if !ok {
				t.Fatalf("walrelay did not refuse within %v", elapsed)
			}
			out := finalLines(p.out.String())
			var line string
			for _, l := range strings.Split(out, "\n") {
				if strings.Contains(l, tc.want[0]) {
					line = l
				}
			}
			if line == "" || code == 0 {
				t.Fatalf("exit %d, no line saying %q:\n%s", code, tc.want[0], out)
			}
			for _, w := range tc.want[1:] {
				if !strings.Contains(line, w) {
					t.Errorf("the refusal does not say %q: %s", w, line)
				}
			}
			for _, url := range []string{standbyURL, primaryURL} {
				if _, err := e.standbySlot(url); err == nil {
					t.Errorf("a refused start left slot %s behind", e.name)
				}
			}
			t.Logf("refused in %v, exit %d: %s", elapsed.Round(time.Millisecond), code, line)
		})
	}

	// The standby does not stream from its primary now (its primary_conninfo
	// names a closed port), its physical slot there inactive: a warning,
	// not a refusal; it streams again once it reconnects.
	t.Run("physical slot inactive", func(t *testing.T) {
		set(standbyURL, fmt.Sprintf("ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=%d user=postgres'", closedPort(t)))
		defer func() {
			set(standbyURL, "ALTER SYSTEM RESET primary_conninfo")
			if err := rs.standby.WaitStreaming(e.ctx); err != nil {
				t.Fatal(err)
			}
		}()
		e.waitFor("the standby's physical slot inactive on the primary", 30*time.Second, func() (bool, error) {
			var active bool
			err := queryAt(e.ctx, primaryURL, "SELECT active FROM pg_replication_slots WHERE slot_name = $1", []any{rs.standby.Slot}, &active)
			return err == nil && !active, fmt.Errorf("active %v (%v)", active, err)
		})
		p := startProc(t, nil, e.standbyArgs(standbyURL, primaryURL)...)
		defer func() {
			_ = p.cmd.Process.Kill()
			<-p.done
		}()
		want := "the standby does not stream from the primary now: its physical slot there is inactive"
		e.waitFor("the warning", 30*time.Second, func() (bool, error) {
			select {
			case <-p.done:
				return false, fmt.Errorf("walrelay exited: %s", finalLines(p.out.String()))
			default:
			}
			return strings.Contains(p.out.String(), want), fmt.Errorf("no line saying %q", want)
		})
	})
}

// TestStandbyDecodeReplayPaused: with replay paused on the standby,
// commits on the primary do not reach the relay; the replay metrics, walrelay
// status and --explain say why, and resuming replay delivers them.
func TestStandbyDecodeReplayPaused(t *testing.T) {
	needPG(t, 16)
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	rs.waitReplayed()
	standbyURL := rs.standby.URL(e.name)
	cfg := e.config()
	cfg.PGURL, cfg.PrimaryURL = standbyURL, e.url
	cfg.SlotPollInterval = 200 * time.Millisecond
	c := e.consume()
	h := e.watchHolds()
	rr, reg := e.startRelayGathered(cfg)
	h.of(rr, reg)
	// The relay's /status, as `walrelay run --metrics-addr` serves it.
	relaySrv := httptest.NewServer(holds.StatusHandler(rr.relay.Status))
	defer relaySrv.Close()
	insert := func(n int) []string {
		t.Helper()
		rows, err := e.conn().Query(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
			SELECT 'order', 'o' || g, 'created', '{}' FROM generate_series(1, $1) g RETURNING id::text`, n)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	c.waitAll(insert(5), time.Minute)

	sc, err := pgx.Connect(e.ctx, standbyURL)
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close(context.Background())
	if _, err := sc.Exec(e.ctx, "SELECT pg_wal_replay_pause()"); err != nil {
		t.Fatal(err)
	}
	held := insert(5)
	e.waitFor("the replay-paused metric", time.Minute, func() (bool, error) {
		m := gathered(reg, "walrelay_standby_replay_paused")
		return m[""] == 1, fmt.Errorf("walrelay_standby_replay_paused %v", m)
	})
	e.waitFor("the replay lag metric", time.Minute, func() (bool, error) {
		m := gathered(reg, "walrelay_standby_replay_lag_bytes")
		return m[""] > 0, fmt.Errorf("walrelay_standby_replay_lag_bytes %v", m)
	})
	if got := missingIDs(c, held); len(got) != len(held) {
		t.Errorf("%d of %d rows committed while replay was paused reached Kafka", len(held)-len(got), len(held))
	}
	// Every signal names the paused replay: readiness, the hold's gauge
	// and WARN, and status, whose exit says unhealthy.
	h.held(holds.StandbyReplay, "Paused", time.Minute)
	out, code := runOutput(t, "status", "--pg-url", standbyURL, "--slot", e.name, "--explain", "--relay-url", relaySrv.URL)
	for _, want := range []string{"standby_replay", "PAUSED", "standby_replay_paused", "pg_wal_replay_resume()",
		"delivery held by standby_replay (Paused", "delivery_held"} {
		if !strings.Contains(out, want) {
			t.Errorf("walrelay status --explain (exit %d) does not say %q:\n%s", code, want, out)
		}
	}
	if code != 1 {
		t.Errorf("walrelay status exited %d with replay paused, want 1 (unhealthy):\n%s", code, out)
	}
	if _, err := sc.Exec(e.ctx, "SELECT pg_wal_replay_resume()"); err != nil {
		t.Fatal(err)
	}
	c.waitAll(held, time.Minute)
	h.released(holds.StandbyReplay, time.Minute)
	e.waitFor("the replay-paused metric cleared", time.Minute, func() (bool, error) {
		m := gathered(reg, "walrelay_standby_replay_paused")
		return m[""] == 0, fmt.Errorf("walrelay_standby_replay_paused %v", m)
	})
}

// TestStandbyDecodeWalLevelLowered: the primary restarted with wal_level =
// replica invalidates the slot on the standby (wal_level_insufficient, a
// conflict with recovery); the relay stops, naming it and the setting that
// prevents it.
func TestStandbyDecodeWalLevelLowered(t *testing.T) {
	needPG(t, 16)
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	rs.waitReplayed()
	standbyURL := rs.standby.URL(e.name)
	p := startProc(t, nil, e.standbyArgs(standbyURL, e.url)...)
	e.waitStandbySlotActive(p, standbyURL)
	pc, err := pgx.Connect(e.ctx, rs.primary.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = pc.Exec(e.ctx, "ALTER SYSTEM SET wal_level = replica")
	pc.Close(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.primary.Restart(e.ctx); err != nil {
		t.Fatal(err)
	}
	code, elapsed, ok := p.wait(2 * time.Minute)
	if !ok {
		i, err := e.standbySlot(standbyURL)
		t.Fatalf("the relay did not stop within %v after wal_level was lowered; slot %+v (%v)", elapsed, i, err)
	}
	out := finalLines(p.out.String())
	want := "wal_level_insufficient"
	if pgVersion < 170000 {
		want = "rows_removed or wal_level_insufficient"
	}
	// The primary's restart also ends the relay's connections: the start
	// that follows may refuse in its preflight, reading wal_level on the
	// primary, before the standby replays the change and invalidates the
	// slot. Either refusal names wal_level and the fix.
	invalidated := strings.Contains(out, want) && strings.Contains(out, "keep wal_level = logical on the primary")
	preflight := strings.Contains(out, `wal_level is "replica" on the primary`) && strings.Contains(out, "set wal_level = logical on the primary")
	if code != 2 || !invalidated && !preflight {
		t.Errorf("the relay's refusal (exit %d) names neither the slot invalidated (%q) nor the primary's wal_level, with the fix:\n%s", code, want, out)
	}
	t.Logf("stopped %v after the primary's restart, exit %d", elapsed.Round(time.Millisecond), code)
}

// TestStandbyDecodeSetupAndDrop: walrelay setup with --primary-url
// creates the slot on the standby and the publication and record on the
// primary; status reads the slot there; drop removes all three.
func TestStandbyDecodeSetupAndDrop(t *testing.T) {
	needPG(t, 16)
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	rs.waitReplayed()
	standbyURL, primaryURL := rs.standby.URL(e.name), rs.primary.URL(e.name)
	base := []string{"--pg-url", standbyURL, "--primary-url", primaryURL, "--slot", e.name}
	out, code := runOutput(t, append([]string{"setup", "--publication", e.name}, base...)...)
	if code != 0 || !strings.Contains(out, "ready: publication") {
		t.Fatalf("setup exit %d:\n%s", code, out)
	}
	if _, err := e.standbySlot(standbyURL); err != nil {
		t.Errorf("no slot on the standby after setup: %v", err)
	}
	if _, err := e.standbySlot(primaryURL); err == nil {
		t.Errorf("setup made the slot on the primary")
	}
	countOn := func(url, sql string) int {
		t.Helper()
		c, err := pgx.Connect(e.ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(context.Background())
		var n int
		if err := c.QueryRow(e.ctx, sql, e.name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := countOn(primaryURL, "SELECT count(*) FROM walrelay.slots WHERE slot_name = $1"); n != 1 {
		t.Errorf("%d records of the slot on the primary, want 1", n)
	}
	out, code = runOutput(t, append([]string{"status"}, base...)...)
	if !strings.Contains(out, "standby_replay") {
		t.Errorf("status (exit %d) shows no standby_replay row:\n%s", code, out)
	}
	// No relay streams from it, and the slot is still the standby's own,
	// not a stale copy of the primary's to drop.
	if !strings.Contains(out, "the slot is this standby's own") || strings.Contains(out, "pg_drop_replication_slot") {
		t.Errorf("status describes the slot decoded on the standby as something else:\n%s", out)
	}
	// walrelay snapshot reads the rows on the standby.
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'order', 'k', 'T', '{}', s FROM generate_series(1, 10) s`)
	rs.waitReplayed()
	c := e.consume()
	out, code, _, exited := runBounded(t, time.Minute, nil, "snapshot", "--pg-url", standbyURL, "--brokers", strings.Join(e.brokers, ","), "--table", "public.outbox",
		"--topic-template", e.topicPrefix()+"{aggregate_type}", "--dead-letter-topic", e.topicPrefix()+"dlq", "--linger", "1ms")
	if !exited || code != 0 {
		t.Fatalf("walrelay snapshot on the standby: exit %d (exited %v):\n%s", code, exited, lastLines(out, 5))
	}
	c.waitIDs(10, time.Minute)

	out, code = runOutput(t, append([]string{"drop", "--publication", e.name, "--drop-publication", "--force"}, base...)...)
	if code != 0 {
		t.Fatalf("drop exit %d:\n%s", code, out)
	}
	if _, err := e.standbySlot(standbyURL); err == nil {
		t.Errorf("the slot is still on the standby after drop")
	}
	if n := countOn(primaryURL, "SELECT count(*) FROM walrelay.slots WHERE slot_name = $1"); n != 0 {
		t.Errorf("%d records of the slot left on the primary after drop", n)
	}
	if n := countOn(primaryURL, "SELECT count(*) FROM pg_publication WHERE pubname = $1"); n != 0 {
		t.Errorf("the publication is still on the primary after drop")
	}
}

// TestStandbyDecodeRowsRemoved: hot_standby_feedback turned off under a
// running relay lets the primary vacuum catalog rows the standby's slot
// needs; PostgreSQL invalidates the slot (rows_removed, a conflict with
// recovery) and the relay stops naming it and the setting that prevents
// it.
func TestStandbyDecodeRowsRemoved(t *testing.T) {
	needPG(t, 16)
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	rs.waitReplayed()
	standbyURL := rs.standby.URL(e.name)
	p := startProc(t, nil, e.standbyArgs(standbyURL, e.url)...)
	e.waitStandbySlotActive(p, standbyURL)
	exec := func(url string, sqls ...string) {
		t.Helper()
		execAt(t, e.ctx, url, sqls...)
	}
	exec(rs.standby.URL("postgres"), "ALTER SYSTEM SET hot_standby_feedback = off", "SELECT pg_reload_conf()")
	// The primary forgets the standby's xmin once the standby says so.
	e.waitFor("the standby's physical slot without xmin on the primary", time.Minute, func() (bool, error) {
		c, err := pgx.Connect(e.ctx, rs.primary.URL("postgres"))
		if err != nil {
			return false, err
		}
		defer c.Close(context.Background())
		var xmin, catalogXmin *string
		err = c.QueryRow(e.ctx, "SELECT xmin::text, catalog_xmin::text FROM pg_replication_slots WHERE slot_name = $1", rs.standby.Slot).Scan(&xmin, &catalogXmin)
		return err == nil && xmin == nil && catalogXmin == nil, fmt.Errorf("xmin %v, catalog_xmin %v (%v)", xmin, catalogXmin, err)
	})
	e.waitFor("the relay stops on rows_removed", 2*time.Minute, func() (bool, error) {
		select {
		case <-p.done:
			return true, nil
		default:
		}
		// Catalog rows dead before the slot's catalog_xmin, vacuumed.
		exec(e.url, "CREATE TABLE rows_removed_probe (x int)", "DROP TABLE rows_removed_probe", "VACUUM pg_class")
		return false, fmt.Errorf("the relay still runs")
	})
	out := finalLines(p.out.String())
	want := "rows_removed"
	if pgVersion < 170000 {
		want = "rows_removed or wal_level_insufficient"
	}
	for _, w := range []string{want, "hot_standby_feedback = on"} {
		if !strings.Contains(out, w) {
			t.Errorf("the relay's refusal does not say %q:\n%s", w, out)
		}
	}
}

// TestStandbyDecodeHeartbeat: on a quiet outbox the heartbeat, written on
// the primary, reaches the standby's decoding through replay and moves the
// slot on the standby past the primary's WAL: it pins no WAL there nor,
// through hot_standby_feedback, on the primary.
func TestStandbyDecodeHeartbeat(t *testing.T) {
	needPG(t, 16)
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	rs.waitReplayed()
	standbyURL := rs.standby.URL(e.name)
	cfg := e.config()
	cfg.PGURL, cfg.PrimaryURL = standbyURL, e.url
	cfg.HeartbeatInterval = 200 * time.Millisecond
	_, reg := e.startRelayGathered(cfg)
	// Traffic outside the outbox moves the primary's WAL past the slot.
	e.exec("CREATE TABLE noise (x int)")
	e.exec("INSERT INTO noise SELECT generate_series(1, 1000)")
	target := e.currentLSN(e.conn())
	e.waitFor("the standby's slot confirmed past the primary's WAL", time.Minute, func() (bool, error) {
		i, err := e.standbySlot(standbyURL)
		if err != nil {
			return false, err
		}
		// Keepalives may confirm past the target before the first
		// heartbeat is counted: both are waited for.
		beats := gathered(reg, "walrelay_heartbeats_total")
		return i.ConfirmedLSN >= target && beats["wal"] >= 1, fmt.Errorf("confirmed %s, target %s, heartbeats %v", i.ConfirmedLSN, target, beats)
	})
}

// execAt runs sqls one by one on a connection of its own to url (a server
// other than the env's, or a database other than its own).
func execAt(t *testing.T, ctx context.Context, url string, sqls ...string) {
	t.Helper()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	for _, q := range sqls {
		if _, err := c.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
}

// TestStandbyDecodeStandbyRestarted: writers on the primary, the relay
// streaming from the standby; the standby is restarted under load (fast
// stop and start), then crashes (every process SIGKILLed) and starts
// again. The relay reconnects by itself each time; every committed row
// is delivered, duplicates counted (the crashed standby's slot resumes
// from what it had saved, at or before what the relay confirmed), in
// both delivery modes.
func TestStandbyDecodeStandbyRestarted(t *testing.T) {
	needPG(t, 16)
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) { standbyRestarted(t, mode) })
	}
}

func standbyRestarted(t *testing.T, mode string) {
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	rs.waitReplayed()
	standbyURL := rs.standby.URL(e.name)
	c := e.consume()
	args := e.standbyArgs(standbyURL, e.url, "--heartbeat-interval", "1s")
	if mode == "exactly-once" {
		c = e.consumeWith(kgo.FetchIsolationLevel(kgo.ReadCommitted()))
		args = append(args, "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic())
	}
	p := startProc(t, nil, args...)
	e.waitStandbySlotActive(p, standbyURL)
	fw := e.startFailoverWriters(4, 5*time.Millisecond)
	defer fw.halt()
	waitMore := func(what string, more int) {
		t.Helper()
		n := len(distinctIDs(c.records()))
		e.waitFor(what, 2*time.Minute, func() (bool, error) {
			select {
			case <-p.done:
				return false, fmt.Errorf("the relay exited: %s", finalLines(p.out.String()))
			default:
			}
			got := len(distinctIDs(c.records()))
			return got >= n+more, fmt.Errorf("%d ids read", got)
		})
	}
	waitMore("records streamed from the standby", 300)

	if err := rs.standby.Restart(e.ctx); err != nil {
		t.Fatal(err)
	}
	e.waitStandbySlotActive(p, standbyURL)
	waitMore("records after the standby's restart", 300)

	if err := rs.standby.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := rs.standby.Start(e.ctx); err != nil {
		t.Fatal(err)
	}
	e.waitStandbySlotActive(p, standbyURL)
	waitMore("records after the standby's crash", 300)

	fw.halt()
	committed := rs.waitCommittedRead(e, c)
	select {
	case <-p.done:
		t.Fatalf("the relay exited: %s", finalLines(p.out.String()))
	default:
	}
	recs := c.records()
	dups, phantoms, inv := checkSurvivingHistory(t, mode, committed, recs)
	t.Logf("decoding on a standby restarted then crashed, %s, PostgreSQL %d: %d committed, %d delivered, 0 lost, %d duplicates, %d delivered without committing, %d order inversions",
		mode, pgVersion/10000, len(committed), len(distinctIDs(recs)), dups, phantoms, inv)
}

// TestStandbyDecodeStandbyRebuilt: the standby is lost and rebuilt from a
// fresh base backup of the primary, on the same port, so the relay's
// logical slot, which lived on the standby only, is gone. Never a new slot
// created silently, which would skip what the old one had not confirmed:
// with the relay stopped during the rebuild, its next start refuses
// (walrelay's record, on the primary, says it streamed from that slot);
// with the relay running, it stops, and its next start repeats the
// refusal. Each names the slot and --accept-gap, exit 2.
func TestStandbyDecodeStandbyRebuilt(t *testing.T) {
	needPG(t, 16)
	for _, tc := range []struct {
		name    string
		running bool
		want    string
		cause   string // the standby named as what lost the slot
	}{
		{name: "relay stopped", want: "is gone, though walrelay streamed from it", cause: "rebuilding the standby from a new base backup, or losing it, loses the slot"},
		{name: "relay running", running: true, want: "was dropped while walrelay streamed from it", cause: "rebuilding or losing the standby loses its slot"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs := startReplicaSet(t, replicaSetOptions{})
			e := rs.newEnv()
			rs.waitReplayed()
			standbyURL, primaryURL := rs.standby.URL(e.name), rs.primary.URL(e.name)
			c := e.consume()
			args := e.standbyArgs(standbyURL, e.url)
			p := startProc(t, nil, args...)
			e.waitStandbySlotActive(p, standbyURL)
			conn := e.conn()
			before := e.insertRows(conn, 20, "before")
			c.waitAll(before, 60*time.Second)
			if !tc.running {
				if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
				if code, _, ok := p.wait(time.Minute); !ok || code != 0 {
					t.Fatalf("the relay stopped by SIGTERM: exit %d (in time: %v)", code, ok)
				}
			}

			// The standby's machine lost: it is rebuilt from scratch on its
			// port, its physical slot on the primary made anew.
			old := rs.standby
			if err := old.Kill(); err != nil {
				t.Fatal(err)
			}
			old.Close()
			execAt(t, e.ctx, rs.primary.URL("postgres"), fmt.Sprintf("SELECT pg_drop_replication_slot('%s')", old.Slot))
			e.insertRows(conn, 20, "during")
			rs.standby = rs.startStandby(old.Port)
			rs.waitReplayed()

			slotNamed := fmt.Sprintf("replication slot %q", e.name)
			if tc.running {
				code, elapsed, ok := p.wait(2 * time.Minute)
				if !ok {
					t.Fatalf("the relay still streams %v after its standby was rebuilt without its slot", elapsed)
				}
				out := finalLines(p.out.String())
				if code != 2 || !strings.Contains(out, slotNamed+" "+tc.want) || !strings.Contains(out, tc.cause) || !strings.Contains(out, "--accept-gap") {
					t.Errorf("the running relay exited %d, want 2 saying %s %s, %q and --accept-gap:\n%s", code, slotNamed, tc.want, tc.cause, out)
				}
				t.Logf("the running relay exited %d after %v: %s", code, elapsed.Round(time.Millisecond), out)
			}
			refusedWith(t, withFlag(args, "--startup-timeout", "20s"), slotNamed+" "+tc.want, tc.cause, "may be missing", "--accept-gap")
			for _, url := range []string{standbyURL, primaryURL} {
				if i, err := e.standbySlot(url); err == nil {
					t.Errorf("slot %s was created again on %s: %+v", e.name, url, i)
				}
			}
		})
	}
}

// waitCommittedRead waits until c has read every id the writers committed
// (on the current primary) and returns those ids; the replication state is
// in the failure.
func (rs *replicaSet) waitCommittedRead(e *env, c *consumer) map[string]bool {
	rs.t.Helper()
	committed := e.committedIDs()
	var all []string
	for id := range committed {
		all = append(all, id)
	}
	err := devcluster.WaitFor(2*time.Minute, 500*time.Millisecond, func() (bool, error) {
		m := missingIDs(c, all)
		return len(m) == 0, fmt.Errorf("%d of %d committed ids not read", len(m), len(all))
	})
	if err != nil {
		rs.t.Fatalf("%v; %s", err, rs.replicationState(e.name))
	}
	return committed
}
