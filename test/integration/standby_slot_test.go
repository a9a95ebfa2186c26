package integration

// What walrelay says about a failover when the "standby" is not what it
// seems: a pg_receivewal client streaming WAL (no failover can go to it),
// and an old primary that rejoined as a standby after a switchover with
// its own slot of the same name (synced = false), which slot
// synchronization never updates and a switchover back resumes from.

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// TestReceivewalIsNoStandby: a pg_receivewal stream is listed in
// pg_stat_replication like a standby's, but replays nothing and cannot be
// promoted: the failover line of the relay's startup and of status (as a
// superuser and as the relay's least-privileged role) does not count it as
// a standby, and says it is there. On PostgreSQL 17+ the slot is made a
// plain slot so that the line is the one that counts standbys.
func TestReceivewalIsNoStandby(t *testing.T) {
	if pgCluster == nil {
		t.Skip("needs a PostgreSQL cluster of its own; skipped against an external PostgreSQL")
	}
	ctx := context.Background()
	pg, err := devcluster.StartPostgres(ctx, devcluster.PostgresOptions{BinDir: pgCluster.BinDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })
	w, err := pg.ReceiveWAL(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	t.Logf("pg_receivewal stream: the real pg_receivewal: %v", w.Real)
	e := newEnvOn(t, pg.URL("postgres"))
	p := startProc(t, nil, append(e.args(), "--no-failover-slot")...)
	e.waitSlotActive(p)
	const miscounted = "a failover to one of its 1 standbys"
	const named = "1 WAL stream(s) of clients that replay nothing, such as pg_receivewal, are not counted as standbys"
	e.waitFor("the relay's failover line", 30*time.Second, func() (bool, error) {
		return strings.Contains(p.out.String(), `"msg":"failover: `), nil
	})
	line := logLine(p.out.String(), `"msg":"failover: `)
	if strings.Contains(line, miscounted) || !strings.Contains(line, named) || !strings.Contains(line, `"level":"info"`) {
		t.Errorf("the relay's failover line counts pg_receivewal as a standby, or does not name it, or warns:\n%s", line)
	}
	for _, url := range []string{e.url, e.leastPrivilegedURL()} {
		out, _ := runOutput(t, "status", "--pg-url", url, "--slot", e.name)
		if strings.Contains(out, miscounted) || !strings.Contains(out, named) {
			t.Errorf("status counts pg_receivewal as a standby, or does not name it:\n%s", out)
		}
	}
}

// logLine is the last line of out that holds s.
func logLine(out, s string) string {
	lines := strings.Split(out, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], s) {
			return lines[i]
		}
	}
	return ""
}

// switchover stops the primary with a fast shutdown (its standby then
// has all its WAL), promotes the standby, and makes the old primary a
// standby of the promoted server with its own data directory and its own
// slots (devcluster's Rejoin), as the review's operators did. With
// removeSlot set, the old primary's slot of that name is removed while it
// is stopped, before it rejoins: the documented step (docs/operating.md).
func (rs *replicaSet) switchover(removeSlot string) {
	rs.t.Helper()
	ctx := context.Background()
	old := rs.primary
	if err := old.Stop(); err != nil {
		rs.t.Fatalf("switchover: stop the primary: %v", err)
	}
	if err := rs.standby.Promote(ctx); err != nil {
		rs.t.Fatalf("switchover: %v", err)
	}
	rs.primary, rs.standby = rs.standby, old
	if removeSlot != "" {
		if err := old.RemoveSlot(removeSlot); err != nil {
			rs.t.Fatalf("switchover: %v", err)
		}
	}
	if err := old.Rejoin(ctx, rs.primary, rs.opts); err != nil {
		rs.t.Fatalf("switchover: %v", err)
	}
}

// TestStaleStandbySlot (PostgreSQL 17+) replays the review's switchover:
// a primary A with the relay's failover slot, a standby B synchronizing
// it. Switchover: A stops, B is promoted, A rejoins as B's standby with
// its own data directory, keeping its slot (synced = false), which slot
// synchronization refuses to update. status, its --explain and the
// relay's failover line and walrelay_slot_failover_protected, given both
// nodes' URLs, name that slot and the fix. Switch back: B stops, A is
// promoted, and the relay resumes from A's stale slot: its WARN says how
// far behind what it had acknowledged that is and that those events are
// sent again (they are: duplicates in Kafka, none lost). B rejoins the
// documented way (its slot removed), gets a synchronized copy, and the
// failover is protected again. A third switchover leaves A's slot stale
// again, and a relay started after the switch back says the same, from
// walrelay's record.
func TestStaleStandbySlot(t *testing.T) {
	rs := startReplicaSet(t, replicaSetOptions{FailoverSlots: true, SynchronizedStandbySlots: true})
	e := rs.newEnv()
	c := e.consume()
	a, b := rs.primary, rs.standby
	nodes := []string{"--standby-url", a.URL(e.name), "--standby-url", b.URL(e.name)}
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	args := append(withFlag(withFlag(e.args(), "--metrics-addr", addr), "--slot-poll-interval", "1s"), nodes...)
	p := startProc(t, nil, args...)
	e.waitSlotActive(p)
	protected := func() float64 {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return -1
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return metricValue(string(body), "walrelay_slot_failover_protected")
	}
	status := func(extra ...string) string {
		out, _ := runOutput(t, append([]string{"status", "--pg-url", e.url, "--slot", e.name, "--explain"}, extra...)...)
		return out
	}
	rs.waitSynced(e.name)
	const synchronized = "are synchronized and current: a promoted standby keeps the slot"
	e.waitFor("the failover protected, B's copy read", time.Minute, func() (bool, error) {
		return protected() == 1, fmt.Errorf("walrelay_slot_failover_protected %v", protected())
	})
	if out := status(nodes...); !strings.Contains(out, synchronized) {
		t.Errorf("status with both nodes' URLs does not say B's copy protects the slot:\n%s", out)
	}
	// Without the standbys' URLs, status claims no protection it cannot
	// verify, and says what it checked.
	if out := status(); strings.Contains(out, "a promoted standby keeps the slot") || !strings.Contains(out, "not the standbys' copies of the slot") {
		t.Errorf("status without standby URLs claims protection or does not say what it checked:\n%s", out)
	}

	fw := e.startFailoverWriters(2, 5*time.Millisecond)
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
	waitMore("records before the switchover", 200)
	rs.waitSynced(e.name)

	rs.switchover("")
	waitMore("records after the switchover", 200)
	// A, now B's standby, keeps its own slot; slot synchronization says
	// why it does not update it.
	var synced bool
	conn, err := pgx.Connect(e.ctx, a.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	err = conn.QueryRow(e.ctx, "SELECT synced FROM pg_replication_slots WHERE slot_name = $1", e.name).Scan(&synced)
	conn.Close(context.Background())
	if err != nil || synced {
		t.Fatalf("the old primary's slot as a standby: synced %v (%v), want its own slot, synced = false", synced, err)
	}
	e.waitFor("slot synchronization refusing the old primary's slot", time.Minute, func() (bool, error) {
		log, err := os.ReadFile(a.LogFile())
		return strings.Contains(string(log), `same name slot "`+e.name+`" already exists on the standby`), err
	})
	stale := fmt.Sprintf(`has a slot %q of its own (synced = false`, e.name)
	drop := fmt.Sprintf("pg_drop_replication_slot('%s') on that standby", e.name)
	e.waitFor("walrelay_slot_failover_protected 0", time.Minute, func() (bool, error) {
		return protected() == 0, fmt.Errorf("walrelay_slot_failover_protected %v", protected())
	})
	// The log is JSON: the slot's name is quoted with escapes there.
	if line := logLine(p.out.String(), "of its own (synced = false"); !strings.Contains(line, `"level":"warn"`) || !strings.Contains(line, drop) {
		t.Errorf("the relay did not warn of the old primary's slot, with the fix:\n%s", finalLines(p.out.String()))
	}
	out := status(nodes...)
	for _, w := range []string{stale, drop, ". standby_slot (holds nothing here", "sending every event since again"} {
		if !strings.Contains(out, w) {
			t.Errorf("status --explain with both nodes' URLs lacks %q:\n%s", w, out)
		}
	}
	if strings.Contains(out, synchronized) {
		t.Errorf("status still says the failover keeps the slot:\n%s", out)
	}
	// status run on the old primary itself names its slot too.
	if out, _ := runOutput(t, "status", "--pg-url", a.URL(e.name), "--slot", e.name); !strings.Contains(out, fmt.Sprintf(`this standby has a slot %q of its own (synced = false`, e.name)) {
		t.Errorf("status on the rejoined old primary does not name its slot:\n%s", out)
	}

	waitMore("records before the switch back", 200)
	rs.switchover(e.name)
	waitMore("records after the switch back", 200)
	const resent = "behind what this process had acknowledged on the old timeline"
	if line := logLine(p.out.String(), resent); !strings.Contains(line, "so the events of that WAL are sent again") || !strings.Contains(line, "this server was a standby until its promotion, and its slot (synced = false)") || !strings.Contains(line, `"level":"warn"`) {
		t.Errorf("the relay did not warn that it resumes from the stale slot, sending events again:\n%s", line)
	} else {
		t.Logf("the warning: %s", line)
	}
	fw.halt()
	committed := e.committedIDs()
	var all []string
	for id := range committed {
		all = append(all, id)
	}
	e.waitFor("every committed id delivered", 2*time.Minute, func() (bool, error) {
		m := missingIDs(c, all)
		return len(m) == 0, fmt.Errorf("%d committed ids not read", len(m))
	})
	dups := 0
	for _, n := range distinctIDs(c.records()) {
		dups += n - 1
	}
	t.Logf("%d committed, 0 lost, %d duplicates (the stale slot's)", len(committed), dups)
	if dups == 0 {
		t.Errorf("no duplicates: the switch back did not resume from the stale slot, so this test shows nothing")
	}
	// B rejoined with its slot removed (it was a synchronized copy from
	// before its promotion, ahead of A's now, which a standby cannot
	// drop): slot synchronization makes a copy, and the failover is
	// protected again.
	rs.waitSynced(e.name)
	e.waitFor("walrelay_slot_failover_protected 1 again", time.Minute, func() (bool, error) {
		return protected() == 1, fmt.Errorf("walrelay_slot_failover_protected %v", protected())
	})
	if out := status(nodes...); !strings.Contains(out, synchronized) {
		t.Errorf("status after the documented rejoin does not say the copy protects the slot:\n%s", out)
	}

	// Once more, with a relay started after the switch back: a new
	// process knows nothing it acknowledged and compares the slot with
	// walrelay's record, which replication copied from the old primary.
	insert := func(tag string) {
		t.Helper()
		conn := e.conn()
		defer conn.Close(context.Background())
		c.waitAll(e.insertRows(conn, 100, tag), 2*time.Minute)
	}
	insert("before-third")
	rs.switchover("") // A stops, B is promoted, A rejoins with its slot
	// A's slot stopped before B's WAL at its promotion; the relay moves
	// its record past that every --slot-poll-interval, and a record that
	// has not moved yet cannot tell the new process anything.
	b2 := e.conn()
	var promotedAt string
	if err := b2.QueryRow(e.ctx, "SELECT pg_current_wal_lsn()::text").Scan(&promotedAt); err != nil {
		t.Fatal(err)
	}
	insert("after-third")
	e.waitFor("walrelay's record past the promotion", time.Minute, func() (bool, error) {
		var past bool
		err := b2.QueryRow(e.ctx, "SELECT confirmed_lsn >= $1::pg_lsn FROM walrelay.slots WHERE slot_name = $2", promotedAt, e.name).Scan(&past)
		return past, err
	})
	b2.Close(context.Background())
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code, _, exited := p.wait(time.Minute); !exited || code != 0 {
		t.Fatalf("the relay did not stop on SIGTERM: exited %v, code %d", exited, code)
	}
	rs.switchover(e.name)
	p = startProc(t, nil, args...)
	e.waitSlotActive(p)
	const recorded = "behind what walrelay recorded as confirmed"
	e.waitFor("the new process's warning", time.Minute, func() (bool, error) {
		return strings.Contains(p.out.String(), recorded), nil
	})
	if line := logLine(p.out.String(), recorded); !strings.Contains(line, "so the events of that WAL are sent again") || !strings.Contains(line, "its slot (synced = false)") {
		t.Errorf("the new process did not warn that it resumes from the stale slot, sending events again:\n%s", line)
	} else {
		t.Logf("the new process's warning: %s", line)
	}
}
