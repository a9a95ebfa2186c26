package integration

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/test/debezium"
)

// TestDebeziumAvroSameRecords runs Debezium's Outbox Event Router with an
// Avro converter (Apicurio's, table.expand.json.payload=true, registering
// the schema it infers from the payloads under <topic>-value in
// Confluent's framing) and walrelay --preset debezium --value-format avro
// against the same registry, on the same rows through two slots, to the
// same topics, and compares the records id by id: partition, key, the
// outbox headers and the value bytes (the wire header with the schema id,
// and the Avro body). walrelay registers nothing: it frames with the
// schema Debezium registered. Then walrelay takes over Debezium's slot in
// place, with the registry flags, and frames the rows written meanwhile
// as Debezium did.
func TestDebeziumAvroSameRecords(t *testing.T) {
	needDebezium(t)
	ccompat := needRegistry(t)
	e := newEnv(t)
	e.debeziumOutbox("outbox_avro", "jsonb")
	dbzSlot, wrSlot := e.name+"_dbz", e.name+"_wr"
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE public.outbox_avro WITH (publish = 'insert')`, e.name))
	// walrelay's slot exists from the start, so that it holds every row;
	// walrelay starts once Debezium has registered the schemas.
	e.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, wrSlot)
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), e.url)
		if err == nil {
			_, _ = conn.Exec(context.Background(), "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", dbzSlot)
			conn.Close(context.Background())
		}
	})
	prefix := e.name + ".outbox.event."
	dbz := e.startDebezium(debezium.Options{
		Slot: dbzSlot, Publication: e.name, Tables: []string{"public.outbox_avro"},
		TopicReplacement: prefix + "${routedByValue}",
		AvroRegistryURL:  strings.Replace(ccompat, "/apis/ccompat/v7", "/apis/registry/v2", 1),
	})
	e.waitPeerSlot(dbzSlot, 3*time.Minute, dbz)

	c := e.consume()
	conn := e.conn()
	var ids []string
	insert := func(tx pgx.Tx, aggType, aggID, payload string) {
		t.Helper()
		var id string
		if err := tx.QueryRow(e.ctx, `INSERT INTO outbox_avro (aggregatetype, aggregateid, type, payload) VALUES ($1, $2, 'Created', $3) RETURNING id::text`,
			aggType, aggID, payload).Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	tx, err := conn.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	// One shape per topic, as a topic of one event type has: strings,
	// integers small and large, a double, a boolean, nested objects and
	// arrays.
	for i := range 12 {
		insert(tx, "order", fmt.Sprintf("o-%d", i%5), fmt.Sprintf(
			`{"orderId": %d, "customer": {"name": "cust %d", "vip": %v}, "lines": [{"sku": "s-%d", "qty": %d}], "total": %d.25, "placedAt": %d}`,
			i, i, i%2 == 0, i, i+1, i*10, int64(1700000000000)+int64(i)))
		insert(tx, "payment", fmt.Sprintf("p-%d", i%3), fmt.Sprintf(`{"paymentId": "pay-%d", "amount": %d.5, "tags": ["a", "b%d"]}`, i, i, i))
	}
	if err := tx.Commit(e.ctx); err != nil {
		t.Fatal(err)
	}
	isDbz := func(r *kgo.Record) bool { _, ctx := debeziumHeaders(r); return ctx != "" }
	e.waitFor("Debezium to deliver every row", 3*time.Minute, func() (bool, error) {
		n := 0
		for _, r := range c.records() {
			if isDbz(r) {
				n++
			}
		}
		return n >= len(ids), fmt.Errorf("Debezium delivered %d of %d (Connect running: %v)", n, len(ids), dbz.Running())
	})

	wr := e.runBinary("run", "--pg-url", e.url, "--brokers", strings.Join(e.brokers, ","),
		"--slot", wrSlot, "--publication", e.name, "--table", "public.outbox_avro", "--no-create-slot", "--no-create-publication",
		"--preset", "debezium", "--topic-template", prefix+"{aggregate_type}", "--dead-letter-topic", e.name+".dlq",
		"--value-format", "avro", "--schema-registry-url", ccompat,
		"--linger", "1ms", "--metrics-addr", "", "--log-level", "info")
	e.waitFor("walrelay to deliver every row", 2*time.Minute, func() (bool, error) {
		n := 0
		for _, r := range c.records() {
			if r.Topic == e.name+".dlq" {
				reason, _ := header(r, "walrelay.reason")
				detail, _ := header(r, "walrelay.detail")
				return false, fmt.Errorf("walrelay dead-lettered a row: %s: %s", reason, detail)
			}
			if !isDbz(r) {
				n++
			}
		}
		return n >= len(ids), fmt.Errorf("walrelay delivered %d of %d", n, len(ids))
	})

	byID := map[bool]map[string]*kgo.Record{false: {}, true: {}}
	for _, r := range c.records() {
		id, ok := header(r, "id")
		if !ok {
			t.Fatalf("record without an id header on %s: %v", r.Topic, r.Headers)
		}
		byID[isDbz(r)][id] = r
	}
	for _, id := range ids {
		w, d := byID[false][id], byID[true][id]
		if w == nil || d == nil {
			t.Fatalf("id %s: walrelay's record %v, Debezium's %v", id, w != nil, d != nil)
		}
		if w.Topic != d.Topic || w.Partition != d.Partition || !bytes.Equal(w.Key, d.Key) {
			t.Errorf("id %s: %s/%d key %q (walrelay) vs %s/%d key %q (Debezium)", id, w.Topic, w.Partition, w.Key, d.Topic, d.Partition, d.Key)
		}
		if dh, _ := debeziumHeaders(d); headerList(w.Headers) != dh {
			t.Errorf("id %s: headers %s (walrelay) vs %s (Debezium)", id, headerList(w.Headers), dh)
		}
		if !bytes.Equal(w.Value, d.Value) {
			t.Errorf("id %s on %s: value\n%x (walrelay)\n%x (Debezium)", id, w.Topic, w.Value, d.Value)
		}
	}
	t.Logf("%d records compared: equal topic, partition, key, outbox headers and value bytes", len(ids))

	// The move in place: Debezium stops (SIGTERM: it flushes its offsets
	// and confirms the slot), rows are written meanwhile, and walrelay
	// takes over Debezium's slot with the registry flags
	// (docs/debezium.md): those rows arrive framed as Debezium framed the
	// earlier ones, under the schemas it registered.
	if err := wr.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = wr.Wait()
	if err := dbz.Stop(time.Minute); err != nil {
		t.Fatal(err)
	}
	before := len(ids)
	tx, err = conn.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := 100; i < 103; i++ {
		insert(tx, "order", fmt.Sprintf("o-%d", i%5), fmt.Sprintf(
			`{"orderId": %d, "customer": {"name": "cust %d", "vip": true}, "lines": [{"sku": "s-%d", "qty": 1}], "total": 1.25, "placedAt": %d}`, i, i, i, int64(1700000000000)+int64(i)))
	}
	if err := tx.Commit(e.ctx); err != nil {
		t.Fatal(err)
	}
	e.runBinary("run", "--pg-url", e.url, "--brokers", strings.Join(e.brokers, ","),
		"--slot", dbzSlot, "--publication", e.name, "--table", "public.outbox_avro", "--no-create-slot", "--no-create-publication",
		"--preset", "debezium", "--topic-template", prefix+"{aggregate_type}", "--dead-letter-topic", e.name+".dlq",
		"--value-format", "avro", "--schema-registry-url", ccompat,
		"--linger", "1ms", "--metrics-addr", "", "--log-level", "info")
	orderHeader := byID[true][ids[0]].Value[:5] // Debezium's framing of the order topic
	e.waitFor("walrelay, on Debezium's slot, to deliver the rows written after Debezium stopped", 2*time.Minute, func() (bool, error) {
		got := map[string]bool{}
		for _, r := range c.records() {
			id, _ := header(r, "id")
			if r.Topic == e.name+".dlq" {
				detail, _ := header(r, "walrelay.detail")
				return false, fmt.Errorf("walrelay dead-lettered a row: %s", detail)
			}
			if !isDbz(r) && slices.Contains(ids[before:], id) {
				if !bytes.HasPrefix(r.Value, orderHeader) {
					return false, fmt.Errorf("id %s framed %x; want Debezium's %x", id, r.Value[:5], orderHeader)
				}
				got[id] = true
			}
		}
		return len(got) == len(ids)-before, fmt.Errorf("%d of the %d rows written after the move", len(got), len(ids)-before)
	})
}
