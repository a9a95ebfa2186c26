package integration

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// TestExactlyOnceStandby runs two walrelay binaries on one slot in
// exactly-once mode, as two supervised relays would, while 8 writers
// commit 12,000 events: one streams, the other waits as a standby without
// taking the transactional id. The active one is SIGKILLed 4 times
// (WALRELAY_TEST_STANDBY_KILLS overrides), every second kill after a cut
// of the active relay's replication connection (either relay may win the
// slot then; the cut relay, fenced once the other takes the id, must
// become the standby): each time the standby takes over, and the killed
// one, restarted as a supervisor would once the other streams, becomes the
// standby; neither exits (a relay that took the id from the active one at
// start, or a fenced relay that exits 3, would fail this). In the end a
// read_committed consumer has read every committed id exactly once, per
// key in commit order.
func TestExactlyOnceStandby(t *testing.T) {
	kills := 4
	if s, err := strconv.Atoi(os.Getenv("WALRELAY_TEST_STANDBY_KILLS")); err == nil && s >= 0 {
		kills = s
	}
	e := newEnv(t)
	var addrs [2]string
	var procs [2]*proc
	for i := range addrs {
		port, err := devcluster.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		addrs[i] = fmt.Sprintf("127.0.0.1:%d", port)
	}
	args := func(i int) []string { return e.eosArgs("--metrics-addr", addrs[i], "--backoff-max", "1s") }
	for i := range procs {
		procs[i] = startProc(t, nil, args(i)...)
	}
	rc := e.consumeIsolated(true)

	// roles is the active relay (ready) while the other is a standby
	// (not ready, running); -1 otherwise.
	roles := func() (int, error) {
		for i, p := range procs {
			if exited(p) {
				return -1, fmt.Errorf("relay %d exited (%v): %s", i, p.err, lastLines(p.out.String(), 3))
			}
		}
		return activeOf(addrs)
	}
	oneActive := func(what string) int {
		t.Helper()
		active := -1
		e.waitFor(what, 90*time.Second, func() (bool, error) {
			i, err := roles()
			active = i
			return i >= 0, err
		})
		return active
	}
	oneActive("one relay active, the other a standby")

	const writers, perWriter = 8, 1500
	const total = writers * perWriter
	began := time.Now()
	wr := e.startWriters(writers, 0, perWriter, 20*time.Millisecond)
	var takeovers []string
	for k := range kills {
		if k%2 == 1 {
			// Before every second kill, cut the active relay's
			// replication connection instead (again, up to 20 times,
			// until the other relay wins the slot): the cut relay lives
			// on as the standby, its producer's epoch stale once the
			// other took the id. At the next kill it must take over
			// without being fenced.
			cuts := 0
			for from := oneActive("one relay active before a cut"); ; cuts++ {
				if cuts == 20 {
					t.Fatalf("relay %d won the slot back after each of 20 cuts", from)
				}
				pid := e.slotInfo().ActivePID
				if pid == nil {
					t.Fatal("no walsender on the slot before a cut")
				}
				e.exec("SELECT pg_terminate_backend($1)", *pid)
				e.waitFor("a new walsender on the slot", 30*time.Second, func() (bool, error) {
					i := e.slotInfo()
					return i.ActivePID != nil && *i.ActivePID != *pid, fmt.Errorf("slot active_pid %v", deref(i.ActivePID))
				})
				if oneActive("one relay active after a cut") != from {
					break
				}
			}
			takeovers = append(takeovers, fmt.Sprintf("(%d connection cuts)", cuts+1))
		}
		// Kill at evenly spread points of the writers' progress.
		target := int64(total * (k + 1) / (kills + 1))
		e.waitFor(fmt.Sprintf("%d rows written", target), 3*time.Minute, func() (bool, error) {
			return wr.rows.Load() >= target, fmt.Errorf("%d rows written", wr.rows.Load())
		})
		active := oneActive(fmt.Sprintf("one relay active before kill %d", k+1))
		standby := 1 - active
		kill9(procs[active])
		killed := time.Now()
		e.waitFor(fmt.Sprintf("relay %d (the standby) streaming after kill %d", standby, k+1), 60*time.Second, func() (bool, error) {
			if exited(procs[standby]) {
				return false, fmt.Errorf("the standby exited (%v): %s", procs[standby].err, lastLines(procs[standby].out.String(), 3))
			}
			code := readyz(addrs[standby])
			return code == 200, fmt.Errorf("the standby's /readyz: %d", code)
		})
		takeovers = append(takeovers, fmt.Sprintf("%s at %d rows", time.Since(killed).Round(time.Millisecond), wr.rows.Load()))
		// The supervisor restarts the killed relay (after its restart
		// delay): it must wait as the standby, not take the id.
		procs[active] = startProc(t, nil, args(active)...)
		if i := oneActive(fmt.Sprintf("relay %d restarted as the standby", active)); i != standby {
			t.Fatalf("after kill %d relay %d is active, want %d (the one that took over)", k+1, i, standby)
		}
	}
	wr.wait(t)
	writeTime := time.Since(began)

	recs, n := e.deliveredExactlyOnce(rc, 3*time.Minute)
	if n != total {
		t.Fatalf("the outbox holds %d rows, the writers wrote %d", n, total)
	}
	if _, err := roles(); err != nil {
		t.Errorf("after the writes: %v", err)
	}
	for i, p := range procs {
		checkRunning(t, p, fmt.Sprintf("relay %d", i))
	}
	t.Logf("%d events written in %s; %d kills of the active relay, standby active after: %s; read_committed: %d records, 0 duplicates (checked)",
		total, writeTime.Round(time.Second), kills, strings.Join(takeovers, ", "), len(recs))
}
