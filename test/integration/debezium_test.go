package integration

// Side by side with Debezium: its PostgreSQL connector and Outbox Event
// Router on Kafka Connect standalone (test/debezium) and walrelay on
// the same rows and the same Apache Kafka broker. These tests need Apache
// Kafka (WALRELAY_TEST_KAFKA=apache, `make test-kafka`) and Java with
// Maven; they skip otherwise.

import (
	"bytes"
	"context"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/test/debezium"
)

// needDebezium skips tests that run Debezium when the broker is not Apache
// Kafka or Java and Maven are missing.
func needDebezium(t *testing.T) {
	t.Helper()
	needApache(t)
	if err := debezium.Available(); err != nil {
		t.Skip(err)
	}
}

// startDebezium starts Kafka Connect with Debezium's connector; it is
// killed when the test ends, and its log's tail shown when the test
// failed.
func (e *env) startDebezium(opts debezium.Options) *debezium.Connect {
	e.t.Helper()
	opts.Brokers = e.brokers
	if opts.PGURL == "" {
		opts.PGURL = e.url
	}
	c, err := debezium.Start(context.Background(), opts)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		c.Kill()
		if e.t.Failed() {
			e.t.Logf("Kafka Connect's log (%s), last lines:\n%s", c.LogFile(), c.LogTail(60))
			return
		}
		c.Close()
	})
	return c
}

// waitPeerSlot waits until a walsender streams slot name: rows committed
// from then on reach whoever holds it. With dbz set, it fails at once when
// Kafka Connect exits instead (a classpath or configuration error).
func (e *env) waitPeerSlot(name string, timeout time.Duration, dbz *debezium.Connect) {
	e.t.Helper()
	conn := e.conn()
	e.waitFor("slot "+name+" streamed", timeout, func() (bool, error) {
		if dbz != nil && !dbz.Running() {
			e.t.Fatalf("Kafka Connect exited before streaming slot %s", name)
		}
		var active bool
		err := conn.QueryRow(e.ctx, `SELECT active FROM pg_replication_slots WHERE slot_name = $1`, name).Scan(&active)
		if err == pgx.ErrNoRows {
			return false, fmt.Errorf("no slot %s yet", name)
		}
		return active && err == nil, err
	})
}

// debeziumOutbox creates an outbox table of Debezium's documented shape
// with a payload column of type payloadType.
func (e *env) debeziumOutbox(table, payloadType string) {
	e.exec(fmt.Sprintf(`CREATE TABLE %s (
		id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
		aggregatetype varchar(255) NOT NULL,
		aggregateid varchar(255) NOT NULL,
		type varchar(255) NOT NULL,
		payload %s
	)`, table, payloadType))
}

// TestDebeziumSameRecords runs Debezium (its defaults, the StringConverter
// for keys and text payloads, the BinaryDataConverter its outbox
// documentation names for binary ones) and walrelay --preset debezium on
// the same rows of four outbox tables (json, jsonb, text and bytea
// payloads, NULL payloads in each) and compares the records id by id:
// the topic past each one's prefix, the partition, the key bytes, the
// header names and values, the value bytes. Updates and deletes, which
// neither publishes, are among the rows.
func TestDebeziumSameRecords(t *testing.T) {
	needDebezium(t)
	e := newEnv(t)
	payloads := map[string]string{"outbox_json": "json", "outbox_jsonb": "jsonb", "outbox_text": "text", "outbox_bytea": "bytea"}
	var tables []string
	for table, typ := range payloads {
		e.debeziumOutbox(table, typ)
		tables = append(tables, "public."+table)
	}
	sort.Strings(tables)
	dbzSlot := e.name + "_dbz"
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE %s`, dbzSlot, strings.Join(tables, ", ")))
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), e.url)
		if err == nil {
			_, _ = conn.Exec(context.Background(), "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", dbzSlot)
			conn.Close(context.Background())
		}
	})

	wrPrefix, dbzPrefix := e.name+".wr.", e.name+".dbz."
	e.runBinary("run", "--pg-url", e.url, "--brokers", strings.Join(e.brokers, ","),
		"--slot", e.name, "--publication", e.name, "--table", strings.Join(tables, ","),
		"--preset", "debezium", "--topic-template", wrPrefix+"outbox.event.{aggregate_type}",
		"--dead-letter-topic", e.name+".dlq", "--linger", "1ms", "--metrics-addr", "", "--log-level", "info")
	e.waitPeerSlot(e.name, time.Minute, nil)
	dbz := e.startDebezium(debezium.Options{
		Slot: dbzSlot, Publication: dbzSlot, Tables: tables,
		TopicReplacement: dbzPrefix + "outbox.event.${routedByValue}",
	})
	e.waitPeerSlot(dbzSlot, 3*time.Minute, dbz)

	c := e.consume()
	conn := e.conn()
	want := map[string][]byte{} // id -> the payload as written (nil: NULL)
	insert := func(tx pgx.Tx, table, aggType, aggID string, payload any) {
		t.Helper()
		var id string
		if err := tx.QueryRow(e.ctx, fmt.Sprintf(`INSERT INTO %s (aggregatetype, aggregateid, type, payload) VALUES ($1, $2, 'Created', $3) RETURNING id::text`, table), aggType, aggID, payload).Scan(&id); err != nil {
			t.Fatal(err)
		}
		switch p := payload.(type) {
		case nil:
			want[id] = nil
		case string:
			want[id] = []byte(p)
		case []byte:
			want[id] = p
		}
	}
	inTx := func(f func(tx pgx.Tx)) {
		t.Helper()
		tx, err := conn.Begin(e.ctx)
		if err != nil {
			t.Fatal(err)
		}
		f(tx)
		if err := tx.Commit(e.ctx); err != nil {
			t.Fatal(err)
		}
	}
	jsonDoc := `{"b": 1,  "a": [1, 2], "s": "é\u00e9\"q"}`
	inTx(func(tx pgx.Tx) {
		insert(tx, "outbox_json", "order", "o-1", jsonDoc)
		insert(tx, "outbox_json", "order", "o-2", nil)
		insert(tx, "outbox_jsonb", "customer", "c-1", jsonDoc)
		insert(tx, "outbox_jsonb", "customer", "c-2", nil)
	})
	inTx(func(tx pgx.Tx) {
		insert(tx, "outbox_text", "order", "o-1", "plain text, ünïcode ✓\nsecond line")
		insert(tx, "outbox_text", "order", "o-3", "")
		insert(tx, "outbox_text", "order", "o-4", nil)
		insert(tx, "outbox_bytea", "blob", "b-1", []byte{0x00, 0xff, 0x80, 'a', 0x0a})
		insert(tx, "outbox_bytea", "blob", "b-2", []byte{})
		insert(tx, "outbox_bytea", "blob", "b-3", nil)
	})
	// One transaction of many rows over several aggregates and tables.
	inTx(func(tx pgx.Tx) {
		for i := range 40 {
			agg := fmt.Sprintf("agg-%d", i%7)
			switch i % 4 {
			case 0:
				insert(tx, "outbox_json", "order", agg, fmt.Sprintf(`{"n": %d}`, i))
			case 1:
				insert(tx, "outbox_jsonb", "payment", agg, fmt.Sprintf(`{"n": %d, "k": [true, null]}`, i))
			case 2:
				insert(tx, "outbox_text", "shipment", agg, fmt.Sprintf("row %d", i))
			default:
				insert(tx, "outbox_bytea", "blob", agg, []byte{byte(i), 0xfe})
			}
		}
	})
	// Neither publishes updates or deletes (walrelay's publication has only
	// inserts; Debezium's EventRouter drops them).
	e.exec(`UPDATE outbox_text SET payload = 'changed' WHERE aggregateid = 'o-1'`)
	e.exec(`DELETE FROM outbox_json WHERE aggregateid = 'o-2'`)
	inTx(func(tx pgx.Tx) { insert(tx, "outbox_text", "order", "last", "the last row") })

	isDbz := func(r *kgo.Record) bool { return strings.HasPrefix(r.Topic, dbzPrefix) }
	e.waitFor("both to deliver every row", 3*time.Minute, func() (bool, error) {
		var wr, dz int
		for _, r := range c.records() {
			if isDbz(r) {
				dz++
			} else if strings.HasPrefix(r.Topic, wrPrefix) {
				wr++
			}
		}
		return wr >= len(want) && dz >= len(want), fmt.Errorf("walrelay %d, Debezium %d of %d records (Connect running: %v)", wr, dz, len(want), dbz.Running())
	})

	byID := map[bool]map[string]*kgo.Record{false: {}, true: {}}
	for _, r := range c.records() {
		if r.Topic == e.name+".dlq" {
			t.Fatalf("walrelay dead-lettered a row: %v", r.Headers)
		}
		id, ok := header(r, "id")
		if !ok {
			t.Fatalf("record without an id header on %s: %v", r.Topic, r.Headers)
		}
		if prev, dup := byID[isDbz(r)][id]; dup {
			if prev.Topic == r.Topic && prev.Partition == r.Partition && prev.Offset == r.Offset {
				continue // the consumer read it again, the log holds it once
			}
			t.Fatalf("id %s delivered twice: %s/%d@%d and %s/%d@%d", id, prev.Topic, prev.Partition, prev.Offset, r.Topic, r.Partition, r.Offset)
		}
		byID[isDbz(r)][id] = r
	}
	for _, side := range []bool{false, true} {
		if len(byID[side]) != len(want) {
			t.Fatalf("Debezium=%v: %d records, want %d (an update or delete published?)", side, len(byID[side]), len(want))
		}
	}
	compared := 0
	for id, payload := range want {
		w, d := byID[false][id], byID[true][id]
		if w == nil || d == nil {
			t.Fatalf("id %s: walrelay's record %v, Debezium's %v", id, w != nil, d != nil)
		}
		if wt, dt := strings.TrimPrefix(w.Topic, wrPrefix), strings.TrimPrefix(d.Topic, dbzPrefix); wt != dt || !strings.HasPrefix(wt, "outbox.event.") {
			t.Errorf("id %s: topic %q (walrelay) vs %q (Debezium)", id, wt, dt)
		}
		if w.Partition != d.Partition {
			t.Errorf("id %s: partition %d (walrelay) vs %d (Debezium)", id, w.Partition, d.Partition)
		}
		if !bytes.Equal(w.Key, d.Key) {
			t.Errorf("id %s: key %q (walrelay) vs %q (Debezium)", id, w.Key, d.Key)
		}
		dh, context := debeziumHeaders(d)
		if wh := headerList(w.Headers); wh != dh || wh != "id="+id {
			t.Errorf("id %s: headers %s (walrelay) vs %s (Debezium)", id, wh, dh)
		}
		// Debezium's connector (extended.headers.enabled, on by default)
		// adds headers naming itself, which walrelay does not send: the
		// docs/debezium.md lists them among the differences that remain.
		if context != debeziumContextHeaders {
			t.Errorf("id %s: Debezium's context headers %s, want %s", id, context, debeziumContextHeaders)
		}
		if (w.Value == nil) != (d.Value == nil) || !bytes.Equal(w.Value, d.Value) {
			t.Errorf("id %s: value %q (null %v, walrelay) vs %q (null %v, Debezium)", id, w.Value, w.Value == nil, d.Value, d.Value == nil)
		}
		// And both are what was written, not the same mistake: json, text
		// and bytea as written, jsonb as PostgreSQL normalises it.
		if payload == nil {
			if w.Value != nil {
				t.Errorf("id %s: NULL payload gave value %q, want a null value", id, w.Value)
			}
		} else if !strings.HasPrefix(w.Topic, wrPrefix+"outbox.event.customer") && !strings.HasPrefix(w.Topic, wrPrefix+"outbox.event.payment") && !bytes.Equal(w.Value, payload) {
			t.Errorf("id %s: value %q, want %q as written", id, w.Value, payload)
		}
		compared++
	}
	t.Logf("%d records compared, equal topic, partition, key, headers and value on both", compared)
}

// debeziumContextHeaders are the names of the headers Debezium's connector
// adds to every record by default (extended.headers.enabled).
const debeziumContextHeaders = "__debezium.context.connectorLogicalName,__debezium.context.taskId,__debezium.context.connectorName,__debezium.context.runId"

// debeziumHeaders splits a Debezium record's headers into the outbox's
// (name=value, in order) and the names of Debezium's context headers.
func debeziumHeaders(r *kgo.Record) (outbox, context string) {
	var rest []kgo.RecordHeader
	var names []string
	for _, h := range r.Headers {
		if strings.HasPrefix(h.Key, "__debezium.context.") {
			names = append(names, h.Key)
		} else {
			rest = append(rest, h)
		}
	}
	return headerList(rest), strings.Join(names, ",")
}

// headerList renders headers in order, name=value, for comparison.
func headerList(hs []kgo.RecordHeader) string {
	var parts []string
	for _, h := range hs {
		parts = append(parts, h.Key+"="+string(h.Value))
	}
	return strings.Join(parts, ",")
}

// TestDebeziumMoveInPlace moves an outbox from Debezium to walrelay and
// back as docs/debezium.md's "Moving from Debezium" says, under a live write
// load: Debezium streams its slot and publication to
// outbox.event.<aggregatetype>; the operator stops Kafka Connect (SIGTERM)
// while the writers go on and starts walrelay --preset debezium
// --no-create-slot on Debezium's slot, publication and topics; then stops
// walrelay (SIGTERM) and starts Kafka Connect again, unchanged. Rows are
// numbered in commit order. Every row written must be on the topic, and
// each of the three runs must have delivered one gapless range of rows,
// each range starting at or before the row after the previous range's last:
// so nothing is lost, and the rows delivered twice are only the last ones
// the previous run had sent past the slot position it confirmed.
func TestDebeziumMoveInPlace(t *testing.T) {
	needDebezium(t)
	e := newEnv(t)
	e.debeziumOutbox("outbox_events", "text")
	dbzSlot := e.name + "_dbz"
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE public.outbox_events`, dbzSlot))
	topicPrefix := e.name + ".outbox.event."
	dbz := e.startDebezium(debezium.Options{
		Slot: dbzSlot, Publication: dbzSlot, Tables: []string{"public.outbox_events"},
		TopicReplacement: topicPrefix + "${routedByValue}",
		// Offsets (and with them the slot's confirmed position) every
		// second instead of every minute, as a careful operator sets it.
		Worker: map[string]string{"offset.flush.interval.ms": "1000"},
	})
	e.waitPeerSlot(dbzSlot, 3*time.Minute, dbz)
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), e.url)
		if err == nil {
			_, _ = conn.Exec(context.Background(), "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", dbzSlot)
			conn.Close(context.Background())
		}
	})

	c := e.consume()
	// runs reads the row numbers (the payload) each run delivered: each
	// Debezium run by its run id header, walrelay as "walrelay".
	runs := func() map[string]map[int]int {
		got := map[string]map[int]int{}
		for _, r := range c.records() {
			if !strings.HasPrefix(r.Topic, topicPrefix) {
				continue
			}
			var n int
			if _, err := fmt.Sscan(string(r.Value), &n); err != nil {
				t.Fatalf("record %q on %s: %v", r.Value, r.Topic, err)
			}
			run, ok := header(r, "__debezium.context.runId")
			if !ok {
				run = "walrelay"
			} else {
				run = "Debezium " + run
			}
			if got[run] == nil {
				got[run] = map[int]int{}
			}
			got[run][n]++
		}
		return got
	}
	delivered := func(match func(run string) bool) int {
		total := 0
		for run, ns := range runs() {
			if match(run) {
				total += len(ns)
			}
		}
		return total
	}

	// The writers: one row per transaction, numbered in commit order, about
	// 200 a second, until the moves are over.
	var written atomic.Int64
	stop := make(chan struct{})
	writerDone := make(chan error, 1)
	go func() {
		conn, err := pgx.Connect(e.ctx, e.url)
		if err != nil {
			writerDone <- err
			return
		}
		defer conn.Close(context.Background())
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for n := 1; ; n++ {
			select {
			case <-stop:
				writerDone <- nil
				return
			case <-tick.C:
			}
			if _, err := conn.Exec(e.ctx, `INSERT INTO outbox_events (aggregatetype, aggregateid, type, payload) VALUES ('order', $1, 'Created', $2)`,
				fmt.Sprintf("o-%d", n%13), fmt.Sprint(n)); err != nil {
				writerDone <- err
				return
			}
			written.Store(int64(n))
		}
	}()
	stopWriters := func() int {
		t.Helper()
		select {
		case <-stop:
		default:
			close(stop)
		}
		if err := <-writerDone; err != nil {
			t.Fatal(err)
		}
		writerDone <- nil
		return int(written.Load())
	}
	defer stopWriters()
	confirmed := func() string {
		var lsn string
		if err := e.conn().QueryRow(e.ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, dbzSlot).Scan(&lsn); err != nil {
			t.Fatal(err)
		}
		return lsn
	}
	idle := func(what string) {
		t.Helper()
		at := written.Load()
		e.waitFor("rows written while nothing relays ("+what+")", time.Minute, func() (bool, error) {
			return written.Load() >= at+200, nil
		})
	}
	isDbz := func(run string) bool { return strings.HasPrefix(run, "Debezium") }

	e.waitFor("Debezium to deliver 300 rows", 2*time.Minute, func() (bool, error) {
		n := delivered(isDbz)
		return n >= 300, fmt.Errorf("%d delivered, %d written", n, written.Load())
	})
	// The move: stop Kafka Connect as an operator would (SIGTERM).
	if err := dbz.Stop(time.Minute); err != nil {
		t.Fatal(err)
	}
	dbzStopped := confirmed()
	t.Logf("Kafka Connect stopped after %d rows were written; slot confirmed at %s", written.Load(), dbzStopped)
	idle("Connect stopped")
	relay := e.runBinary("run", "--pg-url", e.url, "--brokers", strings.Join(e.brokers, ","),
		"--slot", dbzSlot, "--publication", dbzSlot, "--table", "public.outbox_events",
		"--no-create-slot", "--preset", "debezium", "--topic-template", topicPrefix+"{aggregate_type}",
		"--dead-letter-topic", e.name+".dlq", "--linger", "1ms", "--metrics-addr", "", "--log-level", "info")
	e.waitFor("walrelay to deliver 300 rows", 2*time.Minute, func() (bool, error) {
		n := delivered(func(run string) bool { return run == "walrelay" })
		return n >= 300, fmt.Errorf("%d delivered, %d written", n, written.Load())
	})

	// PostgreSQL moves the slot's restart_lsn past Debezium's stored offset
	// soon after walrelay confirms (at the next running-xacts record, which
	// a checkpoint writes): make it happen while walrelay streams, so the
	// way back always meets the case docs/debezium.md's step is for. With the
	// default offset.mismatch.strategy (no_validation) Debezium 3.6 then
	// refuses to start: "Last recorded offset is no longer available on
	// the server".
	ckConn := e.conn()
	e.waitFor("the slot's restart_lsn past Debezium's stored offset", time.Minute, func() (bool, error) {
		if _, err := ckConn.Exec(e.ctx, "CHECKPOINT"); err != nil {
			return false, err
		}
		var past bool
		var restart string
		err := ckConn.QueryRow(e.ctx, `SELECT restart_lsn > $1::pg_lsn, restart_lsn::text FROM pg_replication_slots WHERE slot_name = $2`, dbzStopped, dbzSlot).Scan(&past, &restart)
		return err == nil && past, fmt.Errorf("restart_lsn %s, Debezium stopped at %s (%v)", restart, dbzStopped, err)
	})
	// The way back: stop walrelay (SIGTERM), start Kafka Connect again.
	if err := relay.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := relay.Wait(); err != nil {
		t.Fatalf("walrelay on SIGTERM: %v", err)
	}
	t.Logf("walrelay stopped after %d rows were written; slot confirmed at %s", written.Load(), confirmed())
	idle("walrelay stopped")
	// docs/debezium.md's way back: the slot is authoritative.
	if err := dbz.SetConnector(map[string]string{"offset.mismatch.strategy": "trust_slot"}); err != nil {
		t.Fatal(err)
	}
	if err := dbz.Restart(); err != nil {
		t.Fatal(err)
	}
	before := delivered(isDbz)
	e.waitFor("Debezium, back, to deliver 300 rows", 3*time.Minute, func() (bool, error) {
		n := delivered(isDbz) - before
		return n >= 300, fmt.Errorf("%d delivered, %d written (Connect running: %v)", n, written.Load(), dbz.Running())
	})
	n := stopWriters()
	var got map[string]map[int]int
	e.waitFor("every row written on the topic", 2*time.Minute, func() (bool, error) {
		got = runs()
		on := 0
		for i := 1; i <= n; i++ {
			for _, ns := range got {
				if ns[i] > 0 {
					on++
					break
				}
			}
		}
		return on == n, fmt.Errorf("%d of %d rows on the topic", on, n)
	})

	// Each run delivered one gapless range; in order, each starts at or
	// before the row after the previous one's last.
	type span struct {
		run    string
		lo, hi int
	}
	var spans []span
	for run, ns := range got {
		sp := span{run: run, lo: n + 1}
		for i, times := range ns {
			sp.lo, sp.hi = min(sp.lo, i), max(sp.hi, i)
			if times > 1 {
				t.Errorf("%s delivered row %d %d times", run, i, times)
			}
		}
		for i := sp.lo; i <= sp.hi; i++ {
			if ns[i] == 0 {
				t.Errorf("%s delivered rows %d..%d but not row %d", run, sp.lo, sp.hi, i)
				break
			}
		}
		spans = append(spans, sp)
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].lo < spans[j].lo })
	if len(spans) != 3 || !isDbz(spans[0].run) || spans[1].run != "walrelay" || !isDbz(spans[2].run) {
		t.Fatalf("want Debezium, walrelay, Debezium again; got %+v", spans)
	}
	if spans[0].lo != 1 || spans[2].hi != n {
		t.Fatalf("rows 1..%d written, delivered %+v", n, spans)
	}
	var report []string
	for i, sp := range spans {
		twice := 0
		if i > 0 {
			prev := spans[i-1]
			if sp.lo > prev.hi+1 {
				t.Errorf("rows %d..%d lost between %s and %s", prev.hi+1, sp.lo-1, prev.run, sp.run)
			}
			twice = max(0, prev.hi-sp.lo+1)
			if twice >= prev.hi-prev.lo+1 {
				t.Errorf("%s re-sent every row %s had delivered: the slot's position never advanced", sp.run, prev.run)
			}
		}
		report = append(report, fmt.Sprintf("%s %d..%d (%d also delivered before)", strings.Fields(sp.run)[0], sp.lo, sp.hi, twice))
	}
	t.Logf("%d rows written, none lost: %s", n, strings.Join(report, "; "))
}
