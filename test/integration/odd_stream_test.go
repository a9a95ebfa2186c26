package integration

// Tests of odd rows and odd topics that a relay must stream through
// (issue 21): a row --binary cannot decode, a LATIN1 database, more
// aggregate types than --max-topics across a restart, a topic that
// refuses old timestamps, and two relays on two slots of one publication.

import (
	"bytes"
	"strconv"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/router"
)

// byIDHeader indexes records by their id header (the last copy wins).
func byIDHeader(recs []*kgo.Record) map[string]*kgo.Record {
	out := map[string]*kgo.Record{}
	for _, r := range recs {
		if id, ok := header(r, "id"); ok {
			out[id] = r
		}
	}
	return out
}

// TestBinaryUndecodableRowDeadLettered (issue 21, case 1): with --binary,
// a row whose mapped column changed, while the relay streams, to a type
// binary mode cannot render (text[]) is dead-lettered as undecodable,
// and the rows after it are published: the relay neither stops nor
// restarts on it.
func TestBinaryUndecodableRowDeadLettered(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.Binary = true
	rr, reg := e.startRelayGathered(cfg)
	c := e.consume()
	e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ('00000000-0000-0000-0000-000000000001', 'order', 'k1', 'T', '{}')`)
	e.exec(`ALTER TABLE outbox ALTER COLUMN aggregate_id TYPE text[] USING ARRAY[aggregate_id]`)
	e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ('00000000-0000-0000-0000-000000000002', 'order', ARRAY['k2'], 'T', '{}')`)
	e.exec(`ALTER TABLE outbox ALTER COLUMN aggregate_id TYPE text USING aggregate_id[1]`)
	for i := 3; i <= 5; i++ {
		e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'order', 'k', 'T', '{}')`,
			"00000000-0000-0000-0000-00000000000"+strconv.Itoa(i))
	}
	recs := c.waitIDs(5, 60*time.Second)
	byID := byIDHeader(recs)
	for i := 1; i <= 5; i++ {
		id := "00000000-0000-0000-0000-00000000000" + strconv.Itoa(i)
		r := byID[id]
		if i == 2 {
			reason, _ := header(r, deadletter.HeaderReason)
			detail, _ := header(r, deadletter.HeaderDetail)
			if r.Topic != e.topic("dlq") || reason != string(deadletter.ReasonUndecodable) || !bytes.Contains([]byte(detail), []byte("1009")) {
				t.Errorf("row 2 (text[] aggregate id) on %s, reason %q, detail %q: want the dead-letter topic, reason undecodable, naming type OID 1009", r.Topic, reason, detail)
			}
			continue
		}
		if r.Topic != e.topic("order") {
			t.Errorf("row %d on %s, want %s", i, r.Topic, e.topic("order"))
		}
	}
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay stopped: %v", err)
	}
	if n := gathered(reg, "walrelay_stream_restarts_total"); len(n) != 0 {
		t.Errorf("stream restarts %v, want none", n)
	}
	if dl := gathered(reg, "walrelay_events_dead_lettered_total"); dl[string(deadletter.ReasonUndecodable)] != 1 {
		t.Errorf("dead-lettered by reason = %v, want undecodable 1", dl)
	}
}

// TestLatin1PublishedAsUTF8 (issue 21, case 3): the text of a LATIN1
// database reaches Kafka as UTF-8, from the initial snapshot and from the
// stream alike: key, value and headers.
func TestLatin1PublishedAsUTF8(t *testing.T) {
	e := newEnv(t)
	e.useDatabase("LATIN1")
	// chr(233) is é in LATIN1; the statements themselves are ASCII, so
	// the test's own connection encoding plays no part.
	insert := func(id string) {
		e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
			VALUES ($1, 'order', 'caf' || chr(233), 'Cr' || chr(233) || 'e', jsonb_build_object('name', 'caf' || chr(233)))`, id)
	}
	insert("00000000-0000-0000-0000-000000000001") // published by the snapshot
	cfg := e.config()
	cfg.InitialSnapshot = true
	e.startRelay(cfg)
	insert("00000000-0000-0000-0000-000000000002") // published by the stream
	c := e.consume()
	recs := byIDHeader(c.waitIDs(2, 60*time.Second))
	for _, id := range []string{"00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000002"} {
		r := recs[id]
		typ, _ := header(r, "type")
		if string(r.Key) != "café" || string(r.Value) != `{"name": "café"}` || typ != "Crée" {
			t.Errorf("row %s: key %q, value %q, type %q: want UTF-8 café, {\"name\": \"café\"}, Crée", id, r.Key, r.Value, typ)
		}
	}
}

// TestMaxTopicsCountsBrokerTopics (issue 21, case 2): --max-topics counts
// the event topics that exist on the broker, so that after a restart an
// established aggregate type is still published and new ones beyond the
// bound are dead-lettered, not the other way round.
func TestMaxTopicsCountsBrokerTopics(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.Router.MaxTopics = 3
	c := e.consume()
	ins := func(id int, agg string) {
		e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, $2, 'k', 'T', '{}')`,
			"00000000-0000-0000-0000-00000000000"+strconv.Itoa(id), agg)
	}
	rr := e.startRelay(cfg)
	ins(1, "a")
	ins(2, "b")
	ins(3, "c")
	c.waitIDs(3, 60*time.Second)
	if err := rr.stop(t); err != nil {
		t.Fatal(err)
	}
	// A new process: nothing of the first one's count survives in memory.
	e.startRelay(cfg)
	ins(4, "d")
	ins(5, "e")
	ins(6, "f")
	ins(7, "a")
	byID := byIDHeader(c.waitIDs(7, 60*time.Second))
	if r := byID["00000000-0000-0000-0000-000000000007"]; r.Topic != e.topic("a") {
		reason, _ := header(r, deadletter.HeaderReason)
		t.Errorf("row of the established type a after the restart on %s (reason %q), want %s", r.Topic, reason, e.topic("a"))
	}
	for i := 4; i <= 6; i++ {
		r := byID["00000000-0000-0000-0000-00000000000"+strconv.Itoa(i)]
		if reason, _ := header(r, deadletter.HeaderReason); r.Topic != e.topic("dlq") || reason != string(deadletter.ReasonTooManyTopics) {
			t.Errorf("row %d of a new type on %s (reason %q), want the dead-letter topic with too_many_topics: 3 event topics exist", i, r.Topic, reason)
		}
	}
	td := e.brokerTopics()
	for _, agg := range []string{"d", "e", "f"} {
		if td.Has(e.topic(agg)) {
			t.Errorf("topic %s was created past --max-topics 3", e.topic(agg))
		}
	}
}

// TestTimestampRefusedFallsBackToProduceTime (issue 21, case 5): a topic
// that refuses old record timestamps does not stall the stream. On Apache
// Kafka the topic has message.timestamp.before.max.ms 3000 and the
// backlog is older: the relay reads the bound and gives the backlog the
// produce time as timestamp, the commit time in a header, without a
// single refusal; fresh events keep their commit time. On kfake, which
// has no such setting, the broker answers INVALID_TIMESTAMP as that
// broker would, for the records committed before a cut-off: one restart,
// then every record of the topic carries the produce time.
func TestTimestampRefusedFallsBackToProduceTime(t *testing.T) {
	e := newEnv(t)
	if e.kafka == nil && apache == nil {
		t.Skip("needs kfake (to answer INVALID_TIMESTAMP) or Apache Kafka (message.timestamp.before.max.ms)")
	}
	ins := func(from, to int) {
		for i := from; i <= to; i++ {
			e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'order', 'k', 'T', '{}')`,
				"00000000-0000-0000-0000-0000000000"+strconv.Itoa(10+i))
		}
	}
	isBacklog := func(r *kgo.Record) bool {
		id, _ := header(r, "id")
		return id < "00000000-0000-0000-0000-000000000021"
	}
	const before = 3 * time.Second
	if e.kafka == nil {
		e.createTopic(3, -1, map[string]string{"message.timestamp.before.max.ms": strconv.Itoa(int(before.Milliseconds()))}, e.topic("order"))
	}
	// The backlog: committed before the relay's first start, with its
	// snapshot off so that it comes through the stream with commit times.
	cfg := e.config()
	cfg.InitialSnapshot = false
	rr := e.startRelay(cfg)
	if err := rr.stop(t); err != nil {
		t.Fatal(err)
	}
	ins(1, 10)
	conn := e.conn()
	var cutoff time.Time
	if err := conn.QueryRow(e.ctx, "SELECT clock_timestamp()").Scan(&cutoff); err != nil {
		t.Fatal(err)
	}
	if e.kafka != nil {
		old := func(req kmsg.Request) bool {
			for _, tp := range req.(*kmsg.ProduceRequest).Topics {
				for _, p := range tp.Partitions {
					var b kmsg.RecordBatch
					if err := b.ReadFrom(p.Records); err == nil && b.FirstTimestamp < cutoff.UnixMilli() {
						return true
					}
				}
			}
			return false
		}
		e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: e.topic("order"), Err: kerr.InvalidTimestamp, Count: -1, When: old})
	} else {
		// The backlog must be older than the topic allows.
		e.waitFor("the backlog older than message.timestamp.before.max.ms", 30*time.Second, func() (bool, error) {
			var age time.Duration
			err := conn.QueryRow(e.ctx, "SELECT clock_timestamp() - $1::timestamptz", cutoff).Scan(&age)
			return age > before+time.Second, err
		})
	}
	logs := e.observeLogs()
	_, reg := e.startRelayGathered(cfg)
	c := e.consume()
	c.waitIDs(10, 60*time.Second)
	ins(11, 20) // fresh events
	recs := c.waitIDs(20, 60*time.Second)
	for _, r := range recs {
		if r.Topic != e.topic("order") {
			t.Errorf("record %v on %s, want %s", r.Headers, r.Topic, e.topic("order"))
			continue
		}
		ct, stamped := header(r, router.HeaderCommitTime)
		ms, err := strconv.ParseInt(ct, 10, 64)
		switch {
		case isBacklog(r) && (!stamped || err != nil || ms >= cutoff.UnixMilli() || r.Timestamp.Before(cutoff)):
			t.Errorf("backlog record: timestamp %s, %s %q: want the produce time (after %s) and the commit time (before it) in the header", r.Timestamp, router.HeaderCommitTime, ct, cutoff)
		case !isBacklog(r) && e.kafka != nil && (!stamped || err != nil):
			t.Errorf("fresh record after the refusal: %s %q: want the commit time in the header (the topic's records carry the produce time)", router.HeaderCommitTime, ct)
		case !isBacklog(r) && e.kafka == nil && (stamped || r.Timestamp.Before(cutoff)):
			t.Errorf("fresh record: timestamp %s, %s %q: want its commit time, no header", r.Timestamp, router.HeaderCommitTime, ct)
		}
	}
	restarts := gathered(reg, "walrelay_stream_restarts_total")["kafka"]
	refusals := len(warnings(logs, "Kafka refused a record's timestamp", zap.String("topic", e.topic("order"))))
	if want := map[bool]int{true: 1, false: 0}[e.kafka != nil]; restarts != float64(want) || refusals != want {
		t.Errorf("%v restarts for Kafka and %d warnings of a refused timestamp, want %d of each", restarts, refusals, want)
	}
}

// TestSameTopicsFromTwoSlotsWarned (issue 21, case 8): a second relay
// streaming the same publication to the same topics from another slot
// publishes every event twice: it says so at start. A relay of the same
// publication with another topic template does not.
func TestSameTopicsFromTwoSlotsWarned(t *testing.T) {
	e := newEnv(t)
	for _, s := range []string{e.name + "_second", e.name + "_third"} {
		t.Cleanup(func() {
			e.exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", s)
		})
	}
	first := e.config()
	e.startRelay(first)
	logs := e.observeLogs()
	second := e.config()
	second.Slot = e.name + "_second"
	e.startRelay(second)
	const warning = "another walrelay streams the same publication to the same topics"
	if got := warnings(logs, warning, zap.String("other_slot", first.Slot), zap.String("slot", second.Slot)); len(got) != 1 {
		t.Errorf("%d warnings that slot %s streams the same topics, want 1: %v", len(got), first.Slot, logs.All())
	}
	third := e.config()
	third.Slot = e.name + "_third"
	third.Router.TopicTemplate = e.topicPrefix() + "copy.{aggregate_type}"
	e.startRelay(third)
	if got := warnings(logs, warning, zap.String("slot", third.Slot)); len(got) != 0 {
		t.Errorf("a relay with another topic template was warned: %v", got)
	}
}
