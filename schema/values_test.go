package schema

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net/http"
	"strings"
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
