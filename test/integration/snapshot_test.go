package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/relay"
)

// insertSeq inserts rows seq from..to (inclusive) in one transaction, keys
// <prefix>-0..<prefix>-9, the seq in the payload and the seq column.
func insertSeq(e *env, prefix string, from, to int) {
	e.t.Helper()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'w', $1 || '-' || (s % 10), 'T', jsonb_build_object('seq', s), s FROM generate_series($2::int, $3::int) s`,
		prefix, from, to)
}

// tableIDs returns the ids of every row of the outbox table.
func tableIDs(e *env) []string {
	e.t.Helper()
	rows, err := e.conn().Query(e.ctx, `SELECT id::text FROM outbox`)
	if err != nil {
		e.t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		e.t.Fatal(err)
	}
	return ids
}

// checkEachOnce fails the test unless recs hold every id of want exactly
// once and nothing else.
func checkEachOnce(t *testing.T, recs []*kgo.Record, want []string) {
	t.Helper()
	got := distinctIDs(recs)
	missing, dups := 0, 0
	for _, id := range want {
		switch got[id] {
		case 0:
			missing++
		case 1:
		default:
			dups++
		}
	}
	if missing > 0 || dups > 0 || len(got) != len(want) {
		t.Errorf("%d rows in the table, %d distinct ids read: %d missing, %d read more than once", len(want), len(got), missing, dups)
	}
}

// startLoopWriters starts n writers inserting one-row transactions (keys
// <prefix><w>-0..9, seq increasing per writer) until stop is called; stop
// waits for them and returns how many rows they committed.
func startLoopWriters(e *env, prefix string, n int) (rows *atomic.Int64, stop func() int64) {
	rows = &atomic.Int64{}
	var quit atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for w := range n {
		wg.Go(func() {
			conn, err := pgx.Connect(e.ctx, e.url)
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close(context.Background())
			for seq := w * 1_000_000; !quit.Load(); seq++ {
				_, err := conn.Exec(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
					VALUES ('w', $1, 'T', jsonb_build_object('seq', $2::int), $2)`, fmt.Sprintf("%s%d-%d", prefix, w, seq%10), seq)
				if err != nil {
					errs <- err
					return
				}
				rows.Add(1)
			}
		})
	}
	return rows, func() int64 {
		quit.Store(true)
		wg.Wait()
		close(errs)
		for err := range errs {
			e.t.Fatal(err)
		}
		return rows.Load()
	}
}

// TestInitialSnapshotBeforeDuringAfter: rows committed before the relay
// first starts, rows committed by concurrent writers while it creates the
// slot and snapshots, and rows committed after it streams all arrive,
// each exactly once (at-least-once delivery, no kills), in per-key commit
// order with --snapshot-order seq. The snapshot read some of the writers'
// rows (they were committing while the slot was created) and not all of
// them, and no temporary slot is left behind.
func TestInitialSnapshotBeforeDuringAfter(t *testing.T) {
	e := newEnv(t)
	c := e.consume()
	insertSeq(e, "pre", 0, 999)
	written, stopWriters := startLoopWriters(e, "during", 4)
	e.waitFor("writers committing", 30*time.Second, func() (bool, error) { return written.Load() >= 50, nil })

	cfg := e.config()
	cfg.InitialSnapshot = true
	cfg.SnapshotOrder = "seq"
	began := time.Now()
	_, reg := e.startRelayGathered(cfg)
	streamingAfter := time.Since(began)
	atStream := written.Load()
	e.waitFor("writers committing after the stream started", 30*time.Second, func() (bool, error) {
		return written.Load() >= atStream+200, nil
	})
	during := stopWriters()
	insertSeq(e, "post", 0, 299)

	want := tableIDs(e)
	recs := c.waitIDs(len(want), 2*time.Minute)
	checkEachOnce(t, recs, want)
	if dups := checkPerKeyOrder(t, recs); dups != 0 {
		t.Errorf("%d duplicates", dups)
	}
	snapRows := gathered(reg, "walrelay_snapshot_rows_total")[""]
	if snapRows <= 1000 || snapRows >= float64(1000+during) {
		t.Errorf("the snapshot read %v rows: want more than the 1000 committed before the start (writers committed while the slot was created) and fewer than those plus the writers' %d", snapRows, during)
	}
	if running := gathered(reg, "walrelay_snapshot_running")[""]; running != 0 {
		t.Errorf("walrelay_snapshot_running is %v after the snapshot", running)
	}
	e.waitFor("temporary slot gone", 30*time.Second, func() (bool, error) {
		var n int
		if err := e.conn().QueryRow(e.ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'walrelay_snapshot_%' AND database = current_database()`).Scan(&n); err != nil {
			return false, err
		}
		return n == 0, fmt.Errorf("%d temporary slots", n)
	})
	t.Logf("streaming %s after start; snapshot %v rows; %d rows by concurrent writers; %d ids read once each", streamingAfter.Round(time.Millisecond), snapRows, during, len(want))
}

// TestInitialSnapshotNever: with --snapshot never (InitialSnapshot false)
// rows committed before the slot exists are not published; later ones
// are. The snapshot would have been published before any streamed row, so
// once the later rows arrived, the earlier ones' absence is final.
func TestInitialSnapshotNever(t *testing.T) {
	e := newEnv(t)
	c := e.consume()
	insertSeq(e, "pre", 0, 49)
	before := tableIDs(e)
	cfg := e.config()
	cfg.InitialSnapshot = false
	_, reg := e.startRelayGathered(cfg)
	insertSeq(e, "post", 0, 9)
	recs := c.waitIDs(10, time.Minute)
	got := distinctIDs(recs)
	for _, id := range before {
		if got[id] > 0 {
			t.Fatalf("row %s committed before the slot existed was published with the snapshot off", id)
		}
	}
	if len(got) != 10 {
		t.Errorf("read %d distinct ids, want the 10 committed after the start", len(got))
	}
	if n := gathered(reg, "walrelay_snapshot_rows_total")[""]; n != 0 {
		t.Errorf("walrelay_snapshot_rows_total = %v with the snapshot off", n)
	}
}

// TestInitialSnapshotWhereAndOrder: --snapshot-where publishes only the
// rows meeting it, --snapshot-order sets their order, and without an order
// the rows come by primary key. One key per table, so one partition shows
// the order the relay produced.
func TestInitialSnapshotWhereAndOrder(t *testing.T) {
	t.Run("where and order", func(t *testing.T) {
		e := newEnv(t)
		e.exec(`ALTER TABLE outbox ADD COLUMN sent_at timestamptz`)
		// seq 0..59 inserted shuffled; every third already sent.
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq, sent_at)
			SELECT 'w', 'k', 'T', jsonb_build_object('seq', s), s, CASE WHEN s % 3 = 0 THEN now() END
			FROM generate_series(0, 59) s ORDER BY random()`)
		c := e.consume()
		cfg := e.config()
		cfg.InitialSnapshot = true
		cfg.SnapshotWhere = "sent_at IS NULL"
		cfg.SnapshotOrder = "seq DESC"
		e.startRelayGathered(cfg)
		recs := c.waitIDs(40, time.Minute)
		var seqs []int
		for _, r := range recs {
			seqs = append(seqs, seqOf(t, r.Value))
		}
		var want []int
		for s := 59; s >= 0; s-- {
			if s%3 != 0 {
				want = append(want, s)
			}
		}
		if !slices.Equal(seqs, want) {
			t.Errorf("published seqs %v, want the unsent rows in descending seq %v", seqs, want)
		}
	})
	t.Run("a condition PostgreSQL refuses", func(t *testing.T) {
		e := newEnv(t)
		cfg := e.config()
		cfg.InitialSnapshot = true
		cfg.SnapshotWhere = "no_such_column IS NULL"
		r, err := relay.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)), metrics.NewUnregistered())
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- r.Run(e.ctx) }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), "no_such_column") || !strings.Contains(err.Error(), "condition") {
				t.Errorf("Run returned %v, want an error naming the column and the snapshot condition", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Run did not refuse a bad --snapshot-where within 30s")
		}
		if _, err := e.slotInfoErr(); err == nil {
			t.Errorf("slot %s created although the snapshot was refused", e.name)
		}
	})
	t.Run("primary key by default", func(t *testing.T) {
		e := newEnv(t)
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
			SELECT 'w', 'k', 'T', jsonb_build_object('seq', s), s FROM generate_series(0, 49) s`)
		c := e.consume()
		cfg := e.config()
		cfg.InitialSnapshot = true
		e.startRelayGathered(cfg)
		recs := c.waitIDs(50, time.Minute)
		var ids []string
		for _, r := range recs {
			id, _ := header(r, "id")
			ids = append(ids, id)
		}
		if !slices.IsSorted(ids) || len(ids) != 50 {
			t.Errorf("published ids not in primary key (uuid) order: %v", ids)
		}
	})
}

// TestInitialSnapshotValuesMatchStream: a row published by the snapshot
// and the same row published by the stream make the same record (value,
// key, headers): bytea as raw bytes, and the text output of types whose
// cast to text differs from it (boolean, char(n), timestamptz).
func TestInitialSnapshotValuesMatchStream(t *testing.T) {
	e := newEnv(t)
	e.exec(`CREATE TABLE box (
		id bigint PRIMARY KEY, aggregate_type text, aggregate_id text, type text, payload bytea,
		flag boolean, code char(6), at timestamptz, empty text)`)
	insert := func(id int) {
		e.exec(`INSERT INTO box VALUES ($1, 'v', 'k', 'T', '\x00ff10'::bytea, true, 'ab', '2026-01-02 03:04:05.678+00', '')`, id)
	}
	insert(1)
	c := e.consume()
	cfg := e.config()
	cfg.Tables = []decoder.Table{{Schema: "public", Name: "box"}}
	cfg.Mapping.Headers = []decoder.HeaderColumn{{Column: "flag", Header: "flag"}, {Column: "code", Header: "code"}, {Column: "at", Header: "at"}, {Column: "empty", Header: "empty"}}
	cfg.InitialSnapshot = true
	e.startRelayGathered(cfg)
	insert(2)
	recs := c.waitIDs(2, time.Minute)
	byID := map[string]*kgo.Record{}
	for _, r := range recs {
		id, _ := header(r, "id")
		byID[id] = r
	}
	snap, stream := byID["1"], byID["2"]
	if snap == nil || stream == nil {
		t.Fatalf("records by id: %v", byID)
	}
	if !bytes.Equal(snap.Value, []byte{0, 0xff, 0x10}) || !bytes.Equal(snap.Value, stream.Value) {
		t.Errorf("values: snapshot %x, stream %x, want 00ff10", snap.Value, stream.Value)
	}
	if string(snap.Key) != string(stream.Key) {
		t.Errorf("keys: snapshot %q, stream %q", snap.Key, stream.Key)
	}
	for _, h := range []string{"type", "flag", "code", "at", "empty"} {
		sv, sok := header(snap, h)
		tv, tok := header(stream, h)
		if sv != tv || sok != tok {
			t.Errorf("header %s: snapshot %q (%v), stream %q (%v)", h, sv, sok, tv, tok)
		}
	}
}

// TestInitialSnapshotExactlyOnce: with exactly-once delivery the snapshot
// goes through Kafka transactions; a read_committed consumer reads every
// row (before, during and after the snapshot) exactly once, per key in
// commit order (--snapshot-order seq), and a checkpoint was committed with
// the snapshot's rows.
func TestInitialSnapshotExactlyOnce(t *testing.T) {
	e := newEnv(t)
	insertSeq(e, "pre", 0, 2999)
	rc := e.consumeIsolated(true)
	cfg := e.config()
	cfg.ExactlyOnce = true
	cfg.Router.CheckpointTopic = e.checkpointTopic()
	cfg.InitialSnapshot = true
	cfg.SnapshotOrder = "seq"
	cfg.TxnMaxEvents = 500
	_, reg := e.startRelayGathered(cfg)
	wr := e.startWriters(2, 0, 200, 5*time.Millisecond)
	wr.wait(t)
	e.deliveredExactlyOnce(rc, 2*time.Minute)
	if n := gathered(reg, "walrelay_snapshot_rows_total")[""]; n != 3000 {
		t.Errorf("walrelay_snapshot_rows_total = %v, want 3000", n)
	}
	if n := gathered(reg, "walrelay_kafka_transactions_total")[""]; n < 6 {
		t.Errorf("%v Kafka transactions committed; the 3000 snapshot rows at 500 per transaction need at least 6", n)
	}
}

// TestInitialSnapshotTwoRelaysStartedTogether starts two relays (binary,
// at-least-once, defaults) at once on a database without their slot and
// with 20,000 outbox rows, as two supervised relays meet a fresh install:
// the initial snapshot is published once, by the relay that created the
// slot, and the other waits as the standby. Without the advisory lock
// around snapshot-and-create both would snapshot (each finds no slot), and
// every row would be read twice; with exactly-once delivery the second
// snapshot would also take the transactional id from the relay already
// streaming.
func TestInitialSnapshotTwoRelaysStartedTogether(t *testing.T) {
	e := newEnv(t)
	insertSeq(e, "pre", 0, 19999)
	want := tableIDs(e)
	c := e.consume()
	var procs [2]*proc
	for i := range procs {
		procs[i] = startProc(t, nil, e.args()...)
	}
	e.waitSlotStreamed(2 * time.Minute)
	// The standby is past its setup (and any snapshot it would publish)
	// once it waits for the slot.
	e.waitFor("one relay waiting as the standby", 2*time.Minute, func() (bool, error) {
		for i, p := range procs {
			if exited(p) {
				return false, fmt.Errorf("relay %d exited (%v): %s", i, p.err, lastLines(p.out.String(), 3))
			}
			if strings.Contains(p.out.String(), "waiting as a standby") {
				return true, nil
			}
		}
		return false, errors.New("neither relay waits as a standby")
	})
	c.waitIDs(len(want), 2*time.Minute)
	e.fence("", c)
	checkEachOnce(t, c.records(), want)
	snapshots := 0
	for _, p := range procs {
		if strings.Contains(p.out.String(), "initial snapshot published") {
			snapshots++
		}
	}
	if snapshots != 1 {
		t.Errorf("%d relays published an initial snapshot, want 1", snapshots)
	}
}

// TestInitialSnapshotSlotFoundMidSnapshot: a relay that finds the slot
// while another start still holds the lock on creating it (it copies the
// slot from its temporary one before it publishes the snapshot, so the
// slot exists the whole time) waits for that start, saying so, instead of
// streaming at once: streaming then would put changes after the
// consistent point on Kafka before the other's snapshot rows, and take the
// slot the other must make a failover slot. The test stands in for that
// start: it creates the slot and holds the lock; released, the relay
// streams from the slot, publishing no snapshot of its own.
func TestInitialSnapshotSlotFoundMidSnapshot(t *testing.T) {
	e := newEnv(t)
	insertSeq(e, "pre", 0, 99) // before the slot: not this relay's to publish
	holder := e.conn()
	defer holder.Close(context.Background())
	if _, err := holder.Exec(e.ctx, "SELECT pg_advisory_lock(hashtext($1))", "walrelay slot "+e.name); err != nil {
		t.Fatal(err)
	}
	e.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, e.name)
	c := e.consume()
	p := startProc(t, nil, e.args()...)
	e.waitFor("the relay to wait for the other start", 2*time.Minute, func() (bool, error) {
		if exited(p) {
			return false, fmt.Errorf("relay exited (%v): %s", p.err, lastLines(p.out.String(), 3))
		}
		if e.slotInfo().Active {
			return false, errors.New("the relay streams from the slot while another start holds the lock on creating it")
		}
		return strings.Contains(p.out.String(), "another walrelay is creating the replication slot"), nil
	})
	insertSeq(e, "post", 0, 9)
	if e.slotInfo().Active {
		t.Fatal("the relay streams from the slot while another start holds the lock on creating it")
	}
	if _, err := holder.Exec(e.ctx, "SELECT pg_advisory_unlock(hashtext($1))", "walrelay slot "+e.name); err != nil {
		t.Fatal(err)
	}
	c.waitIDs(10, 2*time.Minute)
	e.fence("", c)
	recs := c.records()
	if len(recs) != 10 {
		t.Errorf("%d records, want the 10 rows inserted after the slot was created", len(recs))
	}
	if strings.Contains(p.out.String(), "initial snapshot published") {
		t.Error("the relay published an initial snapshot of a slot another start created")
	}
}

// TestSnapshotCommand: `walrelay snapshot --table T --where …` publishes
// the table's current rows meeting the condition once, with the record
// and topic flags of run, and exits 0; a bad condition is refused with
// exit 2 and a line naming what to check.
func TestSnapshotCommand(t *testing.T) {
	e := newEnv(t)
	e.exec(`CREATE TABLE late (LIKE outbox INCLUDING ALL)`)
	e.exec(`INSERT INTO late (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'late', 'k', 'T', jsonb_build_object('seq', s), s FROM generate_series(0, 19) s`)
	c := e.consume()
	args := []string{"snapshot", "--pg-url", e.url, "--brokers", strings.Join(e.brokers, ","), "--table", "public.late",
		"--where", "seq >= 5", "--order", "seq",
		"--topic-template", e.topicPrefix() + "{aggregate_type}", "--dead-letter-topic", e.topicPrefix() + "dlq",
		"--linger", "1ms", "--log-level", "info"}
	out, code, _, exited := runBounded(t, time.Minute, nil, args...)
	if !exited || code != 0 {
		t.Fatalf("walrelay snapshot: exit %d (exited %v):\n%s", code, exited, lastLines(out, 5))
	}
	if !strings.Contains(out, "published 15 rows of public.late") {
		t.Errorf("output does not say 15 rows were published:\n%s", lastLines(out, 3))
	}
	recs := c.waitIDs(15, time.Minute)
	var seqs []int
	for _, r := range recs {
		if r.Topic != e.topic("late") {
			t.Errorf("record on %s, want %s", r.Topic, e.topic("late"))
		}
		seqs = append(seqs, seqOf(t, r.Value))
	}
	if want := []int{5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}; !slices.Equal(seqs, want) {
		t.Errorf("published seqs %v, want %v", seqs, want)
	}

	out, code, _, exited = runBounded(t, time.Minute, nil, withFlag(args, "--where", "no_such_column = 1")...)
	if !exited || code != 2 || !strings.Contains(finalLines(out), "no_such_column") || !strings.Contains(finalLines(out), "condition") {
		t.Errorf("bad --where: exit %d (exited %v), want 2 and a line naming the column and the condition:\n%s", code, exited, finalLines(out))
	}
}

// TestInitialSnapshotCrashRedoesIt: the binary is killed with SIGKILL in
// the middle of the initial snapshot (walrelay_snapshot_running is 1 and
// part of the rows are published). The slot it created is marked in the
// record as waiting for its snapshot, so the next start drops it and
// snapshots again: every row arrives, those published before the kill a
// second time (at-least-once).
func TestInitialSnapshotCrashRedoesIt(t *testing.T) {
	e := newEnv(t)
	const rows = 20000
	insertSeq(e, "pre", 0, rows-1)
	c := e.consume()
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	// A small in-flight limit makes the snapshot take seconds.
	p := startProc(t, nil, withFlag(withFlag(e.args(), "--metrics-addr", addr), "--max-inflight-events", "5")...)
	var body string
	e.waitFor("snapshot running with rows published", time.Minute, func() (bool, error) {
		if exited(p) {
			return false, fmt.Errorf("walrelay exited: %v", p.err)
		}
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return false, nil
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		published := metricValue(body, fmt.Sprintf(`walrelay_events_published_total{topic=%q}`, e.topic("w")))
		return metricValue(body, "walrelay_snapshot_running") == 1 && published >= 1000, nil
	})
	kill9(p)
	sentBefore := metricValue(body, "walrelay_snapshot_rows_total")
	var pending *string
	if err := e.conn().QueryRow(e.ctx, `SELECT initial_snapshot_lsn::text FROM walrelay.slots WHERE slot_name = $1`, e.name).Scan(&pending); err != nil || pending == nil {
		t.Fatalf("after a kill during the initial snapshot the record does not mark it unfinished (%v): the next start would not snapshot again", err)
	}
	if got := len(distinctIDs(c.records())); got >= rows {
		t.Fatalf("all %d rows were read before the kill: the snapshot was not interrupted", got)
	}

	p2 := startProc(t, nil, e.args()...)
	recs := c.waitIDs(rows, 3*time.Minute)
	checkEachOnceAtLeast(t, recs, tableIDs(e))
	dups := len(recs) - len(distinctIDs(recs))
	if dups == 0 {
		t.Errorf("no row was read twice: the snapshot interrupted after %v rows was not redone", sentBefore)
	}
	e.waitSlotActive(p2)
	t.Logf("killed after %v snapshot rows were sent; %d rows read, %d duplicates", sentBefore, len(distinctIDs(recs)), dups)
}

// TestInitialSnapshotKafkaRefusalRedoesIt: Kafka refuses a produce
// request for good in the middle of the initial snapshot, after
// --startup-timeout has passed. The relay does not create the slot from
// that snapshot: it replaces the producer, takes a new snapshot and
// streams after it, without Run returning (the snapshot's progress showed
// both servers reachable, so the startup timeout does not end it); every
// row arrives.
func TestInitialSnapshotKafkaRefusalRedoesIt(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	const rows = 20000
	insertSeq(e, "pre", 0, rows-1)
	c := e.consume()
	began := time.Now()
	fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: e.topic("w"), Err: kerr.InvalidRecord, Count: 1,
		When: func(kmsg.Request) bool { return time.Since(began) > 2*time.Second }})
	cfg := e.config()
	cfg.InitialSnapshot = true
	cfg.StartupTimeout = time.Second
	// A small in-flight limit makes the snapshot outlast the timeout.
	cfg.Router.MaxInflightEvents = 5
	rr, reg := e.startRelayGathered(cfg)
	if fault.Hits() == 0 {
		t.Fatal("the produce fault was never hit: the snapshot ended before it")
	}
	insertSeq(e, "post", 0, 9)
	recs := c.waitIDs(rows+10, 2*time.Minute)
	checkEachOnceAtLeast(t, recs, tableIDs(e))
	if n := gathered(reg, "walrelay_snapshot_rows_total")[""]; n <= rows {
		t.Errorf("walrelay_snapshot_rows_total = %v: the snapshot was not redone after the refused record", n)
	}
	if n := gathered(reg, "walrelay_stream_restarts_total")["kafka"]; n != 1 {
		t.Errorf("walrelay_stream_restarts_total{cause=kafka} = %v, want 1", n)
	}
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay Run returned: %v", err)
	}
}

// checkEachOnceAtLeast fails the test unless recs hold every id of want
// and nothing else.
func checkEachOnceAtLeast(t *testing.T, recs []*kgo.Record, want []string) {
	t.Helper()
	got := distinctIDs(recs)
	missing := 0
	for _, id := range want {
		if got[id] == 0 {
			missing++
		}
	}
	if missing > 0 || len(got) != len(want) {
		t.Errorf("%d rows in the table, %d distinct ids read, %d missing", len(want), len(got), missing)
	}
}

// TestKafkaUnreachableLeavesNoSlot: a start that fails because Kafka
// cannot be reached exits with an error and leaves no replication slot
// behind (one would hold WAL for nothing), with the initial snapshot on
// and off.
func TestKafkaUnreachableLeavesNoSlot(t *testing.T) {
	for _, mode := range []string{"initial", "never"} {
		t.Run(mode, func(t *testing.T) {
			e := newEnv(t)
			args := withFlag(withFlag(withFlag(e.args(), "--brokers", fmt.Sprintf("127.0.0.1:%d", closedPort(t))), "--startup-timeout", "3s"), "--snapshot", mode)
			out, code, _, exited := runBounded(t, 45*time.Second, nil, args...)
			if !exited || code == 0 {
				t.Fatalf("exit %d (exited %v), want an error exit:\n%s", code, exited, lastLines(out, 3))
			}
			var n int
			if err := e.conn().QueryRow(e.ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, e.name).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Errorf("slot %s exists after a start that failed on Kafka", e.name)
			}
		})
	}
}
