package integration

// registry_test.go: the value formats (package schema, --value-format)
// against a real schema registry, Apicurio Registry 3
// (test/schemaregistry): one registry JVM for the package, started by
// the first test that needs it, on the runs that have the JVMs (make
// test-kafka), or an external one named by WALRELAY_TEST_REGISTRY_URL.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hamba/avro/v2"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sr"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/outbox"
	"github.com/walrelay/walrelay/schema"
	"github.com/walrelay/walrelay/test/schemaregistry"
)

var (
	registryOnce sync.Once
	registry     *schemaregistry.Registry
	registryErr  error
)

// needRegistry returns the base URL of the package's schema registry
// (Confluent's API), starting it on first use; tests skip on runs without
// the JVMs.
func needRegistry(t *testing.T) string {
	t.Helper()
	if u := os.Getenv("WALRELAY_TEST_REGISTRY_URL"); u != "" {
		return u
	}
	if apache == nil {
		t.Skip("needs a schema registry: run with WALRELAY_TEST_KAFKA=apache (make test-kafka, which starts Apicurio Registry) or set WALRELAY_TEST_REGISTRY_URL")
	}
	registryOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
		defer cancel()
		start := time.Now()
		registry, registryErr = schemaregistry.Start(ctx, "")
		if registryErr == nil {
			fmt.Fprintf(os.Stderr, "Apicurio Registry answering at %s after %s (log: %s)\n", registry.URL, time.Since(start).Round(time.Millisecond), registry.Log)
		}
	})
	if registryErr != nil {
		t.Fatalf("start the schema registry: %v", registryErr)
	}
	return registry.URL
}

// closeRegistry stops the package's registry, if one was started; its
// log is kept when the tests failed.
func closeRegistry(failed bool) {
	switch {
	case registry == nil:
	case failed:
		registry.Stop()
		fmt.Fprintln(os.Stderr, "tests failed: Apicurio Registry's log kept in", registry.Log)
	default:
		registry.Close()
	}
}

// register registers s under subject and returns its id and version.
func register(t *testing.T, cl *sr.Client, subject string, s sr.Schema) sr.SubjectSchema {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ss, err := cl.CreateSchema(ctx, subject, s)
	if err != nil {
		t.Fatalf("register %s: %v", subject, err)
	}
	return ss
}

const (
	registryAvro = `{"type":"record","name":"OrderCreated","namespace":"shop","fields":[
		{"name":"id","type":"long"},{"name":"customer","type":"string"},
		{"name":"note","type":["null","string"],"default":null}]}`
	registryJSONSchema = `{"$schema":"http://json-schema.org/draft-07/schema#","type":"object",
		"properties":{"name":{"type":"string","minLength":1}},"required":["name"]}`
	registryProto = `syntax = "proto3"; package shop; message PaymentTaken { int64 order = 1; double amount = 2; }`
)

// TestSchemaRegistryValues: one relay frames three topics' values in the
// registry's wire format, Avro, JSON Schema and Protobuf, each from the
// schema registered for <topic>-value, and leaves a fourth as is; each
// payload that does not match its schema is dead-lettered naming the
// subject and version, and the slot moves past them all.
func TestSchemaRegistryValues(t *testing.T) {
	url := needRegistry(t)
	e := newEnv(t)
	cl, err := sr.NewClient(sr.URLs(url))
	if err != nil {
		t.Fatal(err)
	}
	order := register(t, cl, e.topic("order")+"-value", sr.Schema{Schema: registryAvro, Type: sr.TypeAvro})
	customer := register(t, cl, e.topic("customer")+"-value", sr.Schema{Schema: registryJSONSchema, Type: sr.TypeJSON})
	payment := register(t, cl, e.topic("payment")+"-value", sr.Schema{Schema: registryProto, Type: sr.TypeProtobuf})

	cfg := e.config()
	cfg.Values.URLs = []string{url}
	cfg.Values.Topics = map[string]schema.Rule{
		e.topic("order"):    {Format: schema.Avro},
		e.topic("customer"): {Format: schema.JSONSchema},
		e.topic("payment"):  {Format: schema.Protobuf},
	}
	e.startRelay(cfg)
	c := e.consume()
	conn := e.conn()
	rows := []struct{ agg, payload string }{
		{"order", `{"id": 1, "customer": "ada"}`},
		{"order", `{"id": 2, "customer": "bob", "note": "fragile"}`},
		{"order", `{"id": "3", "customer": "cy"}`}, // id is a string: mismatch
		{"customer", `{"name": "ada"}`},
		{"customer", `{"name": ""}`}, // minLength: mismatch
		{"payment", `{"order": "1", "amount": 9.5}`},
		{"payment", `{"order": 1, "tip": 1}`}, // no field tip: mismatch
		{"plain", `{"anything": true}`},
	}
	for i, r := range rows {
		if _, err := conn.Exec(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ($1, $2, 'T', $3, $4)`,
			r.agg, fmt.Sprint(i), r.payload, i); err != nil {
			t.Fatal(err)
		}
	}
	end := e.currentLSN(conn)
	recs := c.waitIDs(len(rows), 90*time.Second)

	byTopic := map[string][]*kgo.Record{}
	for _, r := range recs {
		byTopic[strings.TrimPrefix(r.Topic, e.topicPrefix())] = append(byTopic[strings.TrimPrefix(r.Topic, e.topicPrefix())], r)
	}
	if n := len(byTopic["order"]); n != 2 {
		t.Fatalf("%d order records; want 2", n)
	}
	s := avro.MustParse(registryAvro)
	for i, r := range byTopic["order"] {
		var got struct {
			ID       int64   `avro:"id"`
			Customer string  `avro:"customer"`
			Note     *string `avro:"note"`
		}
		if err := avro.Unmarshal(s, wireBody(t, r.Value, order.ID), &got); err != nil {
			t.Fatalf("order record %d: %v", i, err)
		}
		// (Each row has a key of its own: the two may come in any order.)
		if want := map[int64]string{1: "ada", 2: "bob"}[got.ID]; got.Customer != want || (got.ID == 2) != (got.Note != nil) {
			t.Errorf("order record %d decoded as %+v", i, got)
		}
	}
	if len(byTopic["customer"]) != 1 || !sameJSON(wireBody(t, byTopic["customer"][0].Value, customer.ID), rows[3].payload) {
		t.Errorf("customer records %v: want one, the payload framed unchanged", byTopic["customer"])
	}
	if len(byTopic["payment"]) != 1 {
		t.Fatalf("%d payment records; want 1", len(byTopic["payment"]))
	}
	// Message index 0 (the file's first message), then field 1 (varint 1)
	// and field 2 (double 9.5).
	if got, want := wireBody(t, byTopic["payment"][0].Value, payment.ID), []byte{0, 0x08, 1, 0x11, 0, 0, 0, 0, 0, 0, 0x23, 0x40}; !reflect.DeepEqual(got, want) {
		t.Errorf("payment value %x; want %x", got, want)
	}
	if len(byTopic["plain"]) != 1 || !sameJSON(byTopic["plain"][0].Value, rows[7].payload) {
		t.Errorf("plain records %v: want the payload as is", byTopic["plain"])
	}
	dlq := byTopic["dlq"]
	if len(dlq) != 3 {
		t.Fatalf("%d dead letters; want 3", len(dlq))
	}
	subjects := map[string]bool{}
	for _, r := range dlq {
		reason, _ := header(r, deadletter.HeaderReason)
		subject, _ := header(r, deadletter.HeaderSchemaSubject)
		version, _ := header(r, deadletter.HeaderSchemaVersion)
		detail, _ := header(r, deadletter.HeaderDetail)
		if reason != string(deadletter.ReasonSchemaMismatch) || version != "1" {
			t.Errorf("dead letter reason %q, subject %q, version %q (%s): want schema_mismatch, version 1", reason, subject, version, detail)
		}
		subjects[subject] = true
	}
	for _, agg := range []string{"order", "customer", "payment"} {
		if !subjects[e.topic(agg)+"-value"] {
			t.Errorf("no dead letter names subject %s-value: %v", e.topic(agg), subjects)
		}
	}
	e.waitFor("the slot confirmed past every row", 30*time.Second, func() (bool, error) {
		return e.slotInfo().ConfirmedLSN >= end, nil
	})
}

// TestSchemaRegistryDownDelays: while the registry does not answer, the
// events whose schema it holds wait: nothing is published nor
// dead-lettered, and the slot is not confirmed past them; once it answers,
// they are published, framed. The registry is real; a proxy in front of it
// stops answering.
func TestSchemaRegistryDownDelays(t *testing.T) {
	target := needRegistry(t)
	e := newEnv(t)
	cl, err := sr.NewClient(sr.URLs(target))
	if err != nil {
		t.Fatal(err)
	}
	ss := register(t, cl, e.topic("order")+"-value", sr.Schema{Schema: registryJSONSchema, Type: sr.TypeJSON})
	var down atomic.Bool
	down.Store(true)
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: u.Scheme, Host: u.Host})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if down.Load() {
			http.Error(w, "registry down", http.StatusServiceUnavailable)
			return
		}
		proxy.ServeHTTP(w, r)
	})}
	addr := listenLoopback(t, srv)

	cfg := e.config()
	cfg.Values.URLs = []string{"http://" + addr + u.Path}
	cfg.Values.Default = schema.Rule{Format: schema.JSONSchema}
	cfg.Values.RetryPause = 200 * time.Millisecond
	_, reg := e.startRelayGathered(cfg)
	c := e.consume()
	conn := e.conn()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('order', 'k', 'T', '{"name": "ada"}', 1)`)
	end := e.currentLSN(conn)
	e.waitFor("the relay to retry the registry", 60*time.Second, func() (bool, error) {
		return gathered(reg, "walrelay_schema_registry_reads_total")["error"] >= 3, nil
	})
	if recs := c.records(); len(recs) != 0 {
		t.Fatalf("%d records while the registry was down: want none (not published, not dead-lettered)", len(recs))
	}
	if got := e.slotInfo().ConfirmedLSN; got >= end {
		t.Fatalf("slot confirmed %s, past the waiting event (before %s)", got, end)
	}

	down.Store(false)
	recs := c.waitIDs(1, 60*time.Second)
	if len(recs) != 1 || recs[0].Topic != e.topic("order") || !sameJSON(wireBody(t, recs[0].Value, ss.ID), `{"name": "ada"}`) {
		t.Fatalf("records %v: want the event on its topic, framed with schema id %d", recs, ss.ID)
	}
	e.waitFor("the slot confirmed past the event", 30*time.Second, func() (bool, error) {
		return e.slotInfo().ConfirmedLSN >= end, nil
	})
}

// wireBody checks the registry wire header of v (magic byte 0, schema id)
// and returns what follows.
func wireBody(t *testing.T, v []byte, id int) []byte {
	t.Helper()
	if len(v) < 5 || v[0] != 0 || int(binary.BigEndian.Uint32(v[1:5])) != id {
		t.Fatalf("value %x: want the magic byte 0 and schema id %d first", v, id)
	}
	return v[5:]
}

// sameJSON reports whether a and b are the same JSON value.
func sameJSON(a []byte, b string) bool {
	var x, y any
	return json.Unmarshal(a, &x) == nil && json.Unmarshal([]byte(b), &y) == nil && reflect.DeepEqual(x, y)
}

// listenLoopback serves srv on a free loopback port until the test ends,
// and returns its address.
func listenLoopback(t *testing.T, srv *http.Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// TestSchemaRegistryWriterCheck: an outbox.Writer checking payloads with
// the relay's value formats (schema.WriterCheck) fails the business
// transaction of a payload its schema refuses, naming the subject and
// version, before anything is inserted; a matching one commits.
func TestSchemaRegistryWriterCheck(t *testing.T) {
	url := needRegistry(t)
	e := newEnv(t)
	cl, err := sr.NewClient(sr.URLs(url))
	if err != nil {
		t.Fatal(err)
	}
	register(t, cl, e.topic("order")+"-value", sr.Schema{Schema: registryAvro, Type: sr.TypeAvro})
	vcfg := schema.DefaultConfig()
	vcfg.URLs = []string{url}
	vcfg.Default = schema.Rule{Format: schema.Avro}
	values, err := schema.New(vcfg, zaptest.NewLogger(t), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	defer values.Close()
	w, err := outbox.NewWriter(outbox.Table{}, outbox.Options{Keep: true,
		Check: schema.WriterCheck{Values: values, TopicTemplate: e.topicPrefix() + "{aggregate_type}"}})
	if err != nil {
		t.Fatal(err)
	}
	conn := e.conn()
	write := func(payload string) error {
		return pgx.BeginFunc(e.ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(e.ctx, `CREATE TABLE IF NOT EXISTS orders (id int)`); err != nil {
				return err
			}
			if _, err := tx.Exec(e.ctx, `INSERT INTO orders VALUES (1)`); err != nil {
				return err
			}
			_, err := w.Write(e.ctx, tx, outbox.Event{AggregateType: "order", AggregateID: "1", Type: "OrderCreated", Payload: []byte(payload)})
			return err
		})
	}
	err = write(`{"id": "one", "customer": "ada"}`)
	var se *deadletter.SchemaError
	if !errors.As(err, &se) || se.Reason != deadletter.ReasonSchemaMismatch || se.Subject != e.topic("order")+"-value" || se.Version != 1 {
		t.Fatalf("write of a payload the schema refuses: %v; want a schema_mismatch naming subject %s-value version 1", err, e.topic("order"))
	}
	var n int
	if err := conn.QueryRow(e.ctx, `SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM pg_tables WHERE tablename = 'orders')`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("after the refused write: %d rows and tables (%v); want the whole transaction rolled back", n, err)
	}
	if err := write(`{"id": 1, "customer": "ada"}`); err != nil {
		t.Fatalf("write of a matching payload: %v", err)
	}
	if err := conn.QueryRow(e.ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d outbox rows (%v); want the matching event", n, err)
	}
}
