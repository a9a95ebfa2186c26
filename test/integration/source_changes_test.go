package integration

// Tests of the database changing under the relay: a publication altered or
// dropped, an outbox table taken out of it or dropped and created again,
// while the relay streams and while it is stopped. Each ends with every
// committed id delivered, or a refusal that names the gap and a relay that
// goes on once the operator accepts it; never a silent skip, never a
// retry loop.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// insertRows commits n outbox rows, one transaction each, and returns
// their ids.
func (e *env) insertRows(conn *pgx.Conn, n int, tag string) []string {
	e.t.Helper()
	ids := make([]string, 0, n)
	for i := 0; i < n; i++ {
		var id string
		err := conn.QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
			VALUES ('order', $1, 'Created', '{}', $2) RETURNING id::text`, fmt.Sprintf("%s-%d", tag, i%7), i).Scan(&id)
		if err != nil {
			e.t.Fatal(err)
		}
		ids = append(ids, id)
	}
	return ids
}

// waitRefused waits until the relay's Run returned a *slot.GapError whose
// text has every want, and returns it.
func (e *env) waitRefused(rr *running, timeout time.Duration, want ...string) *slot.GapError {
	e.t.Helper()
	var gap *slot.GapError
	e.waitFor("the relay to refuse to go on", timeout, func() (bool, error) {
		done, err := rr.returned()
		if !done {
			return false, errors.New("still running")
		}
		if !errors.As(err, &gap) {
			return false, fmt.Errorf("Run returned %v, want a gap refusal", err)
		}
		return true, nil
	})
	for _, w := range want {
		if !strings.Contains(gap.Error(), w) {
			e.t.Errorf("the refusal lacks %q: %s", w, gap)
		}
	}
	e.t.Logf("refused: %s", gap)
	return gap
}

// missingIDs are the ids of want that the consumer has not read.
func missingIDs(c *consumer, want []string) []string {
	got := distinctIDs(c.records())
	var missing []string
	for _, id := range want {
		if got[id] == 0 {
			missing = append(missing, id)
		}
	}
	return missing
}

// pubSQL puts the test's publication, quoted, where q has %[1]s.
func (e *env) pubSQL(q string) string {
	return strings.ReplaceAll(q, "%[1]s", pgx.Identifier{e.name}.Sanitize())
}

// walLSN is the server's WAL write position.
func (e *env) walLSN(conn *pgx.Conn) decoder.LSN {
	e.t.Helper()
	var l decoder.LSN
	if err := conn.QueryRow(e.ctx, "SELECT pg_current_wal_lsn()::text").Scan(&l); err != nil {
		e.t.Fatal(err)
	}
	return l
}

// sourceChange is one way the database changes under a running relay.
type sourceChange struct {
	name string
	// change alters the database; restore undoes it as far as it can be
	// undone (the rows committed meanwhile stay unpublished by the stream).
	change, restore []string
	// refusal are substrings of the relay's refusal.
	refusal []string
}

var runningChanges = []sourceChange{
	{
		name:    "publish changed to update",
		change:  []string{`ALTER PUBLICATION %[1]s SET (publish = 'update')`},
		restore: []string{`ALTER PUBLICATION %[1]s SET (publish = 'insert')`},
		refusal: []string{"stopped publishing inserts"},
	},
	{
		name:    "outbox dropped from the publication",
		change:  []string{`ALTER PUBLICATION %[1]s DROP TABLE outbox`},
		restore: []string{`ALTER PUBLICATION %[1]s ADD TABLE outbox`},
		refusal: []string{"outbox table public.outbox was removed from publication"},
	},
	{
		name:    "publication dropped",
		change:  []string{`DROP PUBLICATION %[1]s`},
		refusal: []string{"was dropped while walrelay streamed from it"},
	},
	{
		name: "outbox dropped and created again",
		change: []string{`DROP TABLE outbox`, `CREATE TABLE outbox (
			id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type text, aggregate_id text, type text, payload jsonb, seq bigint)`},
		refusal: []string{"outbox table public.outbox was dropped"},
	},
}

// TestSourceChangesWhileRunning changes the publication or the outbox table
// under a streaming relay, commits rows, and checks the relay stops with a
// refusal naming the change before the slot is confirmed past the change;
// that a restart refuses too, even once the change is undone; and that
// after walrelay setup --accept-gap and walrelay snapshot every row still
// in the outbox arrives, and rows committed after the relay goes on
// stream.
func TestSourceChangesWhileRunning(t *testing.T) {
	for _, sc := range runningChanges {
		t.Run(sc.name, func(t *testing.T) {
			e := newEnv(t)
			c := e.consume()
			conn := e.conn()
			rr, reg := e.startRelayGathered(e.config())
			before := e.insertRows(conn, 20, "before")
			c.waitIDs(len(before), 30*time.Second)

			changedAt := e.walLSN(conn)
			for _, q := range sc.change {
				e.exec(e.pubSQL(q))
			}
			during := e.insertRows(conn, 100, "during")
			gap := e.waitRefused(rr, 60*time.Second, append(sc.refusal, "--accept-gap", "may be missing")...)
			if got := gathered(reg, "walrelay_gap_refusals_total")[""]; got != 1 {
				t.Errorf("walrelay_gap_refusals_total = %v, want 1", got)
			}
			if restarts := gathered(reg, "walrelay_stream_restarts_total"); len(restarts) > 0 {
				t.Errorf("the relay restarted the stream on the change (%v): it must stop at once", restarts)
			}
			if gap.Since > changedAt {
				t.Errorf("the refusal names %s as the last position published, past the change at %s", gap.Since, changedAt)
			}
			if info, err := e.slotInfoErr(); err != nil {
				t.Fatal(err)
			} else if info.ConfirmedLSN > changedAt {
				t.Errorf("the slot is confirmed at %s, past the change at %s: the WAL of the rows it skipped is no longer held", info.ConfirmedLSN, changedAt)
			}
			if m := missingIDs(c, before); len(m) > 0 {
				t.Errorf("%d rows committed before the change were not published", len(m))
			}

			// Undone or not, the next start refuses until the gap is
			// accepted.
			for _, q := range sc.restore {
				e.exec(e.pubSQL(q))
			}
			refusedWith(t, withFlag(e.args(), "--startup-timeout", "5s"), append(sc.refusal, "--accept-gap")...)
			out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--accept-gap")
			if code != 0 {
				t.Fatalf("setup --accept-gap exit %d:\n%s", code, out)
			}
			if !strings.Contains(out, "accepting a gap") {
				t.Errorf("setup --accept-gap does not log the gap it accepts:\n%s", out)
			}
			e.startRelay(e.config())
			after := e.insertRows(conn, 20, "after")
			c.waitAll(after, 60*time.Second)
			// The rows of the gap still in the outbox: walrelay snapshot.
			args := []string{"snapshot", "--pg-url", e.url, "--brokers", strings.Join(e.brokers, ","), "--table", "public.outbox",
				"--topic-template", e.topicPrefix() + "{aggregate_type}", "--dead-letter-topic", e.topicPrefix() + "dlq", "--log-level", "warn"}
			if out, code, _, _ := runBounded(t, time.Minute, nil, args...); code != 0 {
				t.Fatalf("snapshot exit %d:\n%s", code, out)
			}
			var still []string
			if err := conn.QueryRow(e.ctx, `SELECT coalesce(array_agg(id::text), '{}') FROM outbox`).Scan(&still); err != nil {
				t.Fatal(err)
			}
			c.waitAll(still, time.Minute)
			lost := 0
			for _, id := range during {
				if distinctIDs(c.records())[id] == 0 {
					lost++
				}
			}
			t.Logf("%s: %d rows before, %d during (%d not published: the accepted gap, gone from the outbox), %d after",
				sc.name, len(before), len(during), lost, len(after))
		})
	}
}

// TestSourceChangesWhileStopped changes the publication or the outbox
// table while no relay runs: the next start refuses with the change named
// and creates nothing (no publication, no table membership), where before
// it recreated them and skipped the rows in between.
func TestSourceChangesWhileStopped(t *testing.T) {
	cases := []struct {
		name    string
		change  []string
		refusal []string
		check   func(t *testing.T, e *env)
		// restore runs after the refusal: it must still refuse once.
		restore []string
	}{
		{
			name:    "publication dropped",
			change:  []string{`DROP PUBLICATION %[1]s`},
			refusal: []string{"publication", "was dropped after walrelay streamed from it"},
			check: func(t *testing.T, e *env) {
				var n int
				if err := e.conn().QueryRow(e.ctx, `SELECT count(*) FROM pg_publication WHERE pubname = $1`, e.name).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n != 0 {
					t.Error("the refusing start created the publication again")
				}
			},
		},
		{
			name:    "publication dropped and created again",
			change:  []string{`DROP PUBLICATION %[1]s`, `CREATE PUBLICATION %[1]s FOR TABLE outbox WITH (publish = 'insert')`},
			refusal: []string{"was dropped and created again"},
		},
		{
			name:    "outbox removed from the publication",
			change:  []string{`ALTER PUBLICATION %[1]s DROP TABLE outbox`},
			refusal: []string{"outbox table public.outbox was removed from publication"},
			check: func(t *testing.T, e *env) {
				if got := e.publishedTables(); len(got) != 0 {
					t.Errorf("the refusing start added the table back: the publication publishes %v", got)
				}
			},
		},
		{
			name:    "outbox removed and added again",
			change:  []string{`ALTER PUBLICATION %[1]s DROP TABLE outbox`, `ALTER PUBLICATION %[1]s ADD TABLE outbox`},
			refusal: []string{"was removed from publication", "and added again"},
		},
		{
			name: "outbox dropped and created again",
			change: []string{`DROP TABLE outbox`, `CREATE TABLE outbox (
				id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type text, aggregate_id text, type text, payload jsonb, seq bigint)`},
			refusal: []string{"outbox table public.outbox was dropped and created again"},
		},
		{
			name:    "publish changed to update",
			change:  []string{`ALTER PUBLICATION %[1]s SET (publish = 'update')`},
			refusal: []string{"no longer publishes inserts", "SET (publish = 'insert')"},
			restore: []string{`ALTER PUBLICATION %[1]s SET (publish = 'insert')`},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			c := e.consume()
			conn := e.conn()
			rr := e.startRelay(e.config())
			before := e.insertRows(conn, 10, "before")
			c.waitIDs(len(before), 30*time.Second)
			if err := rr.stop(t); err != nil {
				t.Fatal(err)
			}
			for _, q := range tc.change {
				e.exec(e.pubSQL(q))
			}
			e.insertRows(conn, 10, "during")
			refusedWith(t, withFlag(e.args(), "--startup-timeout", "5s"), append(tc.refusal, "may be missing", "--accept-gap")...)
			if tc.check != nil {
				tc.check(t, e)
			}
			if tc.restore != nil {
				for _, q := range tc.restore {
					e.exec(e.pubSQL(q))
				}
				refusedWith(t, withFlag(e.args(), "--startup-timeout", "5s"), append(tc.refusal[:1], "--accept-gap")...)
			}
			out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--accept-gap")
			if code != 0 {
				t.Fatalf("setup --accept-gap exit %d:\n%s", code, out)
			}
			e.startRelay(e.config())
			after := e.insertRows(conn, 10, "after")
			c.waitAll(after, 60*time.Second)
		})
	}
}

// TestSlotDroppedWhileStoppedIsNotRecreated: a slot walrelay streamed from
// that is gone at the next start (as after a failover to a standby that
// did not have it) is refused, not created again at the current position;
// walrelay drop of it and walrelay setup --accept-gap are the way on.
func TestSlotDroppedWhileStoppedIsNotRecreated(t *testing.T) {
	e := newEnv(t)
	c := e.consume()
	conn := e.conn()
	rr := e.startRelay(e.config())
	before := e.insertRows(conn, 5, "before")
	c.waitIDs(len(before), 30*time.Second)
	if err := rr.stop(t); err != nil {
		t.Fatal(err)
	}
	e.exec(`SELECT pg_drop_replication_slot($1)`, e.name)
	e.insertRows(conn, 5, "during")
	refusedWith(t, withFlag(e.args(), "--startup-timeout", "5s"), "replication slot", "is gone, though walrelay streamed from it", "may be missing", "--accept-gap", "failover slot")
	if _, err := e.slotInfoErr(); err == nil {
		t.Fatal("the refusing start created the slot again")
	}
	out, code := runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
	if code != 2 || !strings.Contains(out, "--accept-gap") {
		t.Errorf("status of the lost slot: exit %d, want 2 naming --accept-gap:\n%s", code, out)
	}
	out, code = runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--accept-gap")
	if code != 0 {
		t.Fatalf("setup --accept-gap exit %d:\n%s", code, out)
	}
	e.startRelay(e.config())
	after := e.insertRows(conn, 5, "after")
	c.waitAll(after, 60*time.Second)
}

// TestRefusalRecordSurvivesRestart: the record of a refusal is what makes
// the next start refuse; walrelay drop, which the operator runs on
// purpose, removes it with the slot, so that the start after is a first
// start.
func TestDropForgetsTheRecord(t *testing.T) {
	e := newEnv(t)
	rr := e.startRelay(e.config())
	if err := rr.stop(t); err != nil {
		t.Fatal(err)
	}
	conn := e.conn()
	if _, ok, err := source.ReadRecord(context.Background(), conn, source.DefaultRecordSchema, e.name); err != nil || !ok {
		t.Fatalf("no record of the slot after a start: ok %v, %v", ok, err)
	}
	out, code := runOutput(t, "drop", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--drop-publication")
	if code != 0 {
		t.Fatalf("drop exit %d:\n%s", code, out)
	}
	if _, ok, err := source.ReadRecord(context.Background(), conn, source.DefaultRecordSchema, e.name); err != nil || ok {
		t.Fatalf("the record of the dropped slot is still there (ok %v, %v)", ok, err)
	}
	e.startRelay(e.config())
}

// TestPublicationChangeStillCommittingIsNotConfirmedPast makes the window
// the publication watch must close: an ALTER PUBLICATION whose commit
// record is in the WAL, and so decoded (the rows after it skipped), while
// its transaction is not yet visible to other sessions, as while a
// synchronous commit waits for a standby that does not answer. A check
// reading the catalog then still sees the publication intact; the relay
// must not confirm past the change on its word, and must refuse once the
// change becomes visible.
func TestPublicationChangeStillCommittingIsNotConfirmedPast(t *testing.T) {
	e, _ := newClusterEnv(t, nil)
	cfg := e.config()
	cfg.SlotPollInterval = time.Hour // its record update would wait for the standby too
	rr, reg := e.startRelayGathered(cfg)
	c := e.consume()
	writer := e.conn()
	if _, err := writer.Exec(e.ctx, `SET synchronous_commit = local`); err != nil {
		t.Fatal(err)
	}
	before := e.insertRows(writer, 5, "before")
	c.waitAll(before, 30*time.Second)
	e.exec(`ALTER SYSTEM SET synchronous_standby_names = 'ghost'`)
	e.exec(`SELECT pg_reload_conf()`)
	t.Cleanup(func() {
		e.exec(`ALTER SYSTEM RESET synchronous_standby_names`)
		e.exec(`SELECT pg_reload_conf()`)
	})

	ddl := e.conn()
	var pid int
	if err := ddl.QueryRow(e.ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	changedAt := e.walLSN(writer)
	altered := make(chan error, 1)
	go func() {
		_, err := ddl.Exec(e.ctx, e.pubSQL(`ALTER PUBLICATION %[1]s SET (publish = 'update')`))
		altered <- err
	}()
	e.waitFor("the ALTER waiting for the standby after its commit record", 30*time.Second, func() (bool, error) {
		var ev *string
		err := writer.QueryRow(e.ctx, `SELECT wait_event FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&ev)
		return err == nil && ev != nil && *ev == "SyncRep", err
	})
	committedAt := e.walLSN(writer)
	during := e.insertRows(writer, 20, "during")
	// The relay hears of WAL past the change (keepalives once the skipped
	// rows are decoded) and asks the watch to vouch for it, several times.
	sent := gathered(reg, "walrelay_standby_status_updates_total")[""]
	e.waitFor("the relay past the change, sending status updates", 60*time.Second, func() (bool, error) {
		end := decoder.LSN(gathered(reg, "walrelay_server_wal_end_lsn")[""])
		return end > committedAt && gathered(reg, "walrelay_standby_status_updates_total")[""] >= sent+3, fmt.Errorf("server WAL end %s", end)
	})
	if info, err := e.slotInfoErr(); err != nil {
		t.Fatal(err)
	} else if info.ConfirmedLSN > changedAt {
		t.Fatalf("the slot was confirmed at %s, past the ALTER PUBLICATION (WAL %s) still committing: the watch vouched for a catalog it read before the change became visible", info.ConfirmedLSN, changedAt)
	}
	if done, err := rr.returned(); done {
		t.Fatalf("the relay stopped before the change was visible: %v", err)
	}
	// The wait cancelled, the change is visible: the relay refuses.
	e.exec(`SELECT pg_cancel_backend($1)`, pid)
	if err := <-altered; err != nil {
		t.Logf("the ALTER PUBLICATION, cancelled waiting for the standby: %v", err)
	}
	_ = e.waitRefused(rr, 60*time.Second, "stopped publishing inserts", "--accept-gap")
	if m := missingIDs(c, during); len(m) != len(during) {
		t.Logf("%d of %d rows committed after the change were published", len(during)-len(m), len(during))
	}
}

// TestRecordTableGrantAdvice: a least-privilege role (REPLICATION, SELECT
// on the outbox) meeting a record table another role created is refused
// with the GRANT to run; once run as printed, the role streams.
func TestRecordTableGrantAdvice(t *testing.T) {
	e := newEnv(t)
	out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name)
	if code != 0 {
		t.Fatalf("setup exit %d:\n%s", code, out)
	}
	role := e.name + "_r"
	u := e.createRole(role, "REPLICATION", "pw")
	e.exec(fmt.Sprintf("GRANT SELECT ON outbox TO %s", pgx.Identifier{role}.Sanitize()))
	args := withFlag(withFlag(e.args(), "--pg-url", u), "--startup-timeout", "5s")
	refusedWith(t, args, "may not read and write walrelay's record table", "GRANT USAGE ON SCHEMA")
	out, _, _, _ = runBounded(t, 30*time.Second, nil, args...)
	final := finalLines(out)
	i := strings.Index(final, "as its owner run ")
	if i < 0 {
		t.Fatalf("no statement to run in:\n%s", final)
	}
	grant := strings.TrimSpace(strings.Split(final[i+len("as its owner run "):], "\n")[0])
	for _, q := range strings.Split(grant, "; ") {
		e.exec(q)
	}
	p := startProc(t, nil, args...)
	e.waitFor("the role streaming", 60*time.Second, func() (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("walrelay exited:\n%s", p.out.String())
		default:
		}
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
}
