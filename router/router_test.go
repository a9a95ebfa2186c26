package router

import (
	"bytes"
	"fmt"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
)

// testAcker counts the Add and Ack calls of one "transaction".
type testAcker struct{ adds, acks atomic.Int64 }

func (a *testAcker) Add() { a.adds.Add(1) }
func (a *testAcker) Ack() { a.acks.Add(1) }

var outboxTable = &decoder.Table{Schema: "public", Name: "outbox"}

// commitTime is a commit time with millisecond precision, as Kafka keeps it.
var commitTime = time.Date(2025, 3, 14, 15, 9, 26, 535_000_000, time.UTC)

// event returns a valid event of aggregate agg with key id and payload.
func event(id, agg, key, payload string) *decoder.Event {
	return &decoder.Event{
		Table:         outboxTable,
		ID:            []byte(id),
		AggregateType: []byte(agg),
		AggregateID:   []byte(key),
		Type:          []byte(agg + "Created"),
		Payload:       []byte(payload),
		CommitTime:    commitTime,
	}
}

// offlineRouter returns a Router whose client points at a closed port and
// is never used: for tests that build records and routes without a broker.
func offlineRouter(t testing.TB, cfg Config) *Router {
	t.Helper()
	r, err := New(withDefaults(cfg), []kgo.Opt{kgo.SeedBrokers("127.0.0.1:1")}, zap.NewNop(), metrics.NewUnregistered(), func(err error) {
		t.Errorf("fatal called on an offline router: %v", err)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}

type hdr struct{ k, v string }

func headersOf(hs []kgo.RecordHeader) []hdr {
	out := make([]hdr, len(hs))
	for i, h := range hs {
		out[i] = hdr{h.Key, string(h.Value)}
	}
	return out
}

// TestNewRecord proves how an event becomes a record: the topic from the
// template, key = aggregate id, value = payload (NULL stays nil, a
// tombstone; empty stays empty and non-nil), timestamp = commit time, and
// headers in order id, type (absent when NULL), then the extra headers whose
// value is not NULL, under the configured id and type header names.
func TestNewRecord(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		ev      decoder.Event
		topic   string
		headers []hdr
	}{
		{
			name: "typical",
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f"),
				AggregateType: []byte("order"), AggregateID: []byte("order-42"),
				Type: []byte("OrderCreated"), Payload: []byte(`{"total":12.5}`), CommitTime: commitTime,
			},
			topic:   "outbox.event.order",
			headers: []hdr{{"id", "0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f"}, {"type", "OrderCreated"}},
		},
		{
			name: "NULL type omits the type header",
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("7"), AggregateType: []byte("order"),
				AggregateID: []byte("k"), Payload: []byte("p"), CommitTime: commitTime,
			},
			topic:   "outbox.event.order",
			headers: []hdr{{"id", "7"}},
		},
		{
			name: "empty type is kept",
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("7"), AggregateType: []byte("order"),
				AggregateID: []byte("k"), Type: []byte{}, Payload: []byte("p"), CommitTime: commitTime,
			},
			topic:   "outbox.event.order",
			headers: []hdr{{"id", "7"}, {"type", ""}},
		},
		{
			name: "NULL payload is a tombstone",
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("8"), AggregateType: []byte("order"),
				AggregateID: []byte("k"), Type: []byte("OrderDeleted"), CommitTime: commitTime,
			},
			topic:   "outbox.event.order",
			headers: []hdr{{"id", "8"}, {"type", "OrderDeleted"}},
		},
		{
			name: "empty payload stays empty",
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("9"), AggregateType: []byte("order"),
				AggregateID: []byte("k"), Payload: []byte{}, CommitTime: commitTime,
			},
			topic:   "outbox.event.order",
			headers: []hdr{{"id", "9"}},
		},
		{
			name: "empty aggregate id is an empty key",
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("10"), AggregateType: []byte("order"),
				AggregateID: []byte{}, Payload: []byte("p"), CommitTime: commitTime,
			},
			topic:   "outbox.event.order",
			headers: []hdr{{"id", "10"}},
		},
		{
			name: "extra headers in order, NULL ones omitted",
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("11"), AggregateType: []byte("order"),
				AggregateID: []byte("k"), Type: []byte("T"), Payload: []byte("p"), CommitTime: commitTime,
				Headers: []decoder.Header{
					{Key: "trace", Value: []byte("00-abc-01")},
					{Key: "tenant", Value: nil},
					{Key: "empty", Value: []byte{}},
					{Key: "user", Value: []byte("u1")},
				},
			},
			topic:   "outbox.event.order",
			headers: []hdr{{"id", "11"}, {"type", "T"}, {"trace", "00-abc-01"}, {"empty", ""}, {"user", "u1"}},
		},
		{
			name: "more headers than the inline array",
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("12"), AggregateType: []byte("order"),
				AggregateID: []byte("k"), Type: []byte("T"), Payload: []byte("p"), CommitTime: commitTime,
				Headers: []decoder.Header{
					{Key: "h1", Value: []byte("1")}, {Key: "h2", Value: []byte("2")},
					{Key: "h3", Value: []byte("3")}, {Key: "h4", Value: []byte("4")},
				},
			},
			topic:   "outbox.event.order",
			headers: []hdr{{"id", "12"}, {"type", "T"}, {"h1", "1"}, {"h2", "2"}, {"h3", "3"}, {"h4", "4"}},
		},
		{
			name: "configured header names and template",
			cfg:  withDefaults(Config{HeaderID: "eventId", HeaderType: "eventType", TopicTemplate: "app.{aggregate_type}.v1"}),
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("13"), AggregateType: []byte("customer"),
				AggregateID: []byte("c-1"), Type: []byte("CustomerMoved"), Payload: []byte("p"), CommitTime: commitTime,
				Headers: []decoder.Header{{Key: "x", Value: []byte("y")}},
			},
			topic:   "app.customer.v1",
			headers: []hdr{{"eventId", "13"}, {"eventType", "CustomerMoved"}, {"x", "y"}},
		},
		{
			name: "fixed template",
			cfg:  withDefaults(Config{TopicTemplate: "outbox.all"}),
			ev: decoder.Event{
				Table: outboxTable, ID: []byte("14"), AggregateType: []byte("order"),
				AggregateID: []byte("k"), Payload: []byte("p"), CommitTime: commitTime,
			},
			topic:   "outbox.all",
			headers: []hdr{{"id", "14"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := offlineRouter(t, tt.cfg)
			reason, tp, detail := r.route(&tt.ev)
			if reason != "" || tp == nil {
				t.Fatalf("route = %q, %v, %q; want a topic", reason, tp, detail)
			}
			a := &testAcker{}
			o := r.newRecord(&tt.ev, tp, a)
			rec := &o.rec
			if rec.Topic != tt.topic || o.topic != tp {
				t.Errorf("topic = %q (entry %q); want %q", rec.Topic, o.topic.name, tt.topic)
			}
			if !bytes.Equal(rec.Key, tt.ev.AggregateID) || rec.Key == nil {
				t.Errorf("key = %q (nil %v); want %q", rec.Key, rec.Key == nil, tt.ev.AggregateID)
			}
			if !bytes.Equal(rec.Value, tt.ev.Payload) || (rec.Value == nil) != (tt.ev.Payload == nil) {
				t.Errorf("value = %q (nil %v); want %q (nil %v)", rec.Value, rec.Value == nil, tt.ev.Payload, tt.ev.Payload == nil)
			}
			if !rec.Timestamp.Equal(commitTime) {
				t.Errorf("timestamp = %v; want %v", rec.Timestamp, commitTime)
			}
			if got := headersOf(rec.Headers); fmt.Sprint(got) != fmt.Sprint(tt.headers) {
				t.Errorf("headers = %q; want %q", got, tt.headers)
			}
			for _, h := range rec.Headers {
				if h.Value == nil {
					t.Errorf("header %q has a nil value", h.Key)
				}
			}
			if o.ack != a {
				t.Errorf("ack = %v; want the acker given", o.ack)
			}
			if floor := len(rec.Key) + len(rec.Value); o.size <= floor {
				t.Errorf("size = %d; want more than key+value = %d", o.size, floor)
			}
			if a.adds.Load() != 0 || a.acks.Load() != 0 {
				t.Errorf("newRecord called the acker: %d adds, %d acks", a.adds.Load(), a.acks.Load())
			}
		})
	}
}

// wireVarintLen is the length of n as a Kafka (zigzag) varint.
func wireVarintLen(n int) int {
	u := uint64(n<<1) ^ uint64(n>>63)
	l := 1
	for u >= 0x80 {
		u >>= 7
		l++
	}
	return l
}

// bytesLen is the wire length of a varint-prefixed byte field (nil: -1).
func bytesLen(b []byte) int {
	if b == nil {
		return wireVarintLen(-1)
	}
	return wireVarintLen(len(b)) + len(b)
}

// batchWireSize is what a record batch holding only rec weighs on the wire
// as franz-go counts it against ProducerBatchMaxBytes: the 65-byte batch
// overhead (Kafka's 61 plus the records array length) and the v2 record.
func batchWireSize(rec *kgo.Record) int {
	n := 1 + wireVarintLen(0) + wireVarintLen(0) // attributes, timestamp delta, offset delta
	n += bytesLen(rec.Key) + bytesLen(rec.Value)
	n += wireVarintLen(len(rec.Headers))
	for _, h := range rec.Headers {
		n += wireVarintLen(len(h.Key)) + len(h.Key) + bytesLen(h.Value)
	}
	return 65 + wireVarintLen(n) + n
}

// TestNewRecordSizeCoversTypicalEvents proves that the size newRecord
// estimates for typical events (short header values, keys under 8 KiB) is
// at least what the record weighs on the wire, so the MaxRecordBytes check
// in Send never lets through a record the producer refuses.
func TestNewRecordSizeCoversTypicalEvents(t *testing.T) {
	r := offlineRouter(t, withDefaults(Config{}))
	uuid := "0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f"
	for _, payload := range []int{0, 1, 63, 64, 100, 8191, 8192, 100_000, 999_000} {
		for _, key := range []int{1, 36, 63, 64, 1000} {
			ev := event(uuid, "order", strings.Repeat("k", key), strings.Repeat("p", payload))
			ev.Headers = []decoder.Header{{Key: "traceparent", Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")}}
			_, tp, _ := r.route(ev)
			o := r.newRecord(ev, tp, &testAcker{})
			if wire := batchWireSize(&o.rec); o.size < wire {
				t.Errorf("key %d, payload %d: estimated size %d < wire size %d", key, payload, o.size, wire)
			}
		}
	}
}

// TestNewRecordSizeCoversLongHeaders proves that the size
// estimate is an upper bound of the wire size also for events with several
// header values of 64 bytes or more, whose length varints take two bytes.
func TestNewRecordSizeCoversLongHeaders(t *testing.T) {
	r := offlineRouter(t, withDefaults(Config{}))
	ev := event("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f", "order", "k", "p")
	for i := range 8 {
		ev.Headers = append(ev.Headers, decoder.Header{Key: fmt.Sprintf("h%d", i), Value: bytes.Repeat([]byte("v"), 200)})
	}
	_, tp, _ := r.route(ev)
	o := r.newRecord(ev, tp, &testAcker{})
	if wire := batchWireSize(&o.rec); o.size < wire {
		t.Errorf("estimated size %d < wire size %d", o.size, wire)
	}
}

// TestRecordOfRoundTrip proves that the promise can recover the outRecord
// from the *kgo.Record handed to the producer (rec is the first field).
func TestRecordOfRoundTrip(t *testing.T) {
	r := offlineRouter(t, withDefaults(Config{}))
	for _, ev := range []*decoder.Event{
		event("1", "order", "k", "p"),
		event("2", "customer", "", ""),
	} {
		_, tp, _ := r.route(ev)
		o := r.newRecord(ev, tp, &testAcker{})
		if got := recordOf(&o.rec); got != o {
			t.Fatalf("recordOf(&o.rec) = %p; want %p", got, o)
		}
		if got := recordOf(&o.rec); got.topic != tp || got.size != o.size {
			t.Fatalf("recordOf fields = %v, %d; want %v, %d", got.topic, got.size, tp, o.size)
		}
	}
}

// TestRoute proves which events have no destination and why: NULL or
// empty aggregate type (unless the template is fixed), NULL aggregate id,
// NULL id, in that order of precedence, and a topic name Kafka would
// reject; and that valid events get their template's topic.
func TestRoute(t *testing.T) {
	valid := func(mod func(*decoder.Event)) *decoder.Event {
		ev := event("1", "order", "k", "p")
		mod(ev)
		return ev
	}
	tests := []struct {
		name   string
		tmpl   string
		ev     *decoder.Event
		reason deadletter.Reason
		topic  string // when reason is ""
		detail string // substring of detail, when reason is not ""
	}{
		{name: "valid", ev: valid(func(*decoder.Event) {}), topic: "outbox.event.order"},
		{name: "empty aggregate id is valid", ev: valid(func(e *decoder.Event) { e.AggregateID = []byte{} }), topic: "outbox.event.order"},
		{name: "empty id is valid", ev: valid(func(e *decoder.Event) { e.ID = []byte{} }), topic: "outbox.event.order"},
		{name: "NULL payload is valid", ev: valid(func(e *decoder.Event) { e.Payload = nil }), topic: "outbox.event.order"},
		{name: "NULL aggregate type", ev: valid(func(e *decoder.Event) { e.AggregateType = nil }), reason: deadletter.ReasonNoAggregateType, detail: "NULL or empty"},
		{name: "empty aggregate type", ev: valid(func(e *decoder.Event) { e.AggregateType = []byte{} }), reason: deadletter.ReasonNoAggregateType, detail: "NULL or empty"},
		{name: "NULL aggregate id", ev: valid(func(e *decoder.Event) { e.AggregateID = nil }), reason: deadletter.ReasonNoAggregateID, detail: "aggregate id is NULL"},
		{name: "NULL id", ev: valid(func(e *decoder.Event) { e.ID = nil }), reason: deadletter.ReasonNoID, detail: "id is NULL"},
		{name: "aggregate type before id", ev: valid(func(e *decoder.Event) { e.AggregateType, e.AggregateID, e.ID = nil, nil, nil }), reason: deadletter.ReasonNoAggregateType},
		{name: "aggregate id before id", ev: valid(func(e *decoder.Event) { e.AggregateID, e.ID = nil, nil }), reason: deadletter.ReasonNoAggregateID},
		{name: "invalid topic name", ev: valid(func(e *decoder.Event) { e.AggregateType = []byte("bad type!") }), reason: deadletter.ReasonInvalidTopic, detail: `"outbox.event.bad type!"`},
		{name: "topic too long", ev: valid(func(e *decoder.Event) { e.AggregateType = bytes.Repeat([]byte("a"), 250) }), reason: deadletter.ReasonInvalidTopic, detail: "Kafka allows 249"},
		{name: "aggregate type dot dot", tmpl: "{aggregate_type}", ev: valid(func(e *decoder.Event) { e.AggregateType = []byte("..") }), reason: deadletter.ReasonInvalidTopic, detail: "not allowed"},
		{name: "fixed template accepts empty aggregate type", tmpl: "outbox.all", ev: valid(func(e *decoder.Event) { e.AggregateType = []byte{} }), topic: "outbox.all"},
		{name: "fixed template accepts NULL aggregate type", tmpl: "outbox.all", ev: valid(func(e *decoder.Event) { e.AggregateType = nil }), topic: "outbox.all"},
		{name: "fixed template accepts any aggregate type", tmpl: "outbox.all", ev: valid(func(e *decoder.Event) { e.AggregateType = []byte("bad type!") }), topic: "outbox.all"},
		{name: "fixed template still needs an aggregate id", tmpl: "outbox.all", ev: valid(func(e *decoder.Event) { e.AggregateID = nil }), reason: deadletter.ReasonNoAggregateID},
		{name: "fixed template still needs an id", tmpl: "outbox.all", ev: valid(func(e *decoder.Event) { e.ID = nil }), reason: deadletter.ReasonNoID},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := offlineRouter(t, withDefaults(Config{TopicTemplate: tt.tmpl}))
			reason, tp, detail := r.route(tt.ev)
			if reason != tt.reason {
				t.Fatalf("reason = %q (%s); want %q", reason, detail, tt.reason)
			}
			if tt.reason != "" {
				if tp != nil {
					t.Errorf("topic = %q; want none for an invalid event", tp.name)
				}
				if !strings.Contains(detail, tt.detail) {
					t.Errorf("detail = %q; want it to contain %q", detail, tt.detail)
				}
				return
			}
			if tp == nil || tp.name != tt.topic || detail != "" {
				t.Fatalf("route = %v, %q; want topic %q", tp, detail, tt.topic)
			}
			if tp.state != topicUnknown {
				t.Errorf("state = %v; want topicUnknown: a new topic is prepared before its first record", tp.state)
			}
		})
	}
}

// TestRouteCachesTopics proves that route returns the same topic entry for
// the same aggregate type and for aggregate types mapping to one topic,
// distinct entries for distinct topics, and that a new topic starts unknown
// (to be prepared: created when allowed, its size limit read) either way.
func TestRouteCachesTopics(t *testing.T) {
	for _, create := range []bool{false, true} {
		r := offlineRouter(t, withDefaults(Config{CreateTopics: create}))
		_, a1, _ := r.route(event("1", "order", "k", "p"))
		_, a2, _ := r.route(event("2", "order", "k", "p"))
		_, b, _ := r.route(event("3", "customer", "k", "p"))
		if a1 == nil || a1 != a2 {
			t.Fatalf("create=%v: same aggregate type gave %p and %p", create, a1, a2)
		}
		if b == nil || b == a1 || b.name != "outbox.event.customer" {
			t.Fatalf("create=%v: other aggregate type gave %+v", create, b)
		}
		want := topicUnknown
		if a1.state != want || b.state != want {
			t.Errorf("create=%v: states %v, %v; want %v", create, a1.state, b.state, want)
		}
	}

	r := offlineRouter(t, withDefaults(Config{TopicTemplate: "outbox.all"}))
	_, a, _ := r.route(event("1", "order", "k", "p"))
	_, b, _ := r.route(event("2", "customer", "k", "p"))
	_, c, _ := r.route(event("3", "", "k", "p"))
	if a == nil || a != b || a != c {
		t.Fatalf("fixed template: entries %p, %p, %p; want one", a, b, c)
	}
}

// TestNewRejectsBadConfig proves that New refuses a bad topic template, an
// invalid dead-letter topic and an unknown on-invalid policy, and accepts
// DefaultConfig; a zero Config is refused, naming a field, not run with
// defaults it does not say.
func TestNewRejectsBadConfig(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{name: "defaults", cfg: DefaultConfig()},
		{name: "zero config", cfg: Config{}, wantErr: "router.Config.MaxTopics is 0"},
		{name: "every policy", cfg: withDefaults(Config{OnInvalid: InvalidSkip})},
		{name: "two placeholders", cfg: withDefaults(Config{TopicTemplate: "{aggregate_type}{aggregate_type}"}), wantErr: "may appear once"},
		{name: "bad dead-letter topic", cfg: withDefaults(Config{DeadLetterTopic: "dead letters"}), wantErr: "dead-letter topic"},
		{name: "bad policy", cfg: withDefaults(Config{OnInvalid: "drop"}), wantErr: `on-invalid "drop"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := New(tt.cfg, []kgo.Opt{kgo.SeedBrokers("127.0.0.1:1")}, zap.NewNop(), metrics.NewUnregistered(), func(error) {})
			if tt.wantErr == "" {
				if err != nil || r == nil {
					t.Fatalf("New = %v, %v; want a router", r, err)
				}
				r.Close()
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("New error = %v; want one containing %q", err, tt.wantErr)
			}
		})
	}
}

// TestZeroIsZeroOrRefused sets each numeric and name field of
// DefaultConfig to zero in turn: Validate either accepts it, and the zero
// stands for what the field's documentation says, or refuses it with one
// line naming the field and its default. Never a silent default.
func TestZeroIsZeroOrRefused(t *testing.T) {
	refused := map[string]bool{
		"TopicTemplate": true, "DeadLetterTopic": true, "OnInvalid": true, "MaxTopics": true,
		"TopicPartitions": true, "TopicReplicationFactor": true, "MaxInflightEvents": true,
		"MaxInflightBytes": true, "MaxRecordBytes": true, "HeaderID": true, "HeaderType": true,
	}
	v := reflect.ValueOf(DefaultConfig())
	for i := range v.NumField() {
		f := v.Type().Field(i)
		switch f.Type.Kind() {
		case reflect.Int, reflect.Int16, reflect.Int32, reflect.Int64, reflect.String:
		default:
			continue
		}
		cfg := DefaultConfig()
		reflect.ValueOf(&cfg).Elem().Field(i).SetZero()
		err := cfg.Validate()
		switch {
		case refused[f.Name] && (err == nil || !strings.Contains(err.Error(), "router.Config."+f.Name) || !strings.Contains(err.Error(), "default")):
			t.Errorf("%s zero: Validate = %v, want a refusal naming router.Config.%s and its default", f.Name, err, f.Name)
		case !refused[f.Name] && err != nil:
			t.Errorf("%s zero: Validate = %v, want it accepted as zero", f.Name, err)
		}
	}
	// The documented zeros: none with their own series, no allowlist,
	// no transactional id; with one, no timeout and no checkpoint topic
	// are refused.
	cfg := DefaultConfig()
	cfg.MaxTopicSeries = 0
	r, err := New(cfg, []kgo.Opt{kgo.SeedBrokers("127.0.0.1:1")}, zap.NewNop(), metrics.NewUnregistered(), func(error) {})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.cfg.MaxTopicSeries != 0 {
		t.Errorf("MaxTopicSeries 0 became %d", r.cfg.MaxTopicSeries)
	}
	cfg = DefaultConfig()
	cfg.TransactionalID, cfg.TransactionTimeout = "t", 0
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "router.Config.TransactionTimeout") {
		t.Errorf("exactly-once without a transaction timeout: Validate = %v", err)
	}
	cfg = DefaultConfig()
	cfg.TransactionalID, cfg.CheckpointTopic = "t", ""
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "router.Config.CheckpointTopic") {
		t.Errorf("exactly-once without a checkpoint topic: Validate = %v", err)
	}
}

// withDefaults is c with its zero fields, but its flags, taken from
// DefaultConfig: what a test's partial Config meant before a zero meant
// zero.
func withDefaults(c Config) Config {
	def := reflect.ValueOf(DefaultConfig())
	v := reflect.ValueOf(&c).Elem()
	for i := range v.NumField() {
		if f := v.Field(i); f.IsZero() && f.Kind() != reflect.Bool && f.CanSet() {
			f.Set(def.Field(i))
		}
	}
	return c
}

// BenchmarkNewRecord measures building the record of a typical event: one
// allocation (the outRecord, headers inline).
func BenchmarkNewRecord(b *testing.B) {
	r := offlineRouter(b, withDefaults(Config{}))
	ev := event("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f", "order", "order-42", `{"orderId":42,"total":12.5,"currency":"EUR"}`)
	ev.Headers = []decoder.Header{{Key: "traceparent", Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")}}
	_, tp, _ := r.route(ev)
	a := &testAcker{}
	b.ReportAllocs()
	var o *outRecord
	for b.Loop() {
		o = r.newRecord(ev, tp, a)
	}
	if o == nil || len(o.rec.Headers) != 3 {
		b.Fatalf("unexpected record %+v", o)
	}
}

// TestNewRecordAllocs proves the benchmark's claim: building a typical
// record (up to four headers) allocates once.
func TestNewRecordAllocs(t *testing.T) {
	r := offlineRouter(t, withDefaults(Config{}))
	ev := event("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f", "order", "order-42", `{"orderId":42}`)
	ev.Headers = []decoder.Header{{Key: "traceparent", Value: []byte("00-x-01")}, {Key: "tenant", Value: []byte("t1")}}
	_, tp, _ := r.route(ev)
	a := &testAcker{}
	var sink *outRecord
	if n := testing.AllocsPerRun(100, func() { sink = r.newRecord(ev, tp, a) }); n != 1 {
		t.Errorf("newRecord allocates %v times; want 1", n)
	}
	_ = sink
}
