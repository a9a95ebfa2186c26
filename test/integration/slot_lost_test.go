package integration

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/slot"
)

// lostSlotSettings make max_slot_wal_keep_size invalidate a slot after a
// few MB of WAL written while it does not move.
var lostSlotSettings = map[string]string{
	"max_slot_wal_keep_size": "'1MB'",
	"max_wal_size":           "'32MB'",
	"min_wal_size":           "'32MB'",
	"wal_keep_size":          "0",
	"checkpoint_timeout":     "'30min'",
}

// insertOutbox commits n outbox rows of aggregate type agg in one
// transaction.
func (e *env) insertOutbox(agg string, n int) {
	e.t.Helper()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT $1, 'k' || g, 'T', '{}', g FROM generate_series(1, $2) g`, agg, n)
}

// invalidateByWAL writes WAL past max_slot_wal_keep_size, switching WAL
// files and checkpointing, until PostgreSQL invalidates the test's slot.
func (e *env) invalidateByWAL() slot.Info {
	e.t.Helper()
	conn := e.conn()
	for i := 0; ; i++ {
		if info := e.slotInfo(); info.Invalidated() {
			e.t.Logf("slot invalidated after %d rounds of 8 MB of WAL, a WAL switch and a checkpoint: wal_status %s, invalidation_reason %q", i, info.WALStatus, info.InvalidationReason)
			return info
		}
		if i == 40 {
			e.t.Fatalf("slot not invalidated after writing ~%d MB of WAL: %+v", i*8, e.slotInfo())
		}
		for _, q := range []string{
			`SELECT pg_logical_emit_message(false, 'walrelay.test', repeat('x', 8000000))`,
			`SELECT pg_switch_wal()`,
			`CHECKPOINT`,
		} {
			if _, err := conn.Exec(e.ctx, q); err != nil {
				e.t.Fatalf("%s: %v", q, err)
			}
		}
	}
}

// setupArgs and snapshotArgs are `walrelay setup` and `walrelay snapshot`
// with the flags of e.args() they share.
func (e *env) setupArgs(more ...string) []string {
	return append([]string{"setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name}, more...)
}

func (e *env) snapshotArgs() []string {
	return []string{"snapshot", "--pg-url", e.url, "--brokers", strings.Join(e.brokers, ","), "--table", "public.outbox",
		"--topic-template", e.topicPrefix() + "{aggregate_type}", "--dead-letter-topic", e.topicPrefix() + "dlq", "--topic-partitions", "3"}
}

// stopProc stops a relay started with startProc by SIGTERM and checks it
// exits 0.
func stopProc(t *testing.T, p *proc) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	if code, _, ok := p.wait(60 * time.Second); !ok || code != 0 {
		t.Fatalf("SIGTERM: exit %d (exited %v), want 0", code, ok)
	}
}

// countByType counts the distinct ids read per aggregate type.
func countByType(e *env, recs []*kgo.Record) map[string]int {
	seen := map[string]bool{}
	n := map[string]int{}
	for _, r := range recs {
		id, _ := header(r, "id")
		if seen[id] {
			continue
		}
		seen[id] = true
		n[strings.TrimPrefix(r.Topic, e.topicPrefix())]++
	}
	return n
}

// mustContain fails the test for each of want that out lacks.
func mustContain(t *testing.T, what, out string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("%s lacks %q:\n%s", what, w, out)
		}
	}
}

// TestLostSlotAdvice: 100 rows wait in the outbox while the relay is
// stopped, and max_slot_wal_keep_size invalidates the slot (wal_removed).
// status exits 1 and run exits 2, both naming PostgreSQL's reason, the
// setting behind it and one path: walrelay setup --accept-gap, then
// walrelay snapshot. The test follows that path to the end and counts what
// arrives: every row still in the outbox, and what is written after.
func TestLostSlotAdvice(t *testing.T) {
	e, _ := newClusterEnv(t, lostSlotSettings)
	c := e.consume()
	p := startProc(t, nil, e.args()...)
	e.waitSlotActive(p)
	e.insertOutbox("before", 10)
	c.waitIDs(10, 60*time.Second)
	stopProc(t, p)
	confirmed := e.slotInfo().ConfirmedLSN

	e.insertOutbox("outage", 100)
	info := e.invalidateByWAL()
	reason := "wal_removed"
	setting := "max_slot_wal_keep_size = 1MB"

	out, code := runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
	t.Logf("status: exit %d:\n%s", code, out)
	if code != 1 {
		t.Errorf("status of an invalidated slot: exit %d, want 1", code)
	}
	mustContain(t, "status", out, "invalidated", reason, setting, "walrelay setup --accept-gap", "walrelay snapshot",
		"PostgreSQL keeps no WAL for an invalidated slot", fmt.Sprintf("events committed after %s may be missing", confirmed))
	if info.ServerVersion >= 170000 {
		mustContain(t, "status", out, "invalidation_reason = wal_removed", "inactive_since")
	}

	text, causes := e.explain()
	t.Logf("status --explain:\n%s", explainSection(text))
	if len(causes) != 1 || causes[0].Kind != "invalidated" {
		t.Errorf("explain of an invalidated slot: %+v, want the invalidation alone", causes)
	} else {
		mustContain(t, "explain", causes[0].Text+" fix: "+causes[0].Fix, reason, setting, "walrelay setup --accept-gap", "walrelay snapshot")
	}

	out, code, elapsed, exited := runBounded(t, 45*time.Second, nil, withFlag(e.args(), "--startup-timeout", "5s")...)
	final := finalLines(out)
	t.Logf("run: exit %d after %s: %s", code, elapsed.Round(time.Millisecond), final)
	if !exited || code != 2 {
		t.Errorf("run on an invalidated slot: exit %d (exited by itself: %v), want 2", code, exited)
	}
	if strings.Count(final, "\n") > 0 {
		t.Errorf("run's refusal spans several lines, want one:\n%s", final)
	}
	mustContain(t, "run's refusal", final, "invalidated", reason, setting, "walrelay setup --accept-gap", "walrelay snapshot",
		fmt.Sprintf("events committed after %s may be missing", confirmed))

	// The advice, step by step.
	out, code = runOutput(t, e.setupArgs("--accept-gap")...)
	t.Logf("setup --accept-gap: exit %d:\n%s", code, out)
	if code != 0 {
		t.Fatalf("setup --accept-gap on an invalidated slot: exit %d, want 0", code)
	}
	mustContain(t, "setup --accept-gap", out, "accepted a gap", "invalidated", "walrelay snapshot")
	now := e.slotInfo()
	if now.Invalidated() || now.ConfirmedLSN <= confirmed {
		t.Errorf("after setup --accept-gap the slot is %+v: want a new, valid slot", now)
	}
	var gaps string
	if err := e.conn().QueryRow(e.ctx, `SELECT accepted_gaps::text FROM walrelay.slots WHERE slot_name = $1`, e.name).Scan(&gaps); err != nil {
		t.Fatal(err)
	}
	mustContain(t, "the record's accepted_gaps", gaps, "invalidated", confirmed.String())

	out, code = runOutput(t, e.snapshotArgs()...)
	t.Logf("snapshot: exit %d: %s", code, finalLines(out))
	if code != 0 {
		t.Fatalf("snapshot: exit %d", code)
	}
	mustContain(t, "snapshot", out, "published 110 rows")

	p = startProc(t, nil, e.args()...)
	e.waitSlotActive(p)
	e.insertOutbox("after", 5)
	recs := c.waitIDs(115, 60*time.Second)
	got := countByType(e, recs)
	t.Logf("distinct rows read by aggregate type after following the advice: %v (%d records)", got, len(recs))
	if got["before"] != 10 || got["outage"] != 100 || got["after"] != 5 {
		t.Errorf("rows read: %v, want before 10, outage 100, after 5", got)
	}
	stopProc(t, p)
}

// TestDropLostSlot: drop of an invalidated slot needs no relay run on it
// and no --force: it says it cannot count what the slot held and what
// may be missing, drops the slot and its record, and names the way on.
// Following it (walrelay run, which creates a new slot and publishes the
// rows still in the outbox first) publishes every row.
func TestDropLostSlot(t *testing.T) {
	e, _ := newClusterEnv(t, lostSlotSettings)
	if out, code := runOutput(t, e.setupArgs()...); code != 0 {
		t.Fatalf("setup: exit %d:\n%s", code, out)
	}
	e.insertOutbox("held", 20)
	info := e.invalidateByWAL()

	out, code := runOutput(t, "drop", "--pg-url", e.url, "--slot", e.name, "--publication", e.name)
	t.Logf("drop: exit %d:\n%s", code, out)
	if code != 0 {
		t.Fatalf("drop of an invalidated slot: exit %d, want 0", code)
	}
	mustContain(t, "drop", out, "without counting", "invalidated", fmt.Sprintf("events committed after %s may be missing", info.ConfirmedLSN),
		"walrelay run creates a new slot", "walrelay snapshot")
	if _, err := e.slotInfoErr(); err == nil {
		t.Error("the invalidated slot still exists after drop")
	}
	var records int
	if err := e.conn().QueryRow(e.ctx, `SELECT count(*) FROM walrelay.slots WHERE slot_name = $1`, e.name).Scan(&records); err != nil {
		t.Fatal(err)
	}
	if records != 0 {
		t.Errorf("walrelay's record of the dropped slot is still there")
	}

	c := e.consume()
	p := startProc(t, nil, e.args()...)
	e.waitSlotActive(p)
	recs := c.waitIDs(20, 60*time.Second)
	t.Logf("after drop and run: %v", countByType(e, recs))
	stopProc(t, p)
}

// TestIdleTimeoutAdvice is TestLostSlotAdvice for PostgreSQL 18's
// idle_replication_slot_timeout: the startup WARN names it, and once it
// invalidated the slot (idle_timeout) status and run name the reason and
// the setting, and the printed path, after setting the timeout to 0 as
// the refusal says, publishes every row still in the outbox.
func TestIdleTimeoutAdvice(t *testing.T) {
	needPG(t, 18) // idle_replication_slot_timeout
	e, _ := newClusterEnv(t, map[string]string{"idle_replication_slot_timeout": "'1s'", "checkpoint_timeout": "'30min'"})
	c := e.consume()
	p := startProc(t, nil, withFlag(e.args(), "--slot-poll-interval", "200ms")...)
	e.waitSlotActive(p)
	e.waitFor("the startup WARN about idle_replication_slot_timeout", 30*time.Second, func() (bool, error) {
		return strings.Contains(p.out.String(), "idle_replication_slot_timeout = 1s invalidates the slot once no relay has streamed from it that long"), nil
	})
	e.insertOutbox("before", 10)
	c.waitIDs(10, 60*time.Second)
	stopProc(t, p)

	e.insertOutbox("outage", 100)
	conn := e.conn()
	e.waitFor("the slot invalidated by idle_timeout", 60*time.Second, func() (bool, error) {
		// PostgreSQL invalidates an idle slot at a checkpoint.
		var idle bool
		if err := conn.QueryRow(e.ctx, `SELECT inactive_since < now() - interval '1s' FROM pg_replication_slots WHERE slot_name = $1`, e.name).Scan(&idle); err != nil {
			return false, err
		}
		if idle {
			if _, err := conn.Exec(e.ctx, "CHECKPOINT"); err != nil {
				return false, err
			}
		}
		info := e.slotInfo()
		return info.InvalidationReason == "idle_timeout", fmt.Errorf("invalidation_reason %q", info.InvalidationReason)
	})

	out, code := runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
	t.Logf("status: exit %d:\n%s", code, out)
	if code != 1 {
		t.Errorf("status: exit %d, want 1", code)
	}
	mustContain(t, "status", out, "invalidation_reason = idle_timeout", "idle_replication_slot_timeout = 1s", "inactive_since",
		"walrelay setup --accept-gap", "walrelay snapshot", "PostgreSQL keeps no WAL for an invalidated slot")
	out, code, _, exited := runBounded(t, 45*time.Second, nil, withFlag(e.args(), "--startup-timeout", "5s")...)
	final := finalLines(out)
	t.Logf("run: exit %d: %s", code, final)
	if !exited || code != 2 {
		t.Errorf("run: exit %d (exited by itself: %v), want 2", code, exited)
	}
	mustContain(t, "run's refusal", final, "idle_timeout", "idle_replication_slot_timeout = 1s", "set idle_replication_slot_timeout to 0",
		"walrelay setup --accept-gap", "walrelay snapshot")

	e.exec(`ALTER SYSTEM SET idle_replication_slot_timeout = 0`)
	e.exec(`SELECT pg_reload_conf()`)
	e.waitFor("idle_replication_slot_timeout = 0", 30*time.Second, func() (bool, error) {
		var v string
		err := e.conn().QueryRow(e.ctx, "SHOW idle_replication_slot_timeout").Scan(&v)
		return v == "0", err
	})
	if out, code := runOutput(t, e.setupArgs("--accept-gap")...); code != 0 || !strings.Contains(out, "accepted a gap") {
		t.Fatalf("setup --accept-gap: exit %d:\n%s", code, out)
	}
	if out, code := runOutput(t, e.snapshotArgs()...); code != 0 || !strings.Contains(out, "published 110 rows") {
		t.Fatalf("snapshot: exit %d:\n%s", code, out)
	}
	p = startProc(t, nil, e.args()...)
	e.waitSlotActive(p)
	e.insertOutbox("after", 5)
	got := countByType(e, c.waitIDs(115, 60*time.Second))
	t.Logf("distinct rows read by aggregate type: %v", got)
	if got["before"] != 10 || got["outage"] != 100 || got["after"] != 5 {
		t.Errorf("rows read: %v, want before 10, outage 100, after 5", got)
	}
	stopProc(t, p)
}
