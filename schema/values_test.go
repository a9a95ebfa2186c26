package schema

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hamba/avro/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/sr"
	"github.com/twmb/franz-go/pkg/sr/srfake"
	"go.uber.org/zap"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
)

const orderAvro = `{"type":"record","name":"OrderCreated","namespace":"shop","fields":[
	{"name":"id","type":"long"},
	{"name":"customer","type":"string"},
	{"name":"note","type":["null","string"],"default":null},
	{"name":"status","type":{"type":"enum","name":"Status","symbols":["NEW","PAID"]},"default":"NEW"},
	{"name":"lines","type":{"type":"array","items":{"type":"record","name":"Line","fields":[
		{"name":"sku","type":"string"},{"name":"qty","type":"int"}]}}},
	{"name":"total","type":{"type":"bytes","logicalType":"decimal","precision":10,"scale":2}}
]}`

const orderJSONSchema = `{"$schema":"http://json-schema.org/draft-07/schema#","type":"object",
	"properties":{"id":{"type":"integer"},"customer":{"type":"string","minLength":1}},
	"required":["id","customer"],"additionalProperties":false}`

const orderProto = `syntax = "proto3";
package shop;
message OrderCreated { int64 id = 1; string customer = 2; repeated Line lines = 3;
  message Line { string sku = 1; int32 qty = 2; } }
message OrderPaid { int64 id = 1; double amount = 2; }`

// newValues is Values on a fake registry, with cfg's rules.
func newValues(t *testing.T, reg *srfake.Registry, cfg Config) (*Values, *metrics.Metrics) {
	t.Helper()
	cfg = withDefaults(cfg)
	cfg.URLs = []string{reg.URL()}
	m := metrics.NewUnregistered()
	v, err := New(cfg, zap.NewNop(), m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(v.Close)
	return v, m
}

// withDefaults fills the fields a test leaves zero from DefaultConfig, so
// each test names only what it is about.
func withDefaults(c Config) Config {
	d := DefaultConfig()
	if c.Default.Format == "" {
		c.Default = d.Default
	}
	if c.Strategy == "" {
		c.Strategy = d.Strategy
	}
	for _, f := range []struct{ got, def *time.Duration }{{&c.Refresh, &d.Refresh}, {&c.Timeout, &d.Timeout}, {&c.RetryPause, &d.RetryPause}} {
		if *f.got == 0 {
			*f.got = *f.def
		}
	}
	return c
}

// value is Values.Value, waiting out the registry reads it asks for (at
// most a few: each wait is one read).
func value(t *testing.T, v *Values, topic, typ, payload string) ([]byte, error) {
	t.Helper()
	ev := &decoder.Event{Payload: []byte(payload)}
	if typ != "" {
		ev.Type = []byte(typ)
	}
	for range 20 {
		b, wait, err := v.Value(topic, ev)
		if wait == nil {
			return b, err
		}
		<-wait
	}
	t.Fatal("Value still waits after 20 registry reads")
	return nil, nil
}

// framed checks the wire header of b (magic byte, schema id) and returns
// the rest.
func framed(t *testing.T, b []byte, id int) []byte {
	t.Helper()
	if len(b) < 5 || b[0] != 0 || int(binary.BigEndian.Uint32(b[1:5])) != id {
		t.Fatalf("value %x: want the magic byte 0 and schema id %d first", b, id)
	}
	return b[5:]
}

func schemaError(t *testing.T, err error, reason deadletter.Reason, subject string, version int) deadletter.SchemaError {
	t.Helper()
	var se *deadletter.SchemaError
	if !errors.As(err, &se) {
		t.Fatalf("error %v: want a *deadletter.SchemaError", err)
	}
	if se.Reason != reason || se.Subject != subject || se.Version != version {
		t.Fatalf("schema error %+v: want reason %s, subject %s, version %d", se, reason, subject, version)
	}
	return *se
}

func TestAvroValue(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("outbox.event.order-value", 1, 7, sr.Schema{Schema: orderAvro, Type: sr.TypeAvro})
	v, _ := newValues(t, reg, Config{Default: Rule{Format: Avro}})

	b, err := value(t, v, "outbox.event.order", "", `{"id": 42, "customer": "ada", "lines": [{"sku": "x-1", "qty": 3}], "total": "12.50", "note": "by the door"}`)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := avro.Unmarshal(avro.MustParse(orderAvro), framed(t, b, 7), &got); err != nil {
		t.Fatal(err)
	}
	if got["id"] != int64(42) || got["customer"] != "ada" || got["status"] != "NEW" {
		t.Errorf("decoded %v: want id 42, customer ada and the default status NEW", got)
	}
	if got["note"] != "by the door" {
		t.Errorf("note %v: want the union's string branch", got["note"])
	}
	if lines, _ := got["lines"].([]any); len(lines) != 1 || lines[0].(map[string]any)["qty"] != 3 {
		t.Errorf("lines %v: want one line of qty 3", got["lines"])
	}

	for _, tc := range []struct{ payload, want string }{
		{`{"id": "42", "customer": "ada", "lines": [], "total": 1}`, "id: want an integer, got a string"},
		{`{"id": 42, "customer": "ada", "lines": [], "total": 1, "coupon": "x"}`, "has no field coupon"},
		{`{"id": 42, "lines": [], "total": 1}`, "field customer of record shop.OrderCreated is missing"},
		{`{"id": 42, "customer": "ada", "lines": [{"sku": "a", "qty": 9999999999}], "total": 1}`, "lines[0].qty: 9999999999 does not fit"},
		{`{"id": 42, "customer": "ada", "lines": [], "total": 1, "status": "LOST"}`, `"LOST" is not a symbol`},
		{`not json`, "the payload is not JSON"},
	} {
		_, err := value(t, v, "outbox.event.order", "", tc.payload)
		se := schemaError(t, err, deadletter.ReasonSchemaMismatch, "outbox.event.order-value", 1)
		if se.ID != 7 || !strings.Contains(se.Detail, tc.want) {
			t.Errorf("payload %s: detail %q (id %d): want it to say %q, id 7", tc.payload, se.Detail, se.ID, tc.want)
		}
	}

	// A NULL payload stays a tombstone.
	if b, wait, err := v.Value("outbox.event.order", &decoder.Event{}); b != nil || wait != nil || err != nil {
		t.Errorf("NULL payload: got %x, %v, %v; want a nil value", b, wait, err)
	}
}

func TestJSONSchemaValue(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("orders-value", 3, 11, sr.Schema{Schema: orderJSONSchema, Type: sr.TypeJSON})
	v, _ := newValues(t, reg, Config{Topics: map[string]Rule{"orders": {Format: JSONSchema}}})

	payload := `{"id": 1, "customer": "ada"}`
	b, err := value(t, v, "orders", "", payload)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(framed(t, b, 11)); got != payload {
		t.Errorf("framed payload %q: want %q unchanged", got, payload)
	}
	_, err = value(t, v, "orders", "", `{"id": 1, "customer": ""}`)
	se := schemaError(t, err, deadletter.ReasonSchemaMismatch, "orders-value", 3)
	if !strings.Contains(se.Detail, "customer") || strings.Contains(se.Detail, "\n") {
		t.Errorf("detail %q: want one line naming the property", se.Detail)
	}
	// Another topic has no rule: its payload goes as is, without a read.
	if b, err := value(t, v, "audit", "", "plain text"); err != nil || string(b) != "plain text" {
		t.Errorf("asis topic: got %q, %v", b, err)
	}
}

func TestProtobufValue(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("orders-value", 1, 5, sr.Schema{Schema: orderProto, Type: sr.TypeProtobuf})
	v, _ := newValues(t, reg, Config{Default: Rule{Format: Protobuf}})
	files, err := compileProtobuf(orderProto, nil)
	if err != nil {
		t.Fatal(err)
	}
	pe := files.(*protobufEncoder)

	for _, tc := range []struct {
		typ, message string
		index        []byte // the wire header's message indexes
		payload      string
	}{
		{"", "shop.OrderCreated", []byte{0}, `{"id": "7", "customer": "ada", "lines": [{"sku": "x", "qty": 2}]}`},
		{"shop.OrderPaid", "shop.OrderPaid", []byte{2, 2}, `{"id": 7, "amount": 9.5}`},
		{"OrderPaid", "shop.OrderPaid", []byte{2, 2}, `{"id": 7, "amount": 9.5}`},
	} {
		b, err := value(t, v, "orders", tc.typ, tc.payload)
		if err != nil {
			t.Fatalf("type %q: %v", tc.typ, err)
		}
		rest := framed(t, b, 5)
		if !bytes.HasPrefix(rest, tc.index) {
			t.Fatalf("type %q: value %x: want message indexes %x", tc.typ, rest, tc.index)
		}
		md := pe.messages[tc.message]
		m := dynamicpb.NewMessage(md)
		if err := proto.Unmarshal(rest[len(tc.index):], m); err != nil {
			t.Fatal(err)
		}
		want := dynamicpb.NewMessage(md)
		if err := protojson.Unmarshal([]byte(tc.payload), want); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(m, want) {
			t.Errorf("type %q: decoded %v, want %v", tc.typ, m, want)
		}
	}
	_, err = value(t, v, "orders", "", `{"id": 7, "coupon": "x"}`)
	se := schemaError(t, err, deadletter.ReasonSchemaMismatch, "orders-value", 1)
	if !strings.Contains(se.Detail, "coupon") || !strings.Contains(se.Detail, "shop.OrderCreated") {
		t.Errorf("detail %q: want the unknown field and the message", se.Detail)
	}
}

func TestSubjectStrategiesAndPins(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("shop.OrderCreated", 1, 1, sr.Schema{Schema: `{"type":"record","name":"OrderCreated","namespace":"shop","fields":[{"name":"id","type":"long"}]}`})
	reg.SeedSchema("shop.OrderCreated", 2, 2, sr.Schema{Schema: `{"type":"record","name":"OrderCreated","namespace":"shop","fields":[{"name":"id","type":"long"},{"name":"at","type":"string","default":""}]}`})
	reg.SeedSchema("orders-shop.OrderCreated", 1, 3, sr.Schema{Schema: orderJSONSchema, Type: sr.TypeJSON})

	v, _ := newValues(t, reg, Config{Strategy: RecordName, Types: map[string]Rule{"shop.OrderCreated": {Format: Avro, Version: 1}}, Default: Rule{Format: Avro}})
	b, err := value(t, v, "orders", "shop.OrderCreated", `{"id": 1}`)
	if err != nil {
		t.Fatal(err)
	}
	framed(t, b, 1) // version 1, pinned, not the latest (id 2)
	_, err = value(t, v, "orders", "shop.OrderCreated", `{"id": 1, "at": "now"}`)
	schemaError(t, err, deadletter.ReasonSchemaMismatch, "shop.OrderCreated", 1)
	_, err = value(t, v, "orders", "", `{"id": 1}`)
	se := schemaError(t, err, deadletter.ReasonSchemaMismatch, "", 0)
	if !strings.Contains(se.Detail, "no type") {
		t.Errorf("detail %q: want it to say the event has no type", se.Detail)
	}
	_, err = value(t, v, "orders", "shop.Unknown", `{"id": 1}`)
	schemaError(t, err, deadletter.ReasonSchemaNotFound, "shop.Unknown", 0)

	v2, _ := newValues(t, reg, Config{Strategy: TopicRecordName, Default: Rule{Format: JSONSchema}})
	b, err = value(t, v2, "orders", "shop.OrderCreated", `{"id": 1, "customer": "ada"}`)
	if err != nil {
		t.Fatal(err)
	}
	framed(t, b, 3)

	// A rule of another format than the subject's schema is a mismatch.
	v3, _ := newValues(t, reg, Config{Strategy: TopicRecordName, Default: Rule{Format: Avro}})
	_, err = value(t, v3, "orders", "shop.OrderCreated", `{"id": 1, "customer": "ada"}`)
	se = schemaError(t, err, deadletter.ReasonSchemaMismatch, "orders-shop.OrderCreated", 1)
	if !strings.Contains(se.Detail, "JSON schema") {
		t.Errorf("detail %q: want it to name the subject's format", se.Detail)
	}
}

func TestAvroReferences(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("shop.Address", 1, 1, sr.Schema{Schema: `{"type":"record","name":"Address","namespace":"shop","fields":[{"name":"city","type":"string"}]}`})
	reg.SeedSchema("customers-value", 1, 2, sr.Schema{
		Schema:     `{"type":"record","name":"Customer","namespace":"shop","fields":[{"name":"name","type":"string"},{"name":"home","type":"shop.Address"}]}`,
		References: []sr.SchemaReference{{Name: "shop.Address", Subject: "shop.Address", Version: 1}},
	})
	v, _ := newValues(t, reg, Config{Default: Rule{Format: Avro}})
	b, err := value(t, v, "customers", "", `{"name": "ada", "home": {"city": "London"}}`)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasSuffix(framed(t, b, 2), []byte("London")) {
		t.Errorf("value %x: want the referenced record encoded", b)
	}
}

// A registry that does not answer delays: Value waits (it never drops nor
// dead-letters), each wait one more read, until it answers; and once a
// schema is in hand, a failed refresh keeps it serving.
func TestRegistryDownDelays(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("orders-value", 1, 9, sr.Schema{Schema: orderJSONSchema, Type: sr.TypeJSON})
	var down atomic.Bool
	var reads atomic.Int32
	reg.Intercept(func(w http.ResponseWriter, r *http.Request) bool {
		reads.Add(1)
		if down.Load() {
			http.Error(w, `{"error_code":50001,"message":"storage unavailable"}`, http.StatusInternalServerError)
			return true
		}
		return false
	})
	down.Store(true)
	v, m := newValues(t, reg, Config{Default: Rule{Format: JSONSchema}, RetryPause: time.Millisecond, Refresh: time.Hour})
	ev := &decoder.Event{Payload: []byte(`{"id": 1, "customer": "ada"}`)}
	for i := range 3 {
		b, wait, err := v.Value("orders", ev)
		if wait == nil || b != nil || err != nil {
			t.Fatalf("registry down, call %d: got %x, %v, %v; want a channel to wait on", i, b, wait, err)
		}
		<-wait
	}
	if n := reads.Load(); n < 2 {
		t.Errorf("%d registry reads while it was down: want a new read after each wait", n)
	}
	if _, err := v.Check(context.Background(), "orders", "", ev.Payload); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Check with the registry down: %v; want ErrUnavailable", err)
	}
	down.Store(false)
	b, err := value(t, v, "orders", "", string(ev.Payload))
	if err != nil {
		t.Fatal(err)
	}
	framed(t, b, 9)
	if got := counter(t, m, "error"); got < 2 {
		t.Errorf("walrelay_schema_registry_reads_total{result=error} = %v, want the failed reads counted", got)
	}

	// The schema in hand serves while a refresh fails.
	v.cfg.Refresh = 0
	down.Store(true)
	for range 3 {
		b, wait, err := v.Value("orders", ev)
		if wait != nil || err != nil || b == nil {
			t.Fatalf("refresh failing: got %x, %v, %v; want the value from the schema in hand", b, wait, err)
		}
	}
}

func counter(t *testing.T, m *metrics.Metrics, result string) float64 {
	t.Helper()
	c, err := m.SchemaReads.GetMetricWithLabelValues(result)
	if err != nil {
		t.Fatal(err)
	}
	return testutilValue(c)
}

func TestCheckForTheWriter(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("outbox.event.order-value", 1, 4, sr.Schema{Schema: orderJSONSchema, Type: sr.TypeJSON})
	v, _ := newValues(t, reg, Config{Default: Rule{Format: JSONSchema}})
	w := WriterCheck{Values: v}
	if err := w.CheckPayload(context.Background(), "order", "OrderCreated", []byte(`{"id": 1, "customer": "ada"}`)); err != nil {
		t.Fatal(err)
	}
	err := w.CheckPayload(context.Background(), "order", "OrderCreated", []byte(`{"id": "one"}`))
	schemaError(t, err, deadletter.ReasonSchemaMismatch, "outbox.event.order-value", 1)
	if !strings.Contains(err.Error(), "outbox.event.order-value version 1") {
		t.Errorf("error %q: want the subject and version", err)
	}
}

func TestParseRule(t *testing.T) {
	for in, want := range map[string]Rule{"avro": {Format: Avro}, "json@3": {Format: JSONSchema, Version: 3}, "PROTOBUF@latest": {Format: Protobuf}, "asis": {Format: AsIs}} {
		if got, err := ParseRule(in); err != nil || got != want {
			t.Errorf("ParseRule(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"xml", "avro@0", "avro@x", "asis@2"} {
		if _, err := ParseRule(in); err == nil {
			t.Errorf("ParseRule(%q): want an error", in)
		}
	}
	if err := withDefaults(Config{Default: Rule{Format: Avro}}).Validate(); err == nil || !strings.Contains(err.Error(), "schema.Config.URLs") {
		t.Errorf("a format without a registry URL: %v; want an error naming schema.Config.URLs", err)
	}
	if err := DefaultConfig().Validate(); err != nil {
		t.Errorf("DefaultConfig: %v", err)
	}
	// A zero is refused where it means nothing, naming the field and its
	// default, never taken as the default.
	for _, zero := range []struct {
		field string
		set   func(*Config)
	}{
		{"schema.Config.Refresh", func(c *Config) { c.Refresh = 0 }},
		{"schema.Config.Timeout", func(c *Config) { c.Timeout = 0 }},
		{"schema.Config.RetryPause", func(c *Config) { c.RetryPause = 0 }},
		{"schema.Config.Strategy", func(c *Config) { c.Strategy = "" }},
		{"schema.Config.Default", func(c *Config) { c.Default = Rule{} }},
	} {
		c := DefaultConfig()
		zero.set(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), zero.field) {
			t.Errorf("%s zero: Validate = %v, want a refusal naming it", zero.field, err)
		}
	}
}

func testutilValue(c prometheus.Counter) float64 { return testutil.ToFloat64(c) }

// TestAvroArraysAsJavaWritesThem: an array is one block of its item count,
// without a byte size, as Avro's Java writers (Debezium's converters) give
// it.
func TestAvroArraysAsJavaWritesThem(t *testing.T) {
	e, err := compileAvro(`{"type":"array","items":"int"}`, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.appendValue(nil, []byte(`[1, 2, 3]`), "")
	if err != nil {
		t.Fatal(err)
	}
	if want := []byte{6, 2, 4, 6, 0}; !bytes.Equal(b, want) {
		t.Errorf("[1, 2, 3] as %x; want %x (count 3, the items, an empty block)", b, want)
	}
}

// BenchmarkValue is the cost of one value per format, for the payload of
// walrelay-bench's drain (a number and a 180-byte string), its schema
// cached.
func BenchmarkValue(b *testing.B) {
	schemas := map[Format]sr.Schema{
		Avro:       {Type: sr.TypeAvro, Schema: `{"type":"record","name":"BenchEvent","fields":[{"name":"n","type":"long"},{"name":"pad","type":"string"}]}`},
		JSONSchema: {Type: sr.TypeJSON, Schema: `{"type":"object","properties":{"n":{"type":"integer"},"pad":{"type":"string"}},"required":["n","pad"],"additionalProperties":false}`},
		Protobuf:   {Type: sr.TypeProtobuf, Schema: `syntax = "proto3"; message BenchEvent { int64 n = 1; string pad = 2; }`},
	}
	ev := &decoder.Event{Type: []byte("BenchEvent"), Payload: []byte(`{"n": 12345, "pad": "` + strings.Repeat("x", 180) + `"}`)}
	for _, f := range []Format{AsIs, JSONSchema, Avro, Protobuf} {
		b.Run(string(f), func(b *testing.B) {
			reg := srfake.New()
			defer reg.Close()
			if s, ok := schemas[f]; ok {
				reg.SeedSchema("bench-value", 1, 1, s)
			}
			v, err := New(withDefaults(Config{URLs: []string{reg.URL()}, Default: Rule{Format: f}}), zap.NewNop(), nil)
			if err != nil {
				b.Fatal(err)
			}
			defer v.Close()
			for {
				_, wait, err := v.Value("bench", ev)
				if err != nil {
					b.Fatal(err)
				}
				if wait == nil {
					break
				}
				<-wait
			}
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := v.Value("bench", ev); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestLatestIsReadAgain: a subject followed at its latest version is read
// again once Refresh has passed, in the background, and its new version
// frames the values from then on; a pinned version is not read again.
func TestLatestIsReadAgain(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	v1 := `{"type":"record","name":"E","fields":[{"name":"a","type":"long"}]}`
	v2 := `{"type":"record","name":"E","fields":[{"name":"a","type":"long"},{"name":"b","type":"string","default":"x"}]}`
	reg.SeedSchema("t-value", 1, 21, sr.Schema{Schema: v1})
	v, m := newValues(t, reg, Config{Default: Rule{Format: Avro}, Refresh: time.Hour})
	b, err := value(t, v, "t", "", `{"a": 1}`)
	if err != nil {
		t.Fatal(err)
	}
	framed(t, b, 21)
	reg.SeedSchema("t-value", 2, 22, sr.Schema{Schema: v2})
	if b, _ = value(t, v, "t", "", `{"a": 1}`); b[4] != 21 {
		t.Fatalf("value %x before Refresh passed: want the schema in hand, id 21", b)
	}
	v.mu.Lock()
	v.cfg.Refresh = time.Nanosecond
	v.mu.Unlock()
	var wait <-chan struct{}
	id := byte(21)
	for range 10 { // each round waits for the read it started, if any
		// The stale schema still serves while the new one is read.
		ev := &decoder.Event{Payload: []byte(`{"a": 1}`)}
		if b, wait, err = v.Value("t", ev); err != nil || wait != nil {
			t.Fatalf("Value while refreshing: %v, %v; want a value at once", wait, err)
		}
		if id = b[4]; id == 22 {
			break
		}
		v.mu.Lock()
		ready := v.entries[subjectVersion{"t-value", Latest}].ready
		v.mu.Unlock()
		if ready != nil {
			<-ready
		}
	}
	if id != 22 {
		t.Fatalf("schema id %d after Refresh passed: want the latest version's, 22", id)
	}
	if counter(t, m, "ok") < 2 {
		t.Errorf("%v successful reads: want the subject read again", counter(t, m, "ok"))
	}
}

// clock moves v's clock ahead of the real one by what Advance adds: the
// time a test says has passed without waiting for it.
type clock struct{ ahead atomic.Int64 }

func (c *clock) now() time.Time          { return time.Now().Add(time.Duration(c.ahead.Load())) }
func (c *clock) Advance(d time.Duration) { c.ahead.Add(int64(d)) }

func withClock(v *Values) *clock {
	c := &clock{}
	v.mu.Lock()
	v.now = c.now
	v.mu.Unlock()
	return c
}

// reads counts the registry's reads of subject versions (references and
// the rest aside).
func countReads(reg *srfake.Registry) *atomic.Int32 {
	var n atomic.Int32
	reg.Intercept(func(w http.ResponseWriter, r *http.Request) bool {
		if strings.Contains(r.URL.Path, "/versions/") {
			n.Add(1)
		}
		return false
	})
	return &n
}

// TestMismatchReadsTheLatestFirst: a payload the version in hand refuses
// is checked against the subject's latest before it is dead-lettered: a
// version registered since (here while Refresh keeps the old one in hand
// for an hour) frames the events written for it; a payload the latest
// refuses too is dead-lettered naming it; a stream of refused payloads
// reads the registry once per Recheck; a pinned version is never read
// again for it.
func TestMismatchReadsTheLatestFirst(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	v1 := `{"type":"record","name":"E","fields":[{"name":"a","type":"long"}]}`
	v2 := `{"type":"record","name":"E","fields":[{"name":"a","type":"long"},{"name":"channel","type":"string","default":"web"}]}`
	reg.SeedSchema("t-value", 1, 31, sr.Schema{Schema: v1})
	reads := countReads(reg)
	v, _ := newValues(t, reg, Config{Default: Rule{Format: Avro}, Refresh: time.Hour, Recheck: time.Second})
	clk := withClock(v)
	b, err := value(t, v, "t", "", `{"a": 1}`)
	if err != nil {
		t.Fatal(err)
	}
	framed(t, b, 31)

	reg.SeedSchema("t-value", 2, 32, sr.Schema{Schema: v2})
	clk.Advance(2 * time.Second) // the subject idle longer than Recheck
	before := reads.Load()
	b, err = value(t, v, "t", "", `{"a": 2, "channel": "app"}`)
	if err != nil {
		t.Fatalf("a payload of the version registered since the one in hand: %v; want it framed with the new version", err)
	}
	framed(t, b, 32)
	if n := reads.Load() - before; n != 1 {
		t.Errorf("%d reads for the payload: want one, the subject's latest read again", n)
	}

	// Refused by the latest too: dead-lettered naming it, and a stream of
	// such payloads reads the registry once per Recheck.
	before = reads.Load()
	for range 50 {
		_, err = value(t, v, "t", "", `{"a": "x"}`)
		schemaError(t, err, deadletter.ReasonSchemaMismatch, "t-value", 2)
	}
	if n := reads.Load() - before; n != 0 {
		t.Errorf("%d reads for 50 refused payloads within Recheck of the last read: want none", n)
	}
	clk.Advance(2 * time.Second)
	for range 50 {
		_, err = value(t, v, "t", "", `{"a": "x"}`)
		schemaError(t, err, deadletter.ReasonSchemaMismatch, "t-value", 2)
	}
	if n := reads.Load() - before; n != 1 {
		t.Errorf("%d reads for 50 refused payloads after Recheck passed: want one", n)
	}

	// With Recheck zero, each refused payload reads once, and only once.
	v.mu.Lock()
	v.cfg.Recheck = 0
	v.mu.Unlock()
	before = reads.Load()
	for range 3 {
		_, err = value(t, v, "t", "", `{"a": "x"}`)
		schemaError(t, err, deadletter.ReasonSchemaMismatch, "t-value", 2)
	}
	if n := reads.Load() - before; n != 3 {
		t.Errorf("%d reads for 3 refused payloads with Recheck zero: want 3", n)
	}

	// A pinned version is what it is: no read for a payload it refuses.
	vp, _ := newValues(t, reg, Config{Default: Rule{Format: Avro, Version: 1}, Recheck: time.Second})
	clkp := withClock(vp)
	if _, err := value(t, vp, "t", "", `{"a": 1}`); err != nil {
		t.Fatal(err)
	}
	clkp.Advance(time.Hour)
	before = reads.Load()
	_, err = value(t, vp, "t", "", `{"a": 2, "channel": "app"}`)
	schemaError(t, err, deadletter.ReasonSchemaMismatch, "t-value", 1)
	if n := reads.Load() - before; n != 0 {
		t.Errorf("%d reads for a payload its pinned version refuses: want none", n)
	}
}

// TestMissingSubjectReadAgainFirst: an event of a subject the registry
// lacked when last asked (more than Recheck ago) waits while it is asked
// again, and is framed once the subject is registered.
func TestMissingSubjectReadAgainFirst(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	v, _ := newValues(t, reg, Config{Default: Rule{Format: JSONSchema}, Refresh: time.Hour, Recheck: time.Second})
	clk := withClock(v)
	_, err := value(t, v, "orders", "", `{"id": 1, "customer": "ada"}`)
	schemaError(t, err, deadletter.ReasonSchemaNotFound, "orders-value", 0)
	reg.SeedSchema("orders-value", 1, 8, sr.Schema{Schema: orderJSONSchema, Type: sr.TypeJSON})
	clk.Advance(2 * time.Second)
	b, err := value(t, v, "orders", "", `{"id": 1, "customer": "ada"}`)
	if err != nil {
		t.Fatalf("an event of a subject registered since it was found missing: %v", err)
	}
	framed(t, b, 8)
}

// holdLog is a HoldReporter that keeps what it was told.
type holdLog struct {
	mu      sync.Mutex
	events  []string // "Hold <reason>" or "Clear", each change once
	held    bool
	reason  string
	message string
}

func (h *holdLog) Hold(reason, message string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.held || h.reason != reason {
		h.events = append(h.events, "Hold "+reason)
	}
	h.held, h.reason, h.message = true, reason, message
}

func (h *holdLog) Clear() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.held {
		h.events = append(h.events, "Clear")
	}
	h.held, h.reason, h.message = false, "", ""
}

func (h *holdLog) state() (held bool, reason, message string, events []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held, h.reason, h.message, append([]string(nil), h.events...)
}

// waitUntil polls cond until it holds, failing the test after a minute.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: a minute passed", what)
		}
	}
}

// TestHoldsWhileEventsWait: a registry that refuses while an event waits
// for a subject's schema holds delivery as Unreachable, naming the
// subject, the registry's URL without its credentials and the error; one
// that does not answer, as NotAnswering, before the read gives up; each
// hold cleared once the subject's schema is in hand. A failed refresh of
// a schema in hand holds nothing; a read again before a dead letter that
// fails holds, and the event waits rather than being dead-lettered.
func TestHoldsWhileEventsWait(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("orders-value", 1, 9, sr.Schema{Schema: orderJSONSchema, Type: sr.TypeJSON})
	var mode atomic.Value // "", "refuse" or "hang"
	mode.Store("")
	release := make(chan struct{})
	reg.Intercept(func(w http.ResponseWriter, r *http.Request) bool {
		switch mode.Load() {
		case "refuse":
			http.Error(w, `{"error_code":50001,"message":"storage unavailable"}`, http.StatusInternalServerError)
			return true
		case "hang":
			select {
			case <-release:
			case <-r.Context().Done():
				return true
			}
		}
		return false
	})
	u, err := url.Parse(reg.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword("relay", "s3cret")
	cfg := withDefaults(Config{Default: Rule{Format: JSONSchema}, RetryPause: 10 * time.Millisecond, Timeout: time.Minute})
	cfg.URLs = []string{u.String()}
	h := &holdLog{}
	v, err := New(cfg, zap.NewNop(), metrics.NewUnregistered(), ReportHolds(h))
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	v.notAnswering = 50 * time.Millisecond
	ev := &decoder.Event{Payload: []byte(`{"id": 1, "customer": "ada"}`)}

	// Refused: Unreachable while the event waits.
	mode.Store("refuse")
	_, wait, err := v.Value("orders", ev)
	if wait == nil || err != nil {
		t.Fatalf("registry refusing: %v, %v; want a wait", wait, err)
	}
	waitUntil(t, "the Unreachable hold", func() bool { held, reason, _, _ := h.state(); return held && reason == HoldUnreachable })
	_, _, msg, _ := h.state()
	for _, want := range []string{"orders-value", reg.URL(), "storage unavailable", "commit order"} {
		if !strings.Contains(msg, want) {
			t.Errorf("hold message %q: want it to name %q", msg, want)
		}
	}
	if strings.Contains(msg, "s3cret") || strings.Contains(msg, "relay:") {
		t.Errorf("hold message %q carries the URL's credentials", msg)
	}
	mode.Store("")
	if b, err := value(t, v, "orders", "", string(ev.Payload)); err != nil || b == nil {
		t.Fatalf("registry back: %x, %v", b, err)
	}
	if held, _, _, _ := h.state(); held {
		t.Error("held after the subject's schema came")
	}

	// A refresh of the schema in hand that fails holds nothing.
	clk := withClock(v)
	clk.Advance(2 * time.Hour)
	mode.Store("refuse")
	for range 3 {
		if b, wait, err := v.Value("orders", ev); b == nil || wait != nil || err != nil {
			t.Fatalf("refresh failing: %x, %v, %v; want the schema in hand to serve", b, wait, err)
		}
	}
	v.bg.Wait()
	if held, _, _, _ := h.state(); held {
		t.Error("a failed refresh of a schema in hand holds delivery")
	}

	// A read again before a dead letter that fails holds, and the event
	// waits: never dead-lettered for want of an answer.
	clk.Advance(2 * time.Hour)
	bad := &decoder.Event{Payload: []byte(`{"id": "one"}`)}
	for i := range 5 {
		_, wait, err := v.Value("orders", bad)
		if err != nil || wait == nil {
			t.Fatalf("read again failing, call %d: %v, %v; want the event to wait", i, wait, err)
		}
		<-wait
	}
	if held, reason, _, _ := h.state(); !held || reason != HoldUnreachable {
		t.Errorf("read again before a dead letter failing: held %v (%s); want Unreachable", held, reason)
	}
	mode.Store("")
	_, err = value(t, v, "orders", "", string(bad.Payload))
	schemaError(t, err, deadletter.ReasonSchemaMismatch, "orders-value", 1)
	if held, _, _, _ := h.state(); held {
		t.Error("held after the read again answered")
	}

	// Hung: NotAnswering while the read waits, before it gives up.
	reg.SeedSchema("payments-value", 1, 10, sr.Schema{Schema: orderJSONSchema, Type: sr.TypeJSON})
	mode.Store("hang")
	_, wait, _ = v.Value("payments", ev)
	if wait == nil {
		t.Fatal("registry hanging: want a wait")
	}
	waitUntil(t, "the NotAnswering hold", func() bool { held, reason, _, _ := h.state(); return held && reason == HoldNotAnswering })
	if _, _, msg, _ := h.state(); !strings.Contains(msg, "payments-value") || !strings.Contains(msg, "unanswered") {
		t.Errorf("hold message %q: want the subject and that the registry has not answered", msg)
	}
	close(release)
	<-wait
	if b, err := value(t, v, "payments", "", string(ev.Payload)); err != nil || b == nil {
		t.Fatalf("registry answering again: %x, %v", b, err)
	}
	held, _, _, events := h.state()
	if held {
		t.Error("held after the hung read answered")
	}
	if want := []string{"Hold Unreachable", "Clear", "Hold Unreachable", "Clear", "Hold NotAnswering", "Clear"}; !reflect.DeepEqual(events, want) {
		t.Errorf("holds reported %q; want %q", events, want)
	}
}

// TestTimedOutReadIsNotAnswering: a read that gives up without an answer
// holds as NotAnswering, the reason it held with while it waited, so that
// a hung registry is one hold, not one per retry.
func TestTimedOutReadIsNotAnswering(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	reg.SeedSchema("orders-value", 1, 9, sr.Schema{Schema: orderJSONSchema, Type: sr.TypeJSON})
	var hang atomic.Bool
	hang.Store(true)
	reg.Intercept(func(w http.ResponseWriter, r *http.Request) bool {
		if hang.Load() {
			<-r.Context().Done()
			return true
		}
		return false
	})
	h := &holdLog{}
	cfg := withDefaults(Config{Default: Rule{Format: JSONSchema}, Timeout: 100 * time.Millisecond, RetryPause: 10 * time.Millisecond})
	cfg.URLs = []string{reg.URL()}
	m := metrics.NewUnregistered()
	v, err := New(cfg, zap.NewNop(), m, ReportHolds(h))
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	ev := &decoder.Event{Payload: []byte(`{"id": 1, "customer": "ada"}`)}
	for counter(t, m, "error") < 3 {
		_, wait, err := v.Value("orders", ev)
		if wait == nil || err != nil {
			t.Fatalf("registry hanging: %v, %v; want a wait", wait, err)
		}
		<-wait
	}
	if _, _, msg, _ := h.state(); !strings.Contains(msg, "schema.Config.Timeout") {
		t.Errorf("hold message %q: want it to say the read gave up at schema.Config.Timeout", msg)
	}
	hang.Store(false)
	if _, err := value(t, v, "orders", "", string(ev.Payload)); err != nil {
		t.Fatal(err)
	}
	if _, _, _, events := h.state(); !reflect.DeepEqual(events, []string{"Hold NotAnswering", "Clear"}) {
		t.Errorf("holds reported %q; want one NotAnswering hold, then its end", events)
	}
}

// TestRecheckWithTheDecodersOnePointer: the decoder gives every event the
// same *decoder.Event. An event that waited for a read again and got its
// value must not leave that read to the next event as if it were the
// next one's: a version registered later is still read for the events
// written for it.
func TestRecheckWithTheDecodersOnePointer(t *testing.T) {
	reg := srfake.New()
	defer reg.Close()
	schemaOf := func(fields ...string) sr.Schema {
		s := `{"type":"record","name":"E","fields":[{"name":"a","type":"long"}`
		for _, f := range fields {
			s += `,{"name":"` + f + `","type":"string","default":""}`
		}
		return sr.Schema{Schema: s + `]}`}
	}
	reg.SeedSchema("t-value", 1, 41, schemaOf())
	v, _ := newValues(t, reg, Config{Default: Rule{Format: Avro}, Refresh: time.Hour, Recheck: time.Second})
	clk := withClock(v)
	ev := &decoder.Event{} // the decoder's one event, each row in turn
	send := func(payload string) ([]byte, error) {
		t.Helper()
		ev.Payload = []byte(payload)
		for range 20 {
			b, wait, err := v.Value("t", ev)
			if wait == nil {
				return b, err
			}
			<-wait
		}
		t.Fatal("Value still waits after 20 registry reads")
		return nil, nil
	}
	if b, err := send(`{"a": 1}`); err != nil {
		t.Fatal(err)
	} else {
		framed(t, b, 41)
	}
	for i, field := range []string{"b", "c", "d"} {
		reg.SeedSchema("t-value", i+2, 42+i, schemaOf([]string{"b", "c", "d"}[:i+1]...))
		clk.Advance(2 * time.Second)
		b, err := send(`{"a": 1, "` + field + `": "x"}`)
		if err != nil {
			t.Fatalf("version %d: a row using its field %s: %v; want it framed with it", i+2, field, err)
		}
		framed(t, b, 42+i)
	}
}
