package integration

// Edges of a running stream: an outbox table that loses a mapped column
// while the relay runs, a dead-letter record larger than the dead-letter
// topic accepts, and an exactly-once stop whose final Kafka commit hangs.

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// TestSchemaChangeWhileRunning changes the outbox table under a running
// relay: rows, DROP COLUMN payload, rows, ADD COLUMN payload, rows, RENAME
// aggregate_id, rows, RENAME it back, rows. The relay never exits nor
// restarts its stream; the rows written while a mapped column was missing
// are on the dead-letter topic with reason unmappable, their id, their
// aggregate id when the table still had it, and an LSN inside the WAL
// their transaction wrote; every other row is on its topic, in order.
func TestSchemaChangeWhileRunning(t *testing.T) {
	e := newEnv(t)
	rr, reg := e.startRelayGathered(e.config())
	c := e.consume()
	conn := e.conn()

	type row struct {
		phase      string
		id         string
		unmappable bool
		hasAggID   bool
		from, upTo decoder.LSN
	}
	var rows []*row
	insert := func(phase, sql string, unmappable, hasAggID bool) {
		t.Helper()
		for i := range 2 {
			r := &row{phase: phase, unmappable: unmappable, hasAggID: hasAggID, from: e.currentLSN(conn)}
			if err := conn.QueryRow(e.ctx, sql, len(rows)).Scan(&r.id); err != nil {
				t.Fatalf("%s, row %d: %v", phase, i, err)
			}
			r.upTo = e.currentLSN(conn)
			rows = append(rows, r)
		}
	}
	full := `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		VALUES ('order', 'agg-1', 'T', jsonb_build_object('seq', $1::int), $1) RETURNING id::text`
	insert("before", full, false, true)
	c.waitIDs(len(rows), 30*time.Second)

	e.exec(`ALTER TABLE outbox DROP COLUMN payload`)
	insert("payload dropped", `INSERT INTO outbox (aggregate_type, aggregate_id, type, seq)
		VALUES ('order', 'agg-1', 'T', $1) RETURNING id::text`, true, true)
	e.exec(`ALTER TABLE outbox ADD COLUMN payload jsonb`)
	insert("payload added back", full, false, true)
	e.exec(`ALTER TABLE outbox RENAME COLUMN aggregate_id TO agg_id`)
	insert("aggregate_id renamed", `INSERT INTO outbox (aggregate_type, agg_id, type, payload, seq)
		VALUES ('order', 'agg-1', 'T', jsonb_build_object('seq', $1::int), $1) RETURNING id::text`, true, false)
	e.exec(`ALTER TABLE outbox RENAME COLUMN agg_id TO aggregate_id`)
	insert("renamed back", full, false, true)

	recs := c.waitIDs(len(rows), 60*time.Second)
	if ok, err := rr.returned(); ok {
		t.Fatalf("the relay exited: %v", err)
	}
	byID := map[string]*kgo.Record{}
	for _, rec := range recs {
		id, _ := header(rec, "id")
		if prev := byID[id]; prev != nil {
			t.Errorf("id %s read twice: on %s and %s", id, prev.Topic, rec.Topic)
		}
		byID[id] = rec
	}
	dlq := e.topicPrefix() + "dlq"
	var wantOrder, gotOrder []string
	unmappable := 0
	for _, r := range rows {
		rec := byID[r.id]
		switch {
		case rec == nil:
			t.Errorf("%s: row %s not read", r.phase, r.id)
		case !r.unmappable:
			if rec.Topic != e.topic("order") {
				t.Errorf("%s: row %s on %s, want %s", r.phase, r.id, rec.Topic, e.topic("order"))
			}
			wantOrder = append(wantOrder, r.id)
		default:
			unmappable++
			if rec.Topic != dlq {
				t.Errorf("%s: row %s on %s, want the dead-letter topic", r.phase, r.id, rec.Topic)
				continue
			}
			if got, _ := header(rec, deadletter.HeaderReason); got != string(deadletter.ReasonUnmappable) {
				t.Errorf("%s: %s = %q, want %q", r.phase, deadletter.HeaderReason, got, deadletter.ReasonUnmappable)
			}
			if d, _ := header(rec, deadletter.HeaderDetail); !strings.Contains(d, "public.outbox") {
				t.Errorf("%s: %s = %q does not name the table", r.phase, deadletter.HeaderDetail, d)
			}
			aggID, ok := header(rec, deadletter.HeaderAggregateID)
			if r.hasAggID && aggID != "agg-1" {
				t.Errorf("%s: %s = %q, want agg-1", r.phase, deadletter.HeaderAggregateID, aggID)
			}
			if !r.hasAggID && ok {
				t.Errorf("%s: %s = %q for a row whose table had no aggregate_id", r.phase, deadletter.HeaderAggregateID, aggID)
			}
			lsnText, _ := header(rec, deadletter.HeaderLSN)
			if lsn, err := slot.ParseLSN(lsnText); err != nil || lsn < r.from || lsn > r.upTo {
				t.Errorf("%s: %s = %q (%v), want inside the WAL its transaction wrote [%s, %s]", r.phase, deadletter.HeaderLSN, lsnText, err, r.from, r.upTo)
			}
		}
	}
	for _, rec := range recs {
		if rec.Topic == e.topic("order") {
			id, _ := header(rec, "id")
			gotOrder = append(gotOrder, id)
		}
	}
	if fmt.Sprint(gotOrder) != fmt.Sprint(wantOrder) {
		t.Errorf("rows on %s in order %v, want %v", e.topic("order"), gotOrder, wantOrder)
	}
	if got := gathered(reg, "walrelay_events_dead_lettered_total")[string(deadletter.ReasonUnmappable)]; got != float64(unmappable) {
		t.Errorf("walrelay_events_dead_lettered_total{reason=unmappable} = %v, want %d", got, unmappable)
	}
	if restarts := gathered(reg, "walrelay_stream_restarts_total"); len(restarts) != 0 {
		t.Errorf("the stream restarted: walrelay_stream_restarts_total %v", restarts)
	}
	if !rr.relay.Streaming() {
		t.Error("relay not streaming at the end")
	}
}

// TestSchemaChangeOnInvalidFail renames the payload column under a relay
// with --on-invalid fail and inserts a row: Run returns an
// *InvalidEventError with reason unmappable, the row's id and the real
// LSN of its message (never 0/0), and the row is published nowhere.
func TestSchemaChangeOnInvalidFail(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.Router.OnInvalid = router.InvalidFail
	rr := e.startRelay(cfg)
	c := e.consume()
	conn := e.conn()
	e.exec(`ALTER TABLE outbox RENAME COLUMN payload TO body`)
	from := e.currentLSN(conn)
	var id string
	if err := conn.QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, body)
		VALUES ('order', 'agg-1', 'T', '{}') RETURNING id::text`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	upTo := e.currentLSN(conn)
	var err error
	e.waitFor("the relay to stop", 30*time.Second, func() (bool, error) {
		var ok bool
		ok, err = rr.returned()
		return ok, nil
	})
	var ie *deadletter.InvalidEventError
	if !errors.As(err, &ie) {
		t.Fatalf("Run returned %v, want an *InvalidEventError", err)
	}
	if ie.Reason != deadletter.ReasonUnmappable || ie.ID != id || ie.LSN < from || ie.LSN > upTo {
		t.Errorf("error %+v: want reason %s, id %s, LSN in [%s, %s]", *ie, deadletter.ReasonUnmappable, id, from, upTo)
	}
	if msg := err.Error(); strings.Contains(msg, "0/0") || !strings.Contains(msg, ie.LSN.String()) || !strings.Contains(msg, `"payload"`) {
		t.Errorf("error %q: want the row's LSN (never 0/0) and the missing column", msg)
	}
	for _, rec := range c.records() {
		if got, _ := header(rec, "id"); got == id {
			t.Errorf("row %s published on %s although the relay stopped at it", id, rec.Topic)
		}
	}
}

// TestDeadLetterOverDeadLetterTopicLimit creates the dead-letter topic
// beforehand with max.message.bytes 2048 (kfake enforces it) and inserts an
// invalid row (NULL aggregate id) with a 5000-byte payload, well under
// --max-record-bytes, then a valid row: the dead-letter record arrives
// without the payload (walrelay.payload_omitted says its length), the
// valid row after it is delivered, and the stream never restarted.
func TestDeadLetterOverDeadLetterTopicLimit(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	adm, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer adm.Close()
	const dlqLimit = 2048
	limit := fmt.Sprint(dlqLimit)
	dlq := e.topicPrefix() + "dlq"
	resp, err := kadm.NewClient(adm).CreateTopic(e.ctx, 1, 1, map[string]*string{"max.message.bytes": &limit}, dlq)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("create %s: %v", dlq, err)
	}

	rr, reg := e.startRelayGathered(e.config())
	c := e.consume()
	conn := e.conn()
	payload := `{"pad": "` + strings.Repeat("x", 5000-11) + `"}`
	var bad, good string
	if err := conn.QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
		VALUES ('order', NULL, 'T', $1::jsonb) RETURNING id::text`, payload).Scan(&bad); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
		VALUES ('order', 'agg-1', 'T', '{}') RETURNING id::text`).Scan(&good); err != nil {
		t.Fatal(err)
	}
	recs := c.waitIDs(2, 30*time.Second)
	for _, rec := range recs {
		switch id, _ := header(rec, "id"); id {
		case bad:
			if rec.Topic != dlq {
				t.Errorf("invalid row on %s, want %s", rec.Topic, dlq)
			}
			if rec.Value != nil {
				t.Errorf("dead-letter value of %d bytes, want none: it does not fit the topic's %d", len(rec.Value), dlqLimit)
			}
			if got, _ := header(rec, deadletter.HeaderPayloadOmit); got != fmt.Sprint(len(payload)) {
				t.Errorf("%s = %q, want %d", deadletter.HeaderPayloadOmit, got, len(payload))
			}
			if got, _ := header(rec, deadletter.HeaderReason); got != string(deadletter.ReasonNoAggregateID) {
				t.Errorf("%s = %q, want %s", deadletter.HeaderReason, got, deadletter.ReasonNoAggregateID)
			}
		case good:
			if rec.Topic != e.topic("order") {
				t.Errorf("valid row on %s, want %s", rec.Topic, e.topic("order"))
			}
		}
	}
	if ok, err := rr.returned(); ok {
		t.Fatalf("the relay exited: %v", err)
	}
	if n := gathered(reg, "walrelay_produce_errors_total")[""]; n != 0 {
		t.Errorf("walrelay_produce_errors_total = %v, want 0", n)
	}
	if restarts := gathered(reg, "walrelay_stream_restarts_total"); len(restarts) != 0 {
		t.Errorf("the stream restarted: walrelay_stream_restarts_total %v", restarts)
	}
}

// TestExactlyOnceStopWithinShutdownTimeout stops an exactly-once relay
// whose open Kafka transaction cannot commit: the broker refuses every
// produce request (retriably, so the producer retries forever). With
// --shutdown-timeout 2s and --txn-timeout 60s, Run must return within the
// shutdown timeout plus a margin far below the transaction timeout: the
// final commit and the wait for acks share the shutdown timeout.
func TestExactlyOnceStopWithinShutdownTimeout(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	cfg := e.config()
	cfg.ExactlyOnce = true
	cfg.Router.CheckpointTopic = e.checkpointTopic()
	cfg.Router.TransactionTimeout = 60 * time.Second
	cfg.TxnMaxInterval = 20 * time.Second // the transaction is open when the stop comes
	cfg.ShutdownTimeout = 2 * time.Second
	const margin = 5 * time.Second
	if cfg.ShutdownTimeout+margin >= cfg.Router.TransactionTimeout/2 {
		t.Fatal("the transaction timeout must dwarf the shutdown timeout for this test to mean anything")
	}
	rr := e.startRelay(cfg)

	fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	defer fault.Remove()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('order', 'agg-1', 'T', '{}')`)
	e.waitFor("produce requests refused", 30*time.Second, func() (bool, error) { return fault.Hits() > 0, nil })

	start := time.Now()
	rr.cancel()
	select {
	case err := <-rr.done:
		rr.done <- err
		took := time.Since(start)
		if err != nil {
			t.Errorf("Run returned %v after a stop, want nil", err)
		}
		if took > cfg.ShutdownTimeout+margin {
			t.Errorf("Run returned %s after the stop, want at most --shutdown-timeout %s + %s (--txn-timeout is %s)",
				took.Round(time.Millisecond), cfg.ShutdownTimeout, margin, cfg.Router.TransactionTimeout)
		}
		t.Logf("stopped in %s", took.Round(time.Millisecond))
	case <-time.After(cfg.Router.TransactionTimeout + cfg.ShutdownTimeout + 30*time.Second):
		t.Fatalf("Run did not return within --txn-timeout + --shutdown-timeout + 30s")
	}
}
