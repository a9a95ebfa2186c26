package integration

// Exactly-once delivery (--delivery exactly-once): Kafka transactions, each
// closed by a checkpoint record on a compacted topic, a slot confirmed only
// past committed Kafka transactions, and a relay that skips on start what
// the newest committed checkpoint covers. "Exactly once" here means: a
// read_committed consumer of the event topics reads every committed outbox
// id exactly once (no duplicate at all, no loss, nothing uncommitted), and
// per key those single arrivals follow commit order.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
)

// TestExactlyOnceKills runs 8 paced writers (30,000 events in transactions
// of 1 to 5 rows) while the relay binary (confirming the slot at most every
// 3s, so that it lags the checkpoints) is SIGKILLed at 20 random moments
// of the run (WALRELAY_TEST_EOS_KILLS overrides the count) and restarted
// right after each kill: in the end a read_committed consumer has read
// every committed id exactly once, per key in commit order, nothing else,
// and the slot is confirmed past the end of the writes. A read_uncommitted
// consumer runs alongside to show how many aborted copies existed. The
// relay runs with two transactional producers (--txn-producers 2) and one
// in turn, so that every kill is also an upgrade or a downgrade: a kill
// between two producers' commits, then a relay with one, or the reverse.
func TestExactlyOnceKills(t *testing.T) {
	if testing.Short() {
		t.Skip("20 kills of the relay under load")
	}
	kills := 20
	if s, err := strconv.Atoi(os.Getenv("WALRELAY_TEST_EOS_KILLS")); err == nil && s >= 0 {
		kills = s
	}
	e := newEnv(t)
	// Confirm the slot at most every 3 seconds (well under the test
	// cluster's wal_sender_timeout of 10s): the slot then lags the newest
	// checkpoint by up to 3s of committed Kafka transactions at every
	// kill, so each restart must skip what PostgreSQL resends.
	args := e.eosArgs("--status-interval", "3s", "--confirm-delay", "3s")
	producers := func(kills int) []string {
		return append(args[:len(args):len(args)], "--txn-producers", strconv.Itoa(2-kills%2))
	}
	p := startProc(t, nil, producers(0)...)
	rc := e.consumeIsolated(true)
	ru := e.consumeIsolated(false)
	e.waitSlotStreamed(60 * time.Second)

	const writers, perWriter = 8, 3750
	const total = writers * perWriter
	start := time.Now()
	wr := e.startWriters(writers, 0, perWriter, 30*time.Millisecond)

	// Kill at random points of the writers' progress, so the kills span
	// the run whatever the machine's speed; at least 200ms apart so that
	// some fall during a restarted relay's startup and most during
	// streaming, with Kafka transactions open or committing.
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 5))
	at := make([]float64, kills)
	for i := range at {
		at[i] = 0.03 + 0.92*rng.Float64()
	}
	sort.Float64s(at)
	done := 0
	var killLog []string
	for _, frac := range at {
		target := int64(frac * total)
		for wr.rows.Load() < target {
			select {
			case <-wr.done:
			case <-time.After(10 * time.Millisecond):
				continue
			}
			break
		}
		// Where the kill falls is the test's variable: a random moment
		// into the writes, not a wait for anything.
		time.Sleep(time.Duration(200+rng.IntN(300)) * time.Millisecond)
		if exited(p) {
			t.Fatalf("the relay exited by itself before kill %d (%v):\n%s", done+1, p.err, lastLines(p.out.String(), 3))
		}
		kill9(p)
		done++
		killLog = append(killLog, fmt.Sprintf("%d/%d", rc.distinct(), wr.rows.Load()))
		p = startProc(t, nil, producers(done)...)
	}
	wr.wait(t)
	writeTime := time.Since(start)

	recs, n := e.deliveredExactlyOnce(rc, 3*time.Minute)
	if n != total {
		t.Fatalf("the outbox holds %d rows, the writers wrote %d", n, total)
	}
	checkRunning(t, p, "the last relay")
	ruIDs, ruExtra := ru.duplicates()
	t.Logf("%d kills (read_committed ids/rows committed at each: %s); %d events, writes %s, elapsed %s; "+
		"read_committed: %d records, 0 duplicates allowed; read_uncommitted: %d records, %d ids seen more than once (%d aborted copies); %d checkpoint records",
		done, strings.Join(killLog, " "), total, writeTime.Round(time.Second), time.Since(start).Round(time.Second),
		len(recs), len(ru.records()), ruIDs, ruExtra, len(rc.checkpoints()))
}

// TestExactlyOnceBigTransaction commits one PostgreSQL transaction of
// 300,000 outbox rows with --txn-max-events 10000 (so it spans about 30
// Kafka transactions) and SIGKILLs the relay binary once the committed
// checkpoints say about half of it is in Kafka. At that point the newest
// checkpoint has a "partial" part naming the transaction (the proof of the
// split), and it counts exactly the events a read_committed consumer reads.
// After the restart PostgreSQL resends the whole transaction, the relay
// skips the events the checkpoint counts as in, and every row is read
// exactly once, per key in insert order.
func TestExactlyOnceBigTransaction(t *testing.T) {
	e := newEnv(t)
	args := e.eosArgs("--txn-max-events", "10000")
	p := startProc(t, nil, args...)
	rc := e.consumeIsolated(true)
	// The checkpoints alone, read_committed: a consumer of the 300,000
	// events lags the relay, this one does not.
	ckc := e.newEOSConsumer(true, "^"+regexp.QuoteMeta(e.checkpointTopic())+"$")
	e.waitSlotStreamed(60 * time.Second)

	const rows = 300_000
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'big', 'k' || (g % 100), 'Big', jsonb_build_object('n', g), g FROM generate_series(1, $1) g`, rows)
	committedAt := time.Now()
	newest := func() (checkpoint.Durable, bool) {
		ds := ckc.durables(t, e.name)
		if len(ds) == 0 {
			return checkpoint.Durable{}, false
		}
		return ds[len(ds)-1], true
	}
	err := devcluster.WaitFor(5*time.Minute, 5*time.Millisecond, func() (bool, error) {
		d, ok := newest()
		if !ok || d.Partial == nil {
			return false, fmt.Errorf("newest checkpoint %+v (found %v)", d, ok)
		}
		return d.Partial.Events >= rows/2, fmt.Errorf("newest checkpoint counts %d of %d events", d.Partial.Events, rows)
	})
	if err != nil {
		t.Fatalf("waiting for half of the transaction to be committed to Kafka: %v", err)
	}
	kill9(p)
	killedAfter := time.Since(committedAt)
	// Abort the Kafka transaction the killed relay left open, as the next
	// relay would, and wait until the checkpoint consumer has read
	// everything committed before the kill.
	e.fence(e.transactionalID(), ckc)
	d, _ := newest()
	if d.Partial == nil || d.Partial.Events >= rows {
		t.Fatalf("at the kill the newest checkpoint was %+v (partial %+v): the relay had the whole transaction in Kafka, the restart cannot resume inside it", d, d.Partial)
	}
	var partials []string
	for _, d := range ckc.durables(t, e.name) {
		if d.Partial != nil {
			partials = append(partials, strconv.Itoa(d.Partial.Events))
		}
	}
	atKill := d.Partial.Events
	// The checkpoint says exactly how far the committed Kafka transactions
	// reach: read_committed shows exactly that many events.
	err = devcluster.WaitFor(2*time.Minute, 50*time.Millisecond, func() (bool, error) {
		return rc.distinct() >= atKill, fmt.Errorf("%d of the %d events the checkpoint counts read", rc.distinct(), atKill)
	})
	if err != nil {
		t.Fatal(err)
	}
	e.fence("", rc) // an event committed past the checkpoint would be read by now
	if got := rc.distinct(); got != atKill {
		t.Errorf("the newest checkpoint counts %d events of the transaction in Kafka; read_committed reads %d", atKill, got)
	}
	p = startProc(t, nil, args...)

	recs, n := e.deliveredExactlyOnce(rc, 5*time.Minute)
	if n != rows {
		t.Fatalf("the outbox holds %d rows, want %d", n, rows)
	}
	checkRunning(t, p, "the restarted relay")
	all := 0
	for _, d := range ckc.durables(t, e.name) {
		if d.Partial != nil {
			all++
		}
	}
	t.Logf("killed %s after the PostgreSQL commit with %d of %d rows committed to Kafka; partial checkpoints before the kill count %s events; "+
		"%d partial checkpoints in all, %d checkpoint topic records (with probes); %d records read",
		killedAfter.Round(time.Millisecond), atKill, rows, strings.Join(partials, ","), all, len(ckc.checkpoints()), len(recs))
}

// TestExactlyOnceBrokerRestart stops the broker (kfake persisting to a
// data directory on a fixed port) in the middle of a run of 8 writers, at
// a moment the relay's Kafka transaction is open (DescribeTransactions
// says Ongoing), keeps it down for 5 seconds while the writers go on, and
// starts it again with the same data: the in-process relay (exactly-once)
// rides it out without its Run returning, and every committed id is read
// exactly once read_committed, per key in commit order.
func TestExactlyOnceBrokerRestart(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	b := startKafkaAt(t)
	e.brokers = []string{b.addr()}
	cfg := e.config()
	cfg.ExactlyOnce = true
	cfg.Router.CheckpointTopic = e.checkpointTopic()
	cfg.TxnMaxInterval = 300 * time.Millisecond
	rr, reg := e.startRelayGathered(cfg)
	rc := e.consumeIsolated(true)
	ru := e.consumeIsolated(false)

	const writers, perWriter = 8, 600
	wr := e.startWriters(writers, 0, perWriter, 60*time.Millisecond)
	rc.waitDistinct(writers*perWriter/4, 2*time.Minute)
	state := e.waitTxnOngoing("walrelay-"+e.name, 30*time.Second)
	b.stop()
	rowsAtStop := wr.rows.Load()
	time.Sleep(5 * time.Second) // the outage itself: a deliberately timed gap the writers keep writing through
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay Run returned during the broker outage: %v", err)
	}
	rowsDuring := wr.rows.Load() - rowsAtStop
	b.start()
	wr.wait(t)
	if rowsDuring == 0 {
		t.Fatal("no rows were committed while the broker was down: the writers did not span the outage")
	}
	_, n := e.deliveredExactlyOnce(rc, 3*time.Minute)
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay Run returned: %v", err)
	}
	ruIDs, ruExtra := ru.duplicates()
	t.Logf("broker stopped with the relay's transaction %s, down 5s, %d rows committed meanwhile; %d events read exactly once; "+
		"read_uncommitted saw %d ids twice or more (%d extra copies); kafka transactions %v, stream restarts %v, produce errors %v",
		state, rowsDuring, n, ruIDs, ruExtra, gathered(reg, "walrelay_kafka_transactions_total"),
		gathered(reg, "walrelay_stream_restarts_total"), gathered(reg, "walrelay_produce_errors_total"))
}

// TestExactlyOncePostgresRestartSlotBehind makes the slot's confirmed
// position lag the checkpoint on purpose: on a cluster of its own with
// wal_sender_timeout 0 (the server never asks for a reply), the relay
// binary runs with --status-interval 1h --confirm-delay 1h, so it
// delivers and commits checkpoints but never reports a new position. It
// is SIGKILLed (confirmed_flush_lsn is then behind the newest committed
// checkpoint: asserted from pg_replication_slots and the checkpoint
// topic), PostgreSQL is restarted (pg_ctl restart -m fast), and a relay
// with the usual flags starts: PostgreSQL resends everything since the
// old confirmed position and the relay must skip what the checkpoint
// covers. Every id of both phases is read exactly once, per key in commit
// order, and the slot moves past the end.
func TestExactlyOncePostgresRestartSlotBehind(t *testing.T) {
	e, pg := newClusterEnv(t, map[string]string{"wal_sender_timeout": "0"})
	p := startProc(t, nil, e.eosArgs("--status-interval", "1h", "--confirm-delay", "1h", "--receive-timeout", "1h")...)
	rc := e.consumeIsolated(true)
	e.waitSlotStreamed(60 * time.Second)
	created := e.slotInfo().ConfirmedLSN

	const writers, perPhase = 8, 250
	phase := func(from int) {
		t.Helper()
		e.startWriters(writers, from, perPhase, 5*time.Millisecond).wait(t)
	}
	phase(0)
	conn := e.conn()
	want1, n1 := committedRows(t, e, conn)
	phase1End := e.currentLSN(conn)
	rc.waitAll(want1, 2*time.Minute)
	if exited(p) {
		t.Fatalf("the relay exited (%v):\n%s", p.err, lastLines(p.out.String(), 3))
	}
	kill9(p)
	// The checkpoint of the last Kafka transaction is committed with its
	// events; abort whatever the killed relay left open and read up to here.
	e.fence(e.transactionalID(), rc)
	ds := rc.durables(t, e.name)
	if len(ds) == 0 {
		t.Fatal("no checkpoint record read after phase 1 was delivered")
	}
	ck := ds[len(ds)-1]
	reach := ck.LSN // how far the checkpoint says Kafka has the stream
	if ck.Partial != nil {
		reach = max(reach, ck.Partial.CommitLSN)
	}
	behind := e.slotInfo().ConfirmedLSN
	if behind >= reach {
		t.Fatalf("confirmed_flush_lsn %s is not behind the newest checkpoint (lsn %s, partial %+v): the scenario needs a slot that lags the checkpoint", behind, ck.LSN, ck.Partial)
	}
	if err := pg.Restart(e.ctx); err != nil {
		t.Fatal(err)
	}
	afterRestart := e.slotInfo().ConfirmedLSN
	if afterRestart >= reach {
		t.Fatalf("after the PostgreSQL restart confirmed_flush_lsn is %s, not behind the checkpoint %s", afterRestart, reach)
	}

	p = startProc(t, nil, e.eosArgs()...)
	phase(perPhase)
	recs, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, p, "the restarted relay")
	t.Logf("slot created at %s; phase 1: %d rows up to %s, newest checkpoint %s; confirmed_flush_lsn at the kill %s, after the PostgreSQL restart %s "+
		"(%d bytes of WAL resent and skipped); phase 2: %d rows; %d records read",
		created, n1, phase1End, reach, behind, afterRestart, uint64(reach-afterRestart), n-n1, len(recs))
}

// TestExactlyOnceFencing starts relay A (binary) and, while 8 writers run,
// freezes it (SIGSTOP) with its Kafka transaction open and starts relay B
// with the same arguments (same slot, same transactional id). B waits as a
// standby until the walsender gives up on the frozen A
// (wal_sender_timeout), takes the slot and then the transactional id,
// fencing A. Thawed, A, which lost the slot without noticing, ends its
// session one of two ways, whichever comes first: Kafka tells it it is
// fenced (Apache Kafka as INVALID_PRODUCER_EPOCH on its records, kfake on
// any request of the old epoch), and it says so; or its silence watchdog
// or the closed replication connection ends the session first, and its
// abort of the open transaction succeeds (Apache Kafka 4's transaction
// protocol 2 answers an abort one epoch behind as a retry of the abort
// B's InitProducerId already made), so nothing says fenced. Either way A
// restarts, sees that another walsender holds the slot and becomes the
// standby: it neither exits nor streams. On kfake the fence must be the
// one seen. B delivers and keeps running. Every committed id is read
// exactly once read_committed, per key in commit order.
// (--txn-min-interval keeps A's transactions open long enough to freeze
// it inside one.)
func TestExactlyOnceFencing(t *testing.T) {
	e := newEnv(t)
	args := e.eosArgs("--txn-min-interval", "1s")
	a := startProc(t, nil, args...)
	rc := e.consumeIsolated(true)
	pidA := e.waitWalsender(0, 60*time.Second)

	const writers, perWriter = 8, 600
	wr := e.startWriters(writers, 0, perWriter, 40*time.Millisecond)
	rc.waitDistinct(writers*perWriter/4, 2*time.Minute)
	// Freeze A with its transaction open: one seen Ongoing may commit
	// before the signal lands, so check again once A is stopped, and thaw
	// and retry if it did.
	txnID := "walrelay-" + e.name
	for attempt := 1; ; attempt++ {
		e.waitTxnOngoing(txnID, 30*time.Second)
		if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		if st := e.txnState(txnID); st == "Ongoing" {
			break
		} else if attempt == 10 {
			t.Fatalf("10 times relay A's transaction was %s once A was frozen, not Ongoing", st)
		}
		_ = a.cmd.Process.Signal(syscall.SIGCONT)
	}
	bStarted := time.Now()
	b := startProc(t, nil, args...)
	// Relay B streaming the slot, after wal_sender_timeout.
	pidB := e.waitWalsender(pidA, 60*time.Second)
	e.waitFor("A's transaction no longer ongoing (B took the id)", 30*time.Second, func() (bool, error) {
		st := e.txnState(txnID)
		return st != "Ongoing", fmt.Errorf("transaction %s", st)
	})
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// What A says from the thaw on is its answer to losing the slot.
	thawed := len(a.out.String())
	const fencedMsg = "fenced: another relay took the slot"
	const restartMsg = "relay restarting from the last confirmed position"
	var ended string // the line that ended A's streaming session
	e.waitFor("relay A ending its session after losing the slot", 60*time.Second, func() (bool, error) {
		out := a.out.String()[thawed:]
		if exited(a) {
			return false, fmt.Errorf("relay A exited (%v), want it to become the standby: %s", a.err, lastLines(out, 3))
		}
		ended = grepLines(out, restartMsg, 1)
		return ended != "", fmt.Errorf("relay A's last lines:\n%s", lastLines(out, 3))
	})
	endedAfter := time.Since(bStarted)
	fenced := strings.Contains(a.out.String()[thawed:], fencedMsg)
	if apache == nil && !fenced {
		t.Fatalf("on kfake relay A must be told it was fenced before it restarts; it said:\n%s", ended)
	}
	if !fenced && !strings.Contains(ended, `"cause":"silent"`) && !strings.Contains(ended, `"cause":"connection"`) && !strings.Contains(ended, `"cause":"postgres"`) {
		t.Fatalf("relay A restarted neither fenced nor for the lost replication connection:\n%s", ended)
	}
	// Then A waits as the standby: it says so after the restart.
	e.waitFor("relay A waiting as the standby", 60*time.Second, func() (bool, error) {
		out := a.out.String()[thawed:]
		i := strings.Index(out, restartMsg)
		return strings.Contains(out[i:], "waiting as a standby"), fmt.Errorf("relay A's last lines:\n%s", lastLines(out, 3))
	})
	wr.wait(t)
	_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, a, "relay A (the standby)")
	checkRunning(t, b, "relay B")
	if i := e.slotInfo(); i.ActivePID == nil || *i.ActivePID != pidB {
		t.Errorf("slot streamed by walsender %v, want relay B's %d: the standby took it back", deref(i.ActivePID), pidB)
	}
	if strings.Contains(b.out.String(), "fenced") {
		t.Errorf("relay B reports being fenced:\n%s", grepLines(b.out.String(), "fenced", 3))
	}
	t.Logf("relay A restarted %s after B started (fenced: %v), then the standby: %s; %d events read exactly once",
		endedAfter.Round(time.Millisecond), fenced, ended, n)
}

// TestExactlyOnceSharedTransactionalID is the configuration error fencing
// still stops a relay for: relay X streams the outbox, relay Y another
// table's slot and publication (to topics the test does not read), both
// with the same --transactional-id and both with rows to deliver. Each
// takes the id when it starts streaming, fencing the other; a relay fenced
// while its own walsender still holds its slot would only take the id back
// by restarting, so one of them exits with code 3 and an error naming
// --transactional-id (which one depends on the broker: Apache Kafka 4.4 may
// answer the first fenced commit UNKNOWN_SERVER_ERROR, a restart, and the
// relay that restarts then fences the other), and neither takes itself for
// a relay that lost its slot. Restarted with an id of its own (the fix the
// error names), it resumes from its checkpoint: every committed outbox id is
// read exactly once read_committed, and both relays run.
func TestExactlyOnceSharedTransactionalID(t *testing.T) {
	e := newEnv(t)
	shared := "walrelay-shared-" + e.name
	e.sharedTransactionalID(shared, shared, nil)
}

// sharedTransactionalID is TestExactlyOnceSharedTransactionalID's run: relay
// X on the test's outbox with transactional id idX (and extraX), relay Y on
// another table with idY, where the two relays' ids overlap; it returns the
// output of the relay that exited.
func (e *env) sharedTransactionalID(idX, idY string, extraX []string) string {
	t := e.t
	nameY := e.name + "_y"
	e.exec(`CREATE TABLE outbox_y (LIKE outbox INCLUDING ALL)`)
	t.Cleanup(func() {
		// Registered before Y starts, so it runs after Y is killed: drop
		// Y's slot once its walsender is gone, or the database cannot be.
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, e.url)
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close(ctx)
		e.waitFor("slot "+nameY+" dropped", 30*time.Second, func() (bool, error) {
			if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", nameY); err != nil {
				return false, err
			}
			var left int
			err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", nameY).Scan(&left)
			return err == nil && left == 0, fmt.Errorf("slot %s still there (%v)", nameY, err)
		})
	})
	argsX := func(id string) []string { return e.eosArgs(append([]string{"--transactional-id", id}, extraX...)...) }
	argsY := func(id string) []string {
		return e.eosArgs("--transactional-id", id, "--slot", nameY, "--publication", nameY, "--table", "public.outbox_y",
			"--topic-template", "other-"+e.topicPrefix()+"{aggregate_type}", "--dead-letter-topic", "other-"+e.topicPrefix()+"dlq")
	}
	procs := [2]*proc{startProc(t, nil, argsX(idX)...)}
	rc := e.consumeIsolated(true)
	e.waitWalsender(0, 60*time.Second)

	// Both tables get a row every 20 ms until the end: each relay keeps
	// committing Kafka transactions, so whichever was fenced notices.
	stopX := pacedInserts(e, "outbox", "w", 20*time.Millisecond)
	defer stopX()
	rc.waitDistinct(100, 2*time.Minute)
	stopY := pacedInserts(e, "outbox_y", "y", 20*time.Millisecond)
	defer stopY()
	procs[1] = startProc(t, nil, argsY(idY)...)

	gone := -1
	e.waitFor("one of the two relays sharing a transactional id exiting", 2*time.Minute, func() (bool, error) {
		for i, p := range procs {
			if exited(p) {
				gone = i
				return true, nil
			}
		}
		return false, errors.New("both relays still run")
	})
	name := [2]string{"X", "Y"}[gone]
	code, _, _ := procs[gone].wait(time.Second)
	out := procs[gone].out.String()
	if code != 3 {
		t.Errorf("relay %s exited with code %d, want 3; its last lines:\n%s", name, code, lastLines(out, 3))
	}
	if !strings.Contains(out, "--transactional-id") {
		t.Errorf("relay %s's error does not name --transactional-id; its last lines:\n%s", name, lastLines(out, 3))
	}
	for i, p := range procs {
		if strings.Contains(p.out.String(), "another relay took the slot") {
			t.Errorf("relay %s took itself for a relay that lost its slot:\n%s", [2]string{"X", "Y"}[i], grepLines(p.out.String(), "fenced", 2))
		}
	}
	checkRunning(t, procs[1-gone], "the other relay")
	if gone == 0 {
		procs[0] = startProc(t, nil, argsX("walrelay-x-"+e.name)...)
	} else {
		procs[1] = startProc(t, nil, argsY("walrelay-y-"+e.name)...)
	}
	rc.waitDistinct(rc.distinct()+100, 2*time.Minute) // the restarted relay delivers
	stopX()
	_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, procs[0], "relay X")
	checkRunning(t, procs[1], "relay Y")
	t.Logf("relay %s exited %d: %s; restarted with its own id; %d outbox events read exactly once", name, code, grepLines(out, "--transactional-id", 1), n)
	return out
}

// pacedInserts inserts a row into table (aggregate type aggType, keys
// k0..k9) every pause until the returned stop is called; stop waits for
// the writer and fails the test if an insert failed.
func pacedInserts(e *env, table, aggType string, pause time.Duration) (stop func()) {
	quit := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		conn, err := pgx.Connect(e.ctx, e.url)
		if err != nil {
			done <- err
			return
		}
		defer conn.Close(context.Background())
		t := time.NewTicker(pause)
		defer t.Stop()
		for i := 0; ; i++ {
			select {
			case <-quit:
				done <- nil
				return
			case <-t.C:
			}
			_, err := conn.Exec(e.ctx, `INSERT INTO `+pgx.Identifier{table}.Sanitize()+` (aggregate_type, aggregate_id, type, payload, seq)
				VALUES ($1, 'k' || ($2::int % 10), 'T', '{}', $2)`, aggType, i)
			if err != nil {
				done <- fmt.Errorf("insert into %s: %w", table, err)
				return
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(quit)
			if err := <-done; err != nil {
				e.t.Error(err)
			}
		})
	}
}

// TestReadUncommittedSeesAborted shows what the transactions are for:
// with long Kafka transactions (--txn-max-interval and --txn-min-interval
// 20s, --txn-max-events 100000; long enough for Apache Kafka on a loaded machine) 200 events
// are written to an open transaction, the relay is SIGKILLed once a
// read_uncommitted consumer has read them and while the transaction is
// still open (DescribeTransactions: Ongoing; read_committed has read
// none), then restarted with the default interval. The restarted relay
// fences the dead one's transaction (aborted) and sends the events again:
// the read_uncommitted consumer reads every id twice (the aborted copy and
// the committed one) while the read_committed consumer reads each once.
func TestReadUncommittedSeesAborted(t *testing.T) {
	e := newEnv(t)
	args := e.eosArgs("--txn-max-interval", "20s", "--txn-min-interval", "20s", "--txn-max-events", "100000")
	p := startProc(t, nil, args...)
	rc := e.consumeIsolated(true)
	ru := e.consumeIsolated(false)
	e.waitSlotStreamed(60 * time.Second)

	const events = 200
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'w', 'k' || (g % 10), 'T', jsonb_build_object('seq', g), g FROM generate_series(1, $1) g`, events)
	err := devcluster.WaitFor(30*time.Second, 10*time.Millisecond, func() (bool, error) {
		n := ru.distinct()
		return n >= events, fmt.Errorf("read_uncommitted read %d of %d ids", n, events)
	})
	if err != nil {
		t.Fatal(err)
	}
	state := e.txnState("walrelay-" + e.name)
	seenCommitted := rc.distinct()
	kill9(p)
	if state != "Ongoing" || seenCommitted != 0 {
		t.Fatalf("at the kill the relay's Kafka transaction was %q and read_committed had read %d ids: the kill did not hit an open transaction", state, seenCommitted)
	}
	p = startProc(t, nil, e.eosArgs()...)

	e.deliveredExactlyOnce(rc, 60*time.Second)
	checkRunning(t, p, "the restarted relay")
	ids, extra := ru.duplicates()
	if ids == 0 {
		t.Fatalf("read_uncommitted read no id twice (%d records): the aborted copies are missing", len(ru.records()))
	}
	t.Logf("read_uncommitted: %d records, %d ids read twice or more (%d aborted copies); read_committed: %d records, each id once",
		len(ru.records()), ids, extra, len(rc.records()))
}

// TestExactlyOnceInProcessDefaultTxnTimeout runs the relay in-process
// (the relay package, as the harness and library users do) with
// exactly-once delivery and the documented default transaction timeout
// (router.Config.TransactionTimeout zero: "Default 60s"): one event must
// be read read_committed within 30 seconds.
func TestExactlyOnceInProcessDefaultTxnTimeout(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.ExactlyOnce = true
	cfg.Router.CheckpointTopic = e.checkpointTopic()
	rr, reg := e.startRelayGathered(cfg)
	rc := e.consumeIsolated(true)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'k', 'T', '{"seq": 0}', 0)`)
	err := devcluster.WaitFor(30*time.Second, 50*time.Millisecond, func() (bool, error) {
		return rc.distinct() == 1, fmt.Errorf("%d ids read", rc.distinct())
	})
	if err != nil {
		ok, runErr := rr.returned()
		t.Fatalf("with the default transaction timeout nothing was delivered: %v (Run returned %v %v; stream restarts %v, kafka transactions %v)",
			err, ok, runErr, gathered(reg, "walrelay_stream_restarts_total"), gathered(reg, "walrelay_kafka_transactions_total"))
	}
}

// TestExactlyOnceTransactionTimeout lets the broker time a Kafka
// transaction out: with --txn-timeout 2s, one produce request of the
// relay's transactional producer is held by the broker for 5 seconds while
// 8 writers keep writing, so the broker aborts the open transaction and
// bumps the producer's epoch. The relay must take that as an aborted
// transaction, not as fencing by another relay: it keeps running, retries
// from the last checkpoint, and every committed id is read exactly once
// read_committed, per key in commit order.
func TestExactlyOnceTransactionTimeout(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	p := startProc(t, nil, e.eosArgs("--txn-timeout", "2s")...)
	rc := e.consumeIsolated(true)
	ru := e.consumeIsolated(false)
	e.waitSlotStreamed(60 * time.Second)

	const writers, perWriter = 8, 300
	wr := e.startWriters(writers, 0, perWriter, 40*time.Millisecond)
	rc.waitDistinct(writers*perWriter/4, time.Minute)
	var held atomic.Bool
	heldAt := make(chan time.Time, 1)
	e.kafka.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if p, ok := req.(*kmsg.ProduceRequest); ok && p.TransactionID != nil && held.CompareAndSwap(false, true) {
			heldAt <- time.Now()
			// The fault: hold the produce past the 2s transaction
			// timeout, which runs on the broker's own clock.
			e.kafka.SleepControl(func() { time.Sleep(5 * time.Second) })
			e.kafka.DropControl()
		}
		return nil, nil, false
	})
	var since time.Time
	select {
	case since = <-heldAt:
	case <-time.After(30 * time.Second):
		t.Fatal("no transactional produce request within 30s")
	}
	wr.wait(t)
	_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, p, "the relay, after a Kafka transaction timed out,")
	ruIDs, ruExtra := ru.duplicates()
	t.Logf("produce held at %s for 5s; %d events read exactly once; read_uncommitted saw %d ids twice or more (%d aborted copies); relay warnings:\n%s",
		since.Format("15:04:05.000"), n, ruIDs, ruExtra, grepLines(p.out.String(), `"level":"warn"`, 6))
}

// TestExactlyOnceAbortedTransaction makes the broker refuse, for good,
// one produce request of the relay's open Kafka transaction
// (INVALID_RECORD) while 8 writers run: the relay aborts the transaction
// (a read_uncommitted consumer sees what of it had reached the log),
// replaces its producer, resumes from the last checkpoint, and every
// committed id is read exactly once read_committed, per key in commit
// order; the relay keeps running.
func TestExactlyOnceAbortedTransaction(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	p := startProc(t, nil, e.eosArgs("--txn-max-interval", "500ms")...)
	rc := e.consumeIsolated(true)
	ru := e.consumeIsolated(false)
	e.waitSlotStreamed(60 * time.Second)

	const writers, perWriter = 8, 300
	wr := e.startWriters(writers, 0, perWriter, 40*time.Millisecond)
	rc.waitDistinct(writers*perWriter/4, time.Minute)
	// Refuse a produce request once read_uncommitted shows the open
	// transaction has records in the log, so the abort has something to
	// hide.
	e.waitFor("records of an open transaction in the log", 30*time.Second, func() (bool, error) {
		return ru.distinct() > rc.distinct(), nil
	})
	fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: e.topic("w"), Err: kerr.InvalidRecord, Count: 1})
	e.waitFor("the fault hit", 30*time.Second, func() (bool, error) { return fault.Hits() > 0, nil })
	wr.wait(t)
	_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, p, "the relay, after an aborted Kafka transaction,")
	ruIDs, ruExtra := ru.duplicates()
	t.Logf("%d events read exactly once; read_uncommitted saw %d ids twice or more (%d aborted copies); relay warnings:\n%s",
		n, ruIDs, ruExtra, grepLines(p.out.String(), `"level":"warn"`, 4))
}

// TestExactlyOnceConfirmAfterCommit holds every Kafka commit back (the
// broker answers EndTxn with COORDINATOR_LOAD_IN_PROGRESS, which the
// producer retries) while events are written and other tables keep the
// walsender sending keepalives: the records reach the log (a
// read_uncommitted consumer reads them) but no Kafka transaction commits,
// so confirmed_flush_lsn must stay below the end of the first transaction
// written after the hold began, and read_committed must read nothing new.
// Once commits go through, every id is read exactly once read_committed
// and the slot moves past the end.
func TestExactlyOnceConfirmAfterCommit(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	e.exec(`CREATE TABLE noise (id bigserial PRIMARY KEY, v text)`)
	p := startProc(t, nil, e.eosArgs()...)
	rc := e.consumeIsolated(true)
	ru := e.consumeIsolated(false)
	e.waitSlotStreamed(60 * time.Second)
	conn := e.conn()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'k', 'T', '{"seq": 0}', 0)`)
	first := e.currentLSN(conn)
	e.waitFor("first event read and confirmed", 30*time.Second, func() (bool, error) {
		return rc.distinct() == 1 && e.slotInfo().ConfirmedLSN >= first, nil
	})

	fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.EndTxn}, Err: kerr.CoordinatorLoadInProgress, Count: -1})
	var bound decoder.LSN // at or after the end of the first transaction written during the hold
	for i := 1; i <= 20; i++ {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'k', 'T', jsonb_build_object('seq', $1::int), $1)`, i)
		if i == 1 {
			bound = e.currentLSN(conn)
		}
	}
	// The relay waits for its commit while still answering PostgreSQL
	// (it reads no more events meanwhile): the first event written during
	// the hold is in the log, uncommitted.
	e.waitFor("a held record in the log", 30*time.Second, func() (bool, error) {
		return ru.distinct() >= 2, fmt.Errorf("read_uncommitted read %d ids", ru.distinct())
	})
	maxConfirmed := e.writeNoiseFor(conn, 5*time.Second)
	heldCommitted, heldUncommitted := rc.distinct(), ru.distinct()
	hits := fault.Hits()
	fault.Remove()
	if hits == 0 {
		t.Fatal("no EndTxn request reached the broker during the hold: the scenario did not happen")
	}
	if maxConfirmed >= bound {
		t.Errorf("confirmed_flush_lsn reached %s while no Kafka transaction could commit; the first transaction written then ends before %s", maxConfirmed, bound)
	}
	if heldCommitted != 1 {
		t.Errorf("read_committed read %d ids while no Kafka transaction could commit, want 1", heldCommitted)
	}
	e.deliveredExactlyOnce(rc, time.Minute)
	checkRunning(t, p, "the relay")
	t.Logf("during the hold: %d EndTxn requests refused, confirmed_flush_lsn at most %s (bound %s), read_uncommitted %d ids, read_committed %d",
		hits, maxConfirmed, bound, heldUncommitted, heldCommitted)
}

// TestExactlyOnceSigterm stops the relay binary with SIGTERM in the middle
// of a run of 8 writers: it commits its open Kafka transaction (with a
// checkpoint saying how far it reaches, partial or not) and exits 0; a
// restarted relay sends nothing twice: every id is read exactly once
// read_committed, per key in commit order.
func TestExactlyOnceSigterm(t *testing.T) {
	e := newEnv(t)
	args := e.eosArgs()
	p := startProc(t, nil, args...)
	rc := e.consumeIsolated(true)
	e.waitSlotStreamed(60 * time.Second)
	const writers, perWriter = 8, 500
	wr := e.startWriters(writers, 0, perWriter, 20*time.Millisecond)
	for _, frac := range []int{4, 2} {
		rc.waitDistinct(writers*perWriter/frac, time.Minute)
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if code, _, ok := p.wait(60 * time.Second); !ok || code != 0 {
			t.Fatalf("after SIGTERM the relay exited with code %d (in time: %v), want 0:\n%s", code, ok, lastLines(p.out.String(), 3))
		}
		p = startProc(t, nil, args...)
		// The next SIGTERM must find a relay that handles it: one still
		// starting dies of it (on Apache Kafka the readers are at the next
		// mark before the restarted relay streams).
		e.waitStreaming(p)
	}
	wr.wait(t)
	_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, p, "the restarted relay")
	t.Logf("2 SIGTERMs; %d events read exactly once", n)
}

// TestExactlyOnceCommitAfterBrokerTimeout delays one commit request
// (EndTxn) of the relay by 1.5 seconds, as a slow network or broker can,
// with --txn-timeout 2s and --txn-max-interval 1s: the broker times the
// transaction out while the commit is on its way (1s + 1.5s > 2s), so the
// commit fails; the relay must take that for a timeout, not for fencing
// (it has been open longer than the timeout). The relay must retry from the last checkpoint: the
// event of the timed-out transaction and one written afterwards are read
// exactly once within 30 seconds, and the relay keeps running.
func TestExactlyOnceCommitAfterBrokerTimeout(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	p := startProc(t, nil, e.eosArgs("--txn-timeout", "2s", "--txn-max-interval", "1s", "--txn-min-interval", "1s")...)
	rc := e.consumeIsolated(true)
	e.waitSlotStreamed(60 * time.Second)
	insert := func(seq int) {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'k', 'T', jsonb_build_object('seq', $1::int), $1)`, seq)
	}
	insert(0)
	e.waitFor("first event", 30*time.Second, func() (bool, error) { return rc.distinct() == 1, nil })

	txnID := "walrelay-" + e.name
	var held atomic.Bool
	released := make(chan struct{})
	e.kafka.ControlKey(int16(kmsg.EndTxn), func(req kmsg.Request) (kmsg.Response, error, bool) {
		// Either producer's (--txn-producers 2 commits as <id>-1 in turn).
		if r, ok := req.(*kmsg.EndTxnRequest); ok && r.Commit && (r.TransactionalID == txnID || r.TransactionalID == txnID+"-1") && held.CompareAndSwap(false, true) {
			// The fault: hold the commit past the transaction timeout,
			// which runs on the broker's own clock.
			e.kafka.SleepControl(func() { time.Sleep(1500 * time.Millisecond) })
			close(released)
			e.kafka.DropControl()
		}
		return nil, nil, false
	})
	insert(1)
	select {
	case <-released:
	case <-time.After(30 * time.Second):
		t.Fatal("no commit request within 30s")
	}
	insert(2)
	conn := e.conn()
	want, _ := committedRows(t, e, conn)
	err := devcluster.WaitFor(30*time.Second, 100*time.Millisecond, func() (bool, error) {
		return rc.distinct() == 3, fmt.Errorf("%d of 3 ids read", rc.distinct())
	})
	if err != nil {
		t.Fatalf("after a commit the broker had timed out: %v; relay warnings:\n%s", err, grepLines(p.out.String(), `"level":"warn"`, 3))
	}
	e.settle(e.currentLSN(conn), rc)
	e.checkExactlyOnce(rc.records(), want)
	checkRunning(t, p, "the relay")
	failed := grepLines(p.out.String(), "commit Kafka transaction", 1)
	if failed == "" {
		t.Fatalf("no commit failed: the broker did not time the transaction out, the scenario did not happen; relay warnings:\n%s", grepLines(p.out.String(), `"level":"warn"`, 3))
	}
	if strings.Contains(p.out.String(), "fenced") {
		t.Errorf("the relay, running alone, took the timed-out transaction for fencing:\n%s", grepLines(p.out.String(), "fenced", 1))
	}
	t.Logf("the commit failed: %s", failed)
}

// TestExactlyOnceTimeoutIsNotFencing runs the relay alone with a Kafka
// transaction timeout shorter than its commit interval (--txn-timeout 1s
// --txn-max-interval 3s), so the broker times out every transaction. No
// other relay exists: the relay must not stop claiming it was fenced
// (exit code 3). Acceptable: refusing the flags at startup (exit code
// other than 0 and 3, naming --txn-timeout), or retrying and delivering.
func TestExactlyOnceTimeoutIsNotFencing(t *testing.T) {
	e := newEnv(t)
	p := startProc(t, nil, e.eosArgs("--txn-timeout", "1s", "--txn-max-interval", "3s")...)
	rc := e.consumeIsolated(true)
	select {
	case <-p.done:
		code, _, _ := p.wait(time.Second)
		if code == 0 || code == 3 || !strings.Contains(p.out.String(), "txn-timeout") {
			t.Fatalf("the relay exited at startup with code %d without naming --txn-timeout:\n%s", code, lastLines(p.out.String(), 3))
		}
		return // refused the flags: fine
	case <-time.After(5 * time.Second):
	}
	e.waitSlotStreamed(60 * time.Second)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'k', 'T', '{"seq": 0}', 0)`)
	err := devcluster.WaitFor(30*time.Second, 100*time.Millisecond, func() (bool, error) {
		if exited(p) {
			return false, fmt.Errorf("the relay exited")
		}
		return rc.distinct() == 1, fmt.Errorf("%d ids read", rc.distinct())
	})
	if exited(p) {
		code, _, _ := p.wait(time.Second)
		t.Fatalf("the relay, running alone, exited with code %d after its Kafka transaction timed out:\n%s", code, grepLines(p.out.String(), "fenced", 1))
	}
	if err != nil {
		t.Fatalf("nothing delivered: %v", err)
	}
}

// TestExactlyOnceSigtermUnderBackpressure stops the relay with SIGTERM
// while it waits for room to send the next event of a PostgreSQL
// transaction (--max-inflight-events 5 and a broker that refuses
// produce requests, retriably, until just after the signal): the relay
// commits its open Kafka transaction on the clean stop, with a partial
// checkpoint, and exits 0. A restarted relay must deliver the rest of the
// transaction: all 20 rows (and the warm-up row) are read exactly once.
func TestExactlyOnceSigtermUnderBackpressure(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	args := e.eosArgs("--max-inflight-events", "5", "--txn-max-interval", "1s")
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", port)
	p := startProc(t, nil, withFlag(args, "--metrics-addr", metricsAddr)...)
	rc := e.consumeIsolated(true)
	ckc := e.newEOSConsumer(true, "^"+regexp.QuoteMeta(e.checkpointTopic())+"$")
	e.waitSlotStreamed(60 * time.Second)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'k', 'T', '{"seq": 0}', 0)`)
	e.waitFor("the warm-up event", 30*time.Second, func() (bool, error) { return rc.distinct() == 1, nil })

	// The fault notes a refused produce request that carries the
	// checkpoint topic (by name or, in newer requests, by id): the relay is
	// committing its Kafka transaction.
	ckTopic := e.checkpointTopic()
	ckID := e.topicID(ckTopic)
	var committing atomic.Bool
	fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1,
		When: func(req kmsg.Request) bool {
			for _, tp := range req.(*kmsg.ProduceRequest).Topics {
				if tp.Topic == ckTopic || tp.TopicID == ckID {
					committing.Store(true)
				}
			}
			return true
		}})
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'w', 'k', 'T', jsonb_build_object('seq', g), g FROM generate_series(1, 20) g`)
	e.waitFor("produce requests refused", 30*time.Second, func() (bool, error) { return fault.Hits() > 0, nil })
	e.waitFor("5 events in flight, the 6th waiting for room", 30*time.Second, func() (bool, error) {
		n, err := scrapeMetric(metricsAddr, "walrelay_inflight_events")
		return n == 5, fmt.Errorf("walrelay_inflight_events %v (%v)", n, err)
	})
	if committing.Load() {
		t.Fatal("the relay sent its checkpoint before the stop: it was not waiting for room in its transaction")
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	e.waitFor("the relay committing its Kafka transaction after SIGTERM", 30*time.Second, func() (bool, error) {
		return committing.Load(), nil
	})
	fault.Remove()
	if code, _, ok := p.wait(60 * time.Second); !ok || code != 0 {
		t.Fatalf("after SIGTERM the relay exited with code %d (in time: %v), want 0:\n%s", code, ok, lastLines(p.out.String(), 3))
	}
	e.fence("", ckc, rc) // the partial checkpoint and its events are read by now
	var ck string
	if ds := ckc.durables(t, e.name); len(ds) > 0 && ds[len(ds)-1].Partial != nil {
		ck = fmt.Sprintf("partial checkpoint at the stop: %d events of the transaction; read_committed read %d of them", ds[len(ds)-1].Partial.Events, rc.distinct()-1)
	}
	p = startProc(t, nil, args...)
	conn := e.conn()
	want, _ := committedRows(t, e, conn)
	end := e.currentLSN(conn)
	err = devcluster.WaitFor(30*time.Second, 100*time.Millisecond, func() (bool, error) {
		missing := []string{}
		got := map[string]bool{}
		for _, r := range rc.records() {
			id, _ := header(r, "id")
			got[id] = true
		}
		rows, err := conn.Query(e.ctx, `SELECT id::text, seq FROM outbox ORDER BY seq`)
		if err != nil {
			return false, err
		}
		defer rows.Close()
		for rows.Next() {
			var id string
			var seq int
			if err := rows.Scan(&id, &seq); err != nil {
				return false, err
			}
			if !got[id] {
				missing = append(missing, fmt.Sprintf("seq %d", seq))
			}
		}
		return len(missing) == 0, fmt.Errorf("not delivered: %v", missing)
	})
	if err != nil {
		t.Fatalf("after a SIGTERM under backpressure and a restart (%s): %v", ck, err)
	}
	e.settle(end, rc)
	e.checkExactlyOnce(rc.records(), want)
	checkRunning(t, p, "the restarted relay")
	t.Log(ck)
}

// ---- helpers ----

// checkpointTopic is the test's checkpoint topic, under its prefix.
func (e *env) checkpointTopic() string { return e.topicPrefix() + "checkpoints" }

// eosArgs are e.args() with exactly-once delivery, the test's checkpoint
// topic, and extra (later flags win).
func (e *env) eosArgs(extra ...string) []string {
	a := append(e.args(), "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic())
	return append(a, extra...)
}

// waitWalsender waits until a walsender other than PID other (0: any)
// streams the test's slot, and returns its PID. The slot's active_pid alone
// does not say that: while an initial snapshot creates the slot, it names
// for a moment the normal backend that copies it, then (PostgreSQL 17+) the
// walsender that runs ALTER_REPLICATION_SLOT on it, which never streams;
// only a walsender past START_REPLICATION is catching up or streaming in
// pg_stat_replication.
func (e *env) waitWalsender(other int32, timeout time.Duration) int32 {
	e.t.Helper()
	var pid int32
	e.waitFor("a walsender streaming the slot", timeout, func() (bool, error) {
		c, err := pgx.Connect(e.ctx, e.url)
		if err != nil {
			return false, err
		}
		defer c.Close(context.Background())
		err = c.QueryRow(e.ctx, `SELECT s.active_pid FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
			WHERE s.slot_name = $1 AND r.state IN ('catchup', 'streaming')`, e.name).Scan(&pid)
		if errors.Is(err, pgx.ErrNoRows) {
			return false, errors.New("no walsender streams the slot")
		}
		if err != nil {
			return false, err
		}
		return pid != other, fmt.Errorf("walsender %d streams the slot", pid)
	})
	return pid
}

// waitSlotStreamed waits until a walsender streams the test's slot.
func (e *env) waitSlotStreamed(timeout time.Duration) {
	e.t.Helper()
	e.waitFor("slot active", timeout, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
}

// settle waits until the slot is confirmed at or past end (with
// exactly-once delivery that means every transaction before it is in a
// committed Kafka transaction), then until the consumers have read
// everything written so far (a fence): a late duplicate would be read by
// then.
func (e *env) settle(end decoder.LSN, cs ...*eosConsumer) {
	e.t.Helper()
	e.waitFor("slot confirmed past the end of the writes", 90*time.Second, func() (bool, error) {
		got := e.slotInfo().ConfirmedLSN
		return got >= end, fmt.Errorf("confirmed %s, want >= %s", got, end)
	})
	fenced := make([]interface{ fences() *fenceSeen }, len(cs))
	for i, c := range cs {
		fenced[i] = c
	}
	e.fence("", fenced...)
}

// deliveredExactlyOnce waits until rc has read every outbox row committed
// so far and the slot is confirmed past the end of the writes, then fails
// the test unless each row was read exactly once, per key in commit order.
// It returns the records read and the number of rows.
func (e *env) deliveredExactlyOnce(rc *eosConsumer, timeout time.Duration) ([]*kgo.Record, int) {
	e.t.Helper()
	conn := e.conn()
	want, n := committedRows(e.t, e, conn)
	end := e.currentLSN(conn)
	rc.waitAll(want, timeout)
	e.settle(end, rc)
	recs := rc.records()
	e.checkExactlyOnce(recs, want)
	return recs, n
}

// checkExactlyOnce fails the test unless recs hold exactly the ids of want
// (key → ids in commit order), each exactly once, per key in commit order.
func (e *env) checkExactlyOnce(recs []*kgo.Record, want map[string][]string) {
	e.t.Helper()
	dups := checkDelivered(e.t, recs, want, nil)
	if dups == 0 {
		return
	}
	where := map[string][]string{}
	for _, r := range recs {
		id, _ := header(r, "id")
		where[id] = append(where[id], fmt.Sprintf("%s/%d@%d", r.Topic, r.Partition, r.Offset))
	}
	var ex []string
	for id, at := range where {
		if len(at) > 1 && len(ex) < 5 {
			ex = append(ex, fmt.Sprintf("%s at %s", id, strings.Join(at, ", ")))
		}
	}
	sort.Strings(ex)
	e.t.Errorf("read_committed read %d duplicate records (exactly-once allows none), e.g.\n  %s", dups, strings.Join(ex, "\n  "))
}

// eosConsumer reads every topic of the test from the start with one
// isolation level, keeping the checkpoint topic (checkpoints and probes)
// apart from the event records, and counting copies per id as it goes.
type eosConsumer struct {
	e      *env
	mu     sync.Mutex
	recs   []*kgo.Record // event topics (and the dead-letter topic)
	ckpts  []*kgo.Record // the checkpoint topic
	count  map[string]int
	fenced *fenceSeen
}

// consumeIsolated starts a read_committed (committed true) or
// read_uncommitted consumer of every topic of the test.
func (e *env) consumeIsolated(committed bool) *eosConsumer {
	e.t.Helper()
	return e.newEOSConsumer(committed, "^"+regexp.QuoteMeta(e.topicPrefix())+".*")
}

// newEOSConsumer is consumeIsolated for the topics matching topicRegex.
func (e *env) newEOSConsumer(committed bool, topicRegex string) *eosConsumer {
	e.t.Helper()
	level := kgo.ReadUncommitted()
	if committed {
		level = kgo.ReadCommitted()
	}
	c := &eosConsumer{e: e, count: map[string]int{}, fenced: newFenceSeen(topicRegex)}
	ckTopic := e.checkpointTopic()
	e.poll(func(fs kgo.Fetches) {
		c.mu.Lock()
		defer c.mu.Unlock()
		fs.EachRecord(func(r *kgo.Record) {
			if c.fenced.take(r) {
				return
			}
			if r.Topic == ckTopic {
				c.ckpts = append(c.ckpts, r)
				return
			}
			c.recs = append(c.recs, r)
			if id, ok := header(r, "id"); ok {
				c.count[id]++
			}
		})
	}, kgo.ConsumeTopics(topicRegex), kgo.FetchIsolationLevel(level))
	return c
}

// records returns the event records read so far.
func (c *eosConsumer) records() []*kgo.Record {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*kgo.Record(nil), c.recs...)
}

// checkpoints returns the checkpoint topic's records read so far.
func (c *eosConsumer) checkpoints() []*kgo.Record {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*kgo.Record(nil), c.ckpts...)
}

// durables decodes the checkpoints of slot read so far, oldest first
// (probe records are skipped).
func (c *eosConsumer) durables(t *testing.T, slotName string) []checkpoint.Durable {
	t.Helper()
	var ds []checkpoint.Durable
	for _, r := range c.checkpoints() {
		if string(r.Key) != slotName {
			continue
		}
		d, err := checkpoint.UnmarshalDurable(r.Value)
		if err != nil {
			t.Fatalf("checkpoint record at offset %d: %v: %s", r.Offset, err, r.Value)
		}
		if d.Slot != slotName {
			t.Errorf("checkpoint record at offset %d names slot %q, its key %q", r.Offset, d.Slot, r.Key)
		}
		ds = append(ds, d)
	}
	return ds
}

// distinct is how many distinct ids were read.
func (c *eosConsumer) distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.count)
}

// duplicates is how many ids were read more than once, and how many
// copies beyond the first there were.
func (c *eosConsumer) duplicates() (ids, extra int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range c.count {
		if n > 1 {
			ids++
			extra += n - 1
		}
	}
	return ids, extra
}

// waitDistinct waits until n distinct ids were read.
func (c *eosConsumer) waitDistinct(n int, timeout time.Duration) {
	c.e.t.Helper()
	waitDistinctIDs(c.e.t, c.idsRead, n, timeout)
}

// waitAll waits until every id of want (key → ids) was read.
func (c *eosConsumer) waitAll(want map[string][]string, timeout time.Duration) {
	c.e.t.Helper()
	waitEveryID(c.e.t, c.idsRead, flatIDs(want), timeout)
}

// idsRead is a copy of what was read: each id with its number of copies.
func (c *eosConsumer) idsRead() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.count)
}

// txnState is the broker's state of a transactional id ("Ongoing",
// "Empty", ...), or the error in brackets.
func (e *env) txnState(txnID string) string {
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		return "[" + err.Error() + "]"
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
	defer cancel()
	ds, err := kadm.NewClient(cl).DescribeTransactions(ctx, txnID)
	if err != nil {
		return "[" + err.Error() + "]"
	}
	d, ok := ds[txnID]
	if !ok {
		return "[not described]"
	}
	if d.Err != nil {
		return "[" + d.Err.Error() + "]"
	}
	return d.State
}

// waitTxnOngoing waits until the broker has a transaction of txnID open.
func (e *env) waitTxnOngoing(txnID string, timeout time.Duration) string {
	e.t.Helper()
	var state string
	e.waitFor("an open Kafka transaction", timeout, func() (bool, error) {
		state = e.txnState(txnID)
		return state == "Ongoing", fmt.Errorf("transaction state %s", state)
	})
	return state
}

// exited reports whether the binary has exited.
func exited(p *proc) bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill9 SIGKILLs the binary and waits for it to be gone.
func kill9(p *proc) {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// checkRunning fails the test if the binary exited.
func checkRunning(t *testing.T, p *proc, what string) {
	t.Helper()
	if exited(p) {
		t.Errorf("%s exited (%v); its last lines:\n%s", what, p.err, lastLines(p.out.String(), 3))
	}
}

// grepLines returns up to n lines of s containing sub.
func grepLines(s, sub string, n int) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) && len(out) < n {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
