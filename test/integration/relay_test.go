package integration

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// TestOneEvent checks every part of one record: topic, key, the id and
// type headers (and no others), the value bytes and the commit timestamp.
func TestOneEvent(t *testing.T) {
	e := newEnv(t)
	e.startRelay(e.config())
	c := e.consume()
	conn := e.conn()

	before := time.Now().Truncate(time.Millisecond)
	var id string
	err := conn.QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
		VALUES ('order', 'order-42', 'OrderCreated', '{"total": 42, "items": ["a", "b"]}') RETURNING id::text`).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	after := time.Now()

	recs := c.waitIDs(1, 30*time.Second)
	if len(recs) != 1 {
		t.Fatalf("read %d records, want 1", len(recs))
	}
	r := recs[0]
	if r.Topic != e.topic("order") {
		t.Errorf("topic %q, want %q", r.Topic, e.topic("order"))
	}
	if string(r.Key) != "order-42" {
		t.Errorf("key %q, want order-42", r.Key)
	}
	// jsonb renders its canonical text form.
	if want := `{"items": ["a", "b"], "total": 42}`; string(r.Value) != want {
		t.Errorf("value %q, want %q", r.Value, want)
	}
	want := []kgo.RecordHeader{{Key: "id", Value: []byte(id)}, {Key: "type", Value: []byte("OrderCreated")}}
	if len(r.Headers) != len(want) {
		t.Fatalf("headers %v, want %v", r.Headers, want)
	}
	for i := range want {
		if r.Headers[i].Key != want[i].Key || !bytes.Equal(r.Headers[i].Value, want[i].Value) {
			t.Errorf("header %d = %s=%q, want %s=%q", i, r.Headers[i].Key, r.Headers[i].Value, want[i].Key, want[i].Value)
		}
	}
	if r.Timestamp.Before(before) || r.Timestamp.After(after) {
		t.Errorf("timestamp %v outside the transaction's commit window [%v, %v]", r.Timestamp, before, after)
	}
}

// TestTwoTablesAndPayloadTypes runs two outbox tables in one publication,
// with payload columns of the kinds walrelay renders: jsonb and json as
// text, text as UTF-8, bytea as raw bytes, NULL as a tombstone, and a uuid
// aggregate id and bigint id as their text forms.
func TestTwoTablesAndPayloadTypes(t *testing.T) {
	e := newEnv(t)
	e.exec(`CREATE TABLE outbox_bin (id bigserial PRIMARY KEY, aggregate_type text, aggregate_id uuid,
		type text, payload bytea)`)
	e.exec(`CREATE TABLE outbox_txt (id text PRIMARY KEY, aggregate_type varchar(50), aggregate_id text,
		type text, payload text, json_copy json)`)
	cfg := e.config()
	cfg.Tables = []decoder.Table{{Schema: "public", Name: "outbox"}, {Schema: "public", Name: "outbox_bin"}, {Schema: "public", Name: "outbox_txt"}}
	e.startRelay(cfg)
	c := e.consume()
	conn := e.conn()

	uuidKey := "6f1c3e0a-8d2b-4c7e-9f10-2a3b4c5d6e7f"
	_, err := conn.Exec(e.ctx, `
		INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('a', 'k1', 't', NULL);
		INSERT INTO outbox_bin (aggregate_type, aggregate_id, type, payload) VALUES ('b', '`+uuidKey+`', 't', '\x00ff10'::bytea);
		INSERT INTO outbox_bin (aggregate_type, aggregate_id, type, payload) VALUES ('b', '`+uuidKey+`', 't', ''::bytea);
		INSERT INTO outbox_txt VALUES ('txt-1', 'c', 'k3', 't', 'héllo wörld', '{"x":  1}');
	`)
	if err != nil {
		t.Fatal(err)
	}
	recs := c.waitIDs(4, 30*time.Second)
	byID := map[string]*kgo.Record{}
	for _, r := range recs {
		id, _ := header(r, "id")
		byID[id] = r
	}
	cases := []struct {
		id, topic, key string
		value          []byte
	}{
		{"", e.topic("a"), "k1", nil}, // id is a uuid; found below
		{"1", e.topic("b"), uuidKey, []byte{0x00, 0xff, 0x10}},
		{"2", e.topic("b"), uuidKey, []byte{}},
		{"txt-1", e.topic("c"), "k3", []byte("héllo wörld")},
	}
	for _, r := range recs {
		if r.Topic == e.topic("a") {
			id, _ := header(r, "id")
			cases[0].id = id
		}
	}
	for _, tc := range cases {
		r := byID[tc.id]
		if r == nil {
			t.Errorf("no record with id %q", tc.id)
			continue
		}
		if r.Topic != tc.topic || string(r.Key) != tc.key {
			t.Errorf("id %s: topic %q key %q, want %q %q", tc.id, r.Topic, r.Key, tc.topic, tc.key)
		}
		if (r.Value == nil) != (tc.value == nil) || !bytes.Equal(r.Value, tc.value) {
			t.Errorf("id %s: value %q (nil %v), want %q (nil %v)", tc.id, r.Value, r.Value == nil, tc.value, tc.value == nil)
		}
	}
}

// TestCommitOrderNotInsertOrder: transaction A inserts first and commits
// last; records come out in commit order, and a rolled-back transaction
// never appears.
func TestCommitOrderNotInsertOrder(t *testing.T) {
	e := newEnv(t)
	e.startRelay(e.config())
	c := e.consume()
	a, b, r := e.conn(), e.conn(), e.conn()
	insert := func(tx pgx.Tx, label string) {
		t.Helper()
		_, err := tx.Exec(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
			VALUES ('order', 'same-key', 'T', jsonb_build_object('label', $1::text))`, label)
		if err != nil {
			t.Fatal(err)
		}
	}
	txA, _ := a.Begin(e.ctx)
	insert(txA, "A") // first insert
	txB, _ := b.Begin(e.ctx)
	insert(txB, "B")
	txR, _ := r.Begin(e.ctx)
	insert(txR, "rolled-back")
	if err := txB.Commit(e.ctx); err != nil { // B commits first
		t.Fatal(err)
	}
	if err := txR.Rollback(e.ctx); err != nil {
		t.Fatal(err)
	}
	if err := txA.Commit(e.ctx); err != nil { // A commits last
		t.Fatal(err)
	}
	tx, _ := b.Begin(e.ctx)
	insert(tx, "C")
	if err := tx.Commit(e.ctx); err != nil {
		t.Fatal(err)
	}

	c.waitIDs(3, 30*time.Second)
	e.fence("", c) // a wrongly published record would be read by now
	recs := c.records()
	var got []string
	for _, r := range recs {
		got = append(got, string(r.Value))
	}
	want := []string{`{"label": "B"}`, `{"label": "A"}`, `{"label": "C"}`}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("records in partition order %v, want commit order %v", got, want)
	}
}

// TestOnlyOutboxInserts mixes outbox rows with another table of the same
// publication, and updates, deletes and truncates: only outbox inserts are
// published, with the values they were inserted with.
func TestOnlyOutboxInserts(t *testing.T) {
	e := newEnv(t)
	e.exec(`CREATE TABLE other (id int PRIMARY KEY, v text)`)
	e.exec(`ALTER TABLE outbox REPLICA IDENTITY FULL`)
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE outbox, other`, pgx.Identifier{e.name}.Sanitize()))
	e.startRelay(e.config())
	c := e.consume()
	conn := e.conn()
	err := pgx.BeginFunc(e.ctx, conn, func(tx pgx.Tx) error {
		_, err := tx.Exec(e.ctx, `
			INSERT INTO other VALUES (1, 'x'), (2, 'y');
			INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
				VALUES ('00000000-0000-0000-0000-000000000001', 'o', 'k', 'T', '{"v": 1}');
			UPDATE other SET v = 'z' WHERE id = 1;
			UPDATE outbox SET payload = '{"v": "updated"}' WHERE id = '00000000-0000-0000-0000-000000000001';
			DELETE FROM other WHERE id = 2;
			INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
				VALUES ('00000000-0000-0000-0000-000000000002', 'o', 'k', 'T', '{"v": 2}');
			DELETE FROM outbox WHERE id = '00000000-0000-0000-0000-000000000001';`)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`TRUNCATE other`)
	e.exec(`TRUNCATE outbox`)
	e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
		VALUES ('00000000-0000-0000-0000-000000000003', 'o', 'k', 'T', '{"v": 3}')`)

	c.waitIDs(3, 30*time.Second)
	e.fence("", c) // an update, delete or truncate published by mistake would be read by now
	recs := c.records()
	var got []string
	for _, r := range recs {
		id, _ := header(r, "id")
		got = append(got, id[len(id)-1:]+"="+string(r.Value))
	}
	want := []string{`1={"v": 1}`, `2={"v": 2}`, `3={"v": 3}`}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("published %v, want exactly %v", got, want)
	}
}

// TestInsertAndDeleteInSameTransaction is the recommended write pattern:
// the row is deleted in the transaction that inserted it. Every event is
// delivered and the table stays empty.
func TestInsertAndDeleteInSameTransaction(t *testing.T) {
	e := newEnv(t)
	e.startRelay(e.config())
	c := e.consume()
	conn := e.conn()
	const txns, per = 50, 3
	for i := range txns {
		err := pgx.BeginFunc(e.ctx, conn, func(tx pgx.Tx) error {
			for j := range per {
				var id string
				if err := tx.QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
					VALUES ('order', $1, 'T', '{}', $2) RETURNING id`, fmt.Sprint("k", i%5), i*per+j).Scan(&id); err != nil {
					return err
				}
				if _, err := tx.Exec(e.ctx, `DELETE FROM outbox WHERE id = $1`, id); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	recs := c.waitIDs(txns*per, 60*time.Second)
	if n := len(distinctIDs(recs)); n != txns*per {
		t.Fatalf("%d distinct events, want %d", n, txns*per)
	}
	var left int
	if err := conn.QueryRow(e.ctx, `SELECT count(*) FROM outbox`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Fatalf("outbox has %d rows, want 0", left)
	}
}

// TestAckGating refuses every produce request while events are written and
// other tables keep the walsender sending keepalives: the slot's
// confirmed_flush_lsn must stay behind the first unacknowledged
// transaction. Once the broker accepts again, everything arrives and the
// slot moves past it.
func TestAckGating(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	e.exec(`CREATE TABLE noise (id bigserial PRIMARY KEY, v text)`)
	rr := e.startRelay(e.config())
	c := e.consume()
	conn := e.conn()

	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', '{"n": 0}')`)
	c.waitIDs(1, 30*time.Second)
	afterFirst := e.currentLSN(conn)
	e.waitFor("first event confirmed", 30*time.Second, func() (bool, error) {
		return e.slotInfo().ConfirmedLSN >= afterFirst, nil
	})

	fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	var firstUnacked decoder.LSN // an upper bound of the end LSN of the first refused transaction
	for i := 1; i <= 5; i++ {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', jsonb_build_object('n', $1::int))`, i)
		if i == 1 {
			firstUnacked = e.currentLSN(conn)
		}
	}
	// Write elsewhere for a while: the walsender decodes it, finds nothing
	// to send and reports its position in keepalives.
	maxConfirmed := e.writeNoiseFor(conn, 4*time.Second)
	noiseEnd := e.currentLSN(conn)
	if maxConfirmed >= firstUnacked {
		t.Fatalf("confirmed_flush_lsn reached %s while the transaction ending before %s was unacknowledged", maxConfirmed, firstUnacked)
	}
	if got := len(distinctIDs(c.records())); got != 1 {
		t.Fatalf("%d events read while the broker refused writes, want 1", got)
	}
	if !rr.relay.Streaming() {
		t.Fatal("relay lost its replication stream while Kafka refused writes")
	}

	fault.Remove()
	c.waitIDs(6, 60*time.Second)
	e.waitFor("slot confirmed past the refused transactions and the noise", 30*time.Second, func() (bool, error) {
		got := e.slotInfo().ConfirmedLSN
		return got >= noiseEnd, fmt.Errorf("confirmed %s, want >= %s", got, noiseEnd)
	})
}

// TestBackpressureKeepsTheConnection blocks the relay on a full producer
// buffer (the broker refuses every write) for longer than the server's
// wal_sender_timeout (10s in the test cluster): the relay keeps sending
// status updates while it waits, so the walsender does not drop it (same
// backend pid throughout), and nothing is confirmed past the last ack.
func TestBackpressureKeepsTheConnection(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	cfg := e.config()
	cfg.Router.MaxInflightEvents = 5
	rr := e.startRelay(cfg)
	c := e.consume()
	conn := e.conn()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', '{"n": 0}', 0)`)
	c.waitIDs(1, 30*time.Second)
	pid := e.slotInfo().ActivePID

	fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'o', 'k', 'T', jsonb_build_object('n', g), g FROM generate_series(1, 200) g`)
	refused := e.currentLSN(conn)
	e.waitFor("produce requests refused", 30*time.Second, func() (bool, error) { return fault.Hits() > 0, nil })
	// Wait for a status update received more than wal_sender_timeout after
	// the relay blocked: the walsender would have dropped a silent client
	// by then. Its pid must not change meanwhile.
	var timeoutMS int64
	if err := conn.QueryRow(e.ctx, `SELECT setting::bigint FROM pg_settings WHERE name = 'wal_sender_timeout'`).Scan(&timeoutMS); err != nil {
		t.Fatal(err)
	}
	past := e.serverNow().Add(time.Duration(timeoutMS)*time.Millisecond + time.Second)
	e.waitFor("a status update past wal_sender_timeout while blocked", time.Duration(timeoutMS)*time.Millisecond+30*time.Second, func() (bool, error) {
		at, wpid, ok := e.replyTime()
		if !ok || pid == nil || wpid != *pid {
			t.Fatalf("walsender pid changed from %v to %v (serving: %v) while Kafka refused writes: the relay was disconnected", deref(pid), wpid, ok)
		}
		return at.After(past), fmt.Errorf("last status update at %s, want after %s", at.Format(time.RFC3339Nano), past.Format(time.RFC3339Nano))
	})
	info := e.slotInfo()
	if info.ActivePID == nil || pid == nil || *info.ActivePID != *pid {
		t.Fatalf("walsender pid changed from %v to %v while Kafka refused writes: the relay was disconnected", deref(pid), deref(info.ActivePID))
	}
	if info.ConfirmedLSN >= refused {
		t.Fatalf("confirmed %s, past the refused transaction (ends before %s)", info.ConfirmedLSN, refused)
	}
	if !rr.relay.Streaming() {
		t.Fatal("relay not streaming")
	}
	fault.Remove()
	recs := c.waitIDs(201, 60*time.Second)
	checkPerKeyOrder(t, recs)
	e.waitFor("confirmed past the backlog", 30*time.Second, func() (bool, error) {
		return e.slotInfo().ConfirmedLSN >= refused, nil
	})
}

func deref(p *int32) any {
	if p == nil {
		return nil
	}
	return *p
}

// TestBigTransaction sends one transaction of 200,000 outbox rows through
// the relay binary; per key the rows arrive in insert order.
func TestBigTransaction(t *testing.T) {
	e := newEnv(t)
	cmd := e.runBinary(e.args()...)
	_ = cmd
	c := e.consume()
	e.waitFor("slot created", 30*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	const rows = 200_000
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'big', 'k' || (g % 100), 'Big', jsonb_build_object('n', g), g FROM generate_series(1, $1) g`, rows)
	recs := c.waitIDs(rows, 5*time.Minute)
	checkPerKeyOrder(t, recs)
}

// TestAlterTableWhileRunning adds and drops outbox columns while the relay
// runs: events before and after decode against the right column list.
func TestAlterTableWhileRunning(t *testing.T) {
	e := newEnv(t)
	e.startRelay(e.config())
	c := e.consume()
	ins := func(n int) {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', jsonb_build_object('n', $1::int), $1)`, n)
	}
	ins(1)
	c.waitIDs(1, 30*time.Second)
	e.exec(`ALTER TABLE outbox ADD COLUMN extra text DEFAULT 'x'`)
	ins(2)
	e.exec(`ALTER TABLE outbox DROP COLUMN aggregate_type`) // shifts every later column left
	e.exec(`ALTER TABLE outbox ADD COLUMN aggregate_type text`)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq, extra) VALUES ('o', 'k', 'T2', '{"n": 3}', 3, 'y')`)
	recs := c.waitIDs(3, 30*time.Second)
	var got []string
	for _, r := range recs {
		typ, _ := header(r, "type")
		got = append(got, fmt.Sprintf("%s|%s|%s|%s", r.Topic, r.Key, typ, r.Value))
	}
	want := []string{
		e.topic("o") + `|k|T|{"n": 1}`,
		e.topic("o") + `|k|T|{"n": 2}`,
		e.topic("o") + `|k|T2|{"n": 3}`,
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

// TestMurmur2PartitionsLikeJava checks keyed records land where Kafka's
// Java client puts them: toPositive(murmur2(key)) % partitions, with
// murmur2 values from Kafka's own UtilsTest.
func TestMurmur2PartitionsLikeJava(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.Router.TopicPartitions = 7
	e.startRelay(cfg)
	c := e.consume()
	java := map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
	}
	for k := range java {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('p', $1, 'T', '{}')`, k)
	}
	recs := c.waitIDs(len(java), 30*time.Second)
	for _, r := range recs {
		want := (java[string(r.Key)] & 0x7fffffff) % 7
		if r.Partition != want {
			t.Errorf("key %q on partition %d, Java's client would choose %d", r.Key, r.Partition, want)
		}
	}
}

// TestSigtermConfirmsEverything stops the binary with SIGTERM after its
// events are delivered: it exits 0, and a restarted relay sends none of
// them again (the final status update confirmed them all).
func TestSigtermConfirmsEverything(t *testing.T) {
	e := newEnv(t)
	cmd := e.runBinary(e.args()...)
	c := e.consume()
	e.waitFor("slot active", 30*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	for i := range 100 {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', '{}', $1)`, i)
	}
	c.waitIDs(100, 30*time.Second)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitExit(t, cmd, 0)

	e.runBinary(e.args()...)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', '{}', 100)`)
	c.waitIDs(101, 30*time.Second)
	e.fence("", c) // a resent event would be read by now
	recs := c.records()
	for id, n := range distinctIDs(recs) {
		if n != 1 {
			t.Errorf("id %s delivered %d times after a graceful stop, want once", id, n)
		}
	}
}

// TestKill9MidRun kills the relay binary with SIGKILL in the middle of a
// 20,000-event run by 8 concurrent writers and restarts it: every id
// arrives at least once, per key the first arrivals are in commit order,
// and duplicates are identical copies.
func TestKill9MidRun(t *testing.T) {
	e := newEnv(t)
	cmd := e.runBinary(e.args()...)
	c := e.consume()
	e.waitFor("slot active", 30*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	const writers, perWriter = 8, 2500
	wr := e.startWriters(writers, 0, perWriter, 0)
	// Kill once a quarter of the events were delivered.
	e.waitFor("a quarter delivered", 2*time.Minute, func() (bool, error) {
		return len(distinctIDs(c.records())) >= writers*perWriter/4, nil
	})
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	killedAt := len(distinctIDs(c.records()))
	e.runBinary(e.args()...)
	wr.wait(t)
	recs := c.waitIDs(writers*perWriter, 3*time.Minute)
	dups := checkPerKeyOrder(t, recs)
	t.Logf("killed after %d distinct events; %d records read for %d events (%d duplicates)", killedAt, len(recs), writers*perWriter, dups)
}

// writePaced inserts n events for writer w in transactions of 1 to 5 rows,
// with a pause after every transaction, so that the writes span the faults
// the tests inject. Writer w owns keys w-0..w-9 and numbers its events with
// seq, so per key the commit order is seq order.
func writePaced(e *env, w, n int, pause time.Duration) error {
	return writeCounted(e, w, 0, n, pause, nil)
}

// writeCounted is writePaced for seq from..from+n-1 (keys w-0..w-9, seq
// increasing in commit order per key), adding every committed row to rows
// (when not nil).
func writeCounted(e *env, w, from, n int, pause time.Duration, rows *atomic.Int64) error {
	conn, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	rng := rand.New(rand.NewPCG(uint64(w), uint64(from)+7))
	for seq := from; seq < from+n; {
		size := min(1+rng.IntN(5), from+n-seq)
		err := pgx.BeginFunc(e.ctx, conn, func(tx pgx.Tx) error {
			for j := range size {
				s := seq + j
				if _, err := tx.Exec(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
					VALUES ('w', $1, 'T', jsonb_build_object('writer', $2::int, 'seq', $3::int), $3)`,
					fmt.Sprintf("%d-%d", w, s%10), w, s); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("writer %d: %w", w, err)
		}
		seq += size
		if rows != nil {
			rows.Add(int64(size))
		}
		time.Sleep(pause) // paces the writer
	}
	return nil
}

// writerGroup is writers running writeCounted side by side.
type writerGroup struct {
	rows atomic.Int64  // rows committed so far, all writers
	done chan struct{} // closed when every writer returned
	errs chan error
}

// startWriters starts n writers (0..n-1), each writing perWriter events
// numbered from seq from, pausing after every transaction.
func (e *env) startWriters(n, from, perWriter int, pause time.Duration) *writerGroup {
	g := &writerGroup{done: make(chan struct{}), errs: make(chan error, n)}
	var wg sync.WaitGroup
	for w := range n {
		wg.Go(func() { g.errs <- writeCounted(e, w, from, perWriter, pause, &g.rows) })
	}
	go func() { wg.Wait(); close(g.errs); close(g.done) }()
	return g
}

// wait waits for every writer and fails the test if one failed.
func (g *writerGroup) wait(t *testing.T) {
	t.Helper()
	<-g.done
	for err := range g.errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// checkPerKeyOrder fails the test unless, per key, the first arrival of
// each event comes in increasing seq (from the payload's "seq" or "n"),
// and every copy of an id is identical. It returns the duplicate count.
func checkPerKeyOrder(t *testing.T, recs []*kgo.Record) int {
	t.Helper()
	first := map[string]*kgo.Record{}
	last := map[string]int{} // key → last first-arrival seq
	dups := 0
	for _, r := range recs {
		id, _ := header(r, "id")
		if f, ok := first[id]; ok {
			dups++
			if !bytes.Equal(f.Key, r.Key) || !bytes.Equal(f.Value, r.Value) || f.Topic != r.Topic || fmt.Sprint(f.Headers) != fmt.Sprint(r.Headers) {
				t.Errorf("id %s: duplicate differs: %q/%q vs %q/%q", id, f.Key, f.Value, r.Key, r.Value)
			}
			continue
		}
		first[id] = r
		seq := seqOf(t, r.Value)
		k := r.Topic + "/" + string(r.Key)
		if prev, ok := last[k]; ok && seq <= prev {
			t.Errorf("key %s: seq %d arrived after %d", k, seq, prev)
		}
		last[k] = seq
	}
	return dups
}

func seqOf(t *testing.T, v []byte) int {
	for _, f := range []string{`"seq": `, `"n": `} {
		if i := bytes.Index(v, []byte(f)); i >= 0 {
			rest := v[i+len(f):]
			j := bytes.IndexAny(rest, ",}")
			n, err := strconv.Atoi(string(rest[:j]))
			if err == nil {
				return n
			}
		}
	}
	t.Fatalf("no seq in %q", v)
	return 0
}

// slotInfoErr is slotInfo without failing the test.
func (e *env) slotInfoErr() (slot.Info, error) {
	c, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		return slot.Info{}, err
	}
	defer c.Close(context.Background())
	return slot.ReadInfo(e.ctx, c, e.name)
}

// waitExit waits for cmd to exit with code want.
func waitExit(t *testing.T, cmd interface {
	Wait() error
}, want int) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		code := 0
		if ee, ok := err.(interface{ ExitCode() int }); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatalf("wait: %v", err)
		}
		if code != want {
			t.Fatalf("exit code %d, want %d", code, want)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("process did not exit within 60s")
	}
}
