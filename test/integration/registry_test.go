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
	"io"
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
	"go.uber.org/zap"
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

// TestSchemaRegistryNewVersion: a new version registered while the relay
// holds the subject's previous one (a long --schema-refresh keeps it in
// hand) never turns the events written for it into dead letters: a
// payload that does not match the schema in hand is checked against the
// subject's latest before it is dead-lettered. A compatible version adding
// a field: every row using it is published, framed with the new id. An
// incompatible one under compatibility NONE: the rows of the new shape
// are published with the new id, and those of the old shape dead-lettered
// naming the new version.
func TestSchemaRegistryNewVersion(t *testing.T) {
	url := needRegistry(t)
	e := newEnv(t)
	cl, err := sr.NewClient(sr.URLs(url))
	if err != nil {
		t.Fatal(err)
	}
	orderSubject, paymentSubject := e.topic("order")+"-value", e.topic("payment")+"-value"
	register(t, cl, orderSubject, sr.Schema{Schema: registryAvro, Type: sr.TypeAvro})
	ctx, cancel := context.WithTimeout(e.ctx, 30*time.Second)
	defer cancel()
	if res := cl.SetCompatibility(ctx, sr.SetCompatibility{Level: sr.CompatNone}, paymentSubject); len(res) != 1 || res[0].Err != nil {
		t.Fatalf("compatibility NONE for %s: %+v", paymentSubject, res)
	}
	const paymentV1 = `{"type":"object","properties":{"id":{"type":"integer"},"amount":{"type":"number"}},
		"required":["id","amount"],"additionalProperties":false}`
	register(t, cl, paymentSubject, sr.Schema{Schema: paymentV1, Type: sr.TypeJSON})

	cfg := e.config()
	cfg.Values.URLs = []string{url}
	cfg.Values.Topics = map[string]schema.Rule{e.topic("order"): {Format: schema.Avro}, e.topic("payment"): {Format: schema.JSONSchema}}
	cfg.Values.Refresh = time.Hour // the versions read first stay in hand, stale, for the whole test
	// Every payload the version in hand refuses reads the subject again:
	// with the default (1s), a payload that came within a second of the
	// last read would be checked against it, and the test would depend
	// on how fast the rows follow the first ones.
	cfg.Values.Recheck = 0
	_, reg := e.startRelayGathered(cfg)
	c := e.consume()
	conn := e.conn()
	seq := 0
	insert := func(agg, payload string) {
		t.Helper()
		seq++
		if _, err := conn.Exec(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ($1, $2, 'T', $3, $4)`,
			agg, fmt.Sprint(seq), payload, seq); err != nil {
			t.Fatal(err)
		}
	}
	// Each subject's first version read and in hand.
	insert("order", `{"id": 0, "customer": "ada"}`)
	insert("payment", `{"id": 0, "amount": 1.5}`)
	c.waitIDs(2, 90*time.Second)

	orderV2 := register(t, cl, orderSubject, sr.Schema{Type: sr.TypeAvro, Schema: `{"type":"record","name":"OrderCreated","namespace":"shop","fields":[
		{"name":"id","type":"long"},{"name":"customer","type":"string"},
		{"name":"note","type":["null","string"],"default":null},
		{"name":"channel","type":"string","default":"web"}]}`})
	paymentV2 := register(t, cl, paymentSubject, sr.Schema{Type: sr.TypeJSON, Schema: `{"type":"object",
		"properties":{"id":{"type":"string"},"amount":{"type":"number"},"currency":{"type":"string"}},
		"required":["id","currency"],"additionalProperties":false}`})
	if orderV2.Version != 2 || paymentV2.Version != 2 {
		t.Fatalf("registered versions %d and %d: want 2 and 2", orderV2.Version, paymentV2.Version)
	}
	for i := range 25 {
		insert("order", fmt.Sprintf(`{"id": %d, "customer": "bob", "channel": "app"}`, i+1))
	}
	oldShape := 0
	for i := range 15 {
		if i%3 == 2 {
			insert("payment", fmt.Sprintf(`{"id": %d, "amount": 2}`, i)) // the old shape
			oldShape++
		} else {
			insert("payment", fmt.Sprintf(`{"id": "p-%d", "amount": 2, "currency": "EUR"}`, i))
		}
	}
	end := e.currentLSN(conn)
	recs := c.waitIDs(2+25+15, 90*time.Second)

	var orders, payments, dlq []*kgo.Record
	for _, r := range recs {
		switch r.Topic {
		case e.topic("order"):
			orders = append(orders, r)
		case e.topic("payment"):
			payments = append(payments, r)
		case e.topic("dlq"):
			dlq = append(dlq, r)
		}
	}
	// The dead letters first: they say what went wrong.
	wrong := 0
	for _, r := range dlq {
		subject, _ := header(r, deadletter.HeaderSchemaSubject)
		version, _ := header(r, deadletter.HeaderSchemaVersion)
		reason, _ := header(r, deadletter.HeaderReason)
		detail, _ := header(r, deadletter.HeaderDetail)
		if subject != paymentSubject || version != "2" || reason != string(deadletter.ReasonSchemaMismatch) {
			if wrong++; wrong <= 3 {
				t.Errorf("dead letter %s: subject %s version %s reason %s (%s); want only old-shape payments, checked against %s version 2",
					r.Value, subject, version, reason, detail, paymentSubject)
			}
		}
	}
	if len(dlq) != oldShape || wrong > 0 {
		t.Errorf("%d dead letters, %d of them not old-shape payments checked against version 2; want %d, the old-shape payments", len(dlq), wrong, oldShape)
	}
	if len(orders) != 26 {
		t.Fatalf("%d order records; want 26", len(orders))
	}
	s := avro.MustParse(`{"type":"record","name":"OrderCreated","namespace":"shop","fields":[
		{"name":"id","type":"long"},{"name":"customer","type":"string"},
		{"name":"note","type":["null","string"],"default":null},
		{"name":"channel","type":"string","default":"web"}]}`)
	for _, r := range orders {
		if binary.BigEndian.Uint32(r.Value[1:5]) != uint32(orderV2.ID) {
			continue // the row written before version 2 (checked by its id below)
		}
		var got struct {
			ID      int64  `avro:"id"`
			Channel string `avro:"channel"`
		}
		if err := avro.Unmarshal(s, wireBody(t, r.Value, orderV2.ID), &got); err != nil || got.Channel != "app" {
			t.Errorf("order record %x decoded as %+v (%v): want channel app", r.Value, got, err)
		}
	}
	if n := countSchemaID(orders, orderV2.ID); n != 25 {
		t.Errorf("%d order records framed with version 2's id %d; want the 25 written for it", n, orderV2.ID)
	}
	if n := countSchemaID(payments, paymentV2.ID); n != 15-oldShape || len(payments) != 16-oldShape {
		t.Errorf("%d payment records, %d framed with version 2's id %d; want %d and %d", len(payments), n, paymentV2.ID, 16-oldShape, 15-oldShape)
	}
	if got := gathered(reg, "walrelay_events_dead_lettered_total")[string(deadletter.ReasonSchemaMismatch)]; got != float64(oldShape) {
		t.Errorf("walrelay_events_dead_lettered_total{reason=schema_mismatch} = %v; want %d", got, oldShape)
	}
	e.waitFor("the slot confirmed past every row", 30*time.Second, func() (bool, error) {
		return e.slotInfo().ConfirmedLSN >= end, nil
	})
}

// countSchemaID counts the records framed with schema id.
func countSchemaID(recs []*kgo.Record, id int) int {
	n := 0
	for _, r := range recs {
		if len(r.Value) >= 5 && r.Value[0] == 0 && binary.BigEndian.Uint32(r.Value[1:5]) == uint32(id) {
			n++
		}
	}
	return n
}

// TestSchemaRegistryOutageHolds: while a subject not yet read has events
// waiting, the registry's outage is what readiness, the metric
// walrelay_delivery_held and the log name, not the lag it causes: the
// registry refusing connections (Unreachable, as when it is stopped), then
// accepting them and never answering (NotAnswering, named before the read
// gives up). Each outage gives one WARN when it starts and one when it
// ends. The registry is real; a TCP front the test controls stands before
// it.
func TestSchemaRegistryOutageHolds(t *testing.T) {
	target := needRegistry(t)
	e := newEnv(t)
	logs := e.observeLogs()
	cl, err := sr.NewClient(sr.URLs(target))
	if err != nil {
		t.Fatal(err)
	}
	register(t, cl, e.topic("order")+"-value", sr.Schema{Schema: registryJSONSchema, Type: sr.TypeJSON})
	register(t, cl, e.topic("payment")+"-value", sr.Schema{Schema: registryJSONSchema, Type: sr.TypeJSON})
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	front := startRegistryFront(t, u.Host)
	frontURL := "http://" + front.addr + u.Path

	cfg := e.config()
	cfg.Values.URLs = []string{frontURL}
	cfg.Values.Default = schema.Rule{Format: schema.JSONSchema}
	cfg.Values.RetryPause = 200 * time.Millisecond
	rr, reg := e.startRelayGathered(cfg)
	c := e.consume()
	held := func() map[string]float64 {
		out := map[string]float64{}
		for k, v := range gathered(reg, "walrelay_delivery_held") {
			if dep, reason, _ := strings.Cut(k, ","); dep == "schema_registry" {
				out[reason] = v
			}
		}
		return out
	}

	for _, phase := range []struct {
		agg, reason string
		outage      func()
	}{
		{"order", "Unreachable", front.refuse},
		{"payment", "NotAnswering", front.hang},
	} {
		subject := e.topic(phase.agg) + "-value"
		errorsBefore := gathered(reg, "walrelay_schema_registry_reads_total")["error"]
		phase.outage()
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ($1, 'k', 'T', '{"name": "ada"}', 1)`, phase.agg)
		var readyErr error
		e.waitFor("readiness to name the registry ("+phase.reason+")", 60*time.Second, func() (bool, error) {
			readyErr = rr.relay.Ready()
			return held()[phase.reason] == 1 && readyErr != nil && strings.Contains(readyErr.Error(), "schema_registry ("+phase.reason), nil
		})
		t.Logf("%s: readiness: %v", phase.reason, readyErr)
		for _, want := range []string{subject, frontURL} {
			if !strings.Contains(readyErr.Error(), want) {
				t.Errorf("%s: readiness %q: want it to name %s", phase.reason, readyErr, want)
			}
		}
		if phase.reason == "NotAnswering" {
			// Named while the read waits for its answer, not once it gave
			// up (schema.Config.Timeout, 10s).
			if got := gathered(reg, "walrelay_schema_registry_reads_total")["error"]; got != errorsBefore {
				t.Errorf("%v failed reads before the hold: want it named before the read gives up", got-errorsBefore)
			}
		}
		published := func() int {
			n := 0
			for _, r := range c.records() {
				if r.Topic == e.topic(phase.agg) || r.Topic == e.topic("dlq") {
					n++
				}
			}
			return n
		}
		if n := published(); n != 0 {
			t.Errorf("%s: %d records of the waiting event during the outage; want none", phase.reason, n)
		}
		front.forward()
		e.waitFor("the waiting event published", 60*time.Second, func() (bool, error) { return published() == 1, nil })
		e.waitFor("the hold cleared", 30*time.Second, func() (bool, error) {
			return len(held()) == 0, nil
		})
		if err := rr.relay.Ready(); err != nil && strings.Contains(err.Error(), "schema_registry") {
			t.Errorf("readiness after the outage: %v", err)
		}
		starts := warnings(logs, "delivery held by schema_registry", zap.String("reason", phase.reason))
		ends := warnings(logs, "schema_registry no longer holds delivery", zap.String("reason", phase.reason))
		if len(starts) != 1 || len(ends) != 1 {
			t.Errorf("%s: %d WARNs at the start, %d at the end; want one each", phase.reason, len(starts), len(ends))
		}
		for _, l := range starts {
			if !strings.Contains(l.Message, subject) || !strings.Contains(l.Message, frontURL) {
				t.Errorf("%s: WARN %q: want the subject and the registry's URL", phase.reason, l.Message)
			}
		}
	}
}

// registryFront is a TCP front of the registry that the test controls:
// forwarding; refusing connections, its port closed as a stopped
// registry's is; or hanging, accepting connections and leaving what they
// send unanswered in the socket until it forwards again, as a registry
// stopped with SIGSTOP answers once continued.
type registryFront struct {
	t      *testing.T
	addr   string
	target string
	wg     sync.WaitGroup

	mu     sync.Mutex
	ln     net.Listener  // nil while refusing
	resume chan struct{} // closed when a hang ends; nil unless hanging
	conns  map[net.Conn]bool
}

func startRegistryFront(t *testing.T, target string) *registryFront {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &registryFront{t: t, addr: ln.Addr().String(), target: target, conns: map[net.Conn]bool{}}
	f.serve(ln)
	t.Cleanup(func() {
		f.mu.Lock()
		if f.ln != nil {
			f.ln.Close()
		}
		if f.resume != nil {
			close(f.resume)
			f.resume = nil
		}
		f.cutLocked()
		f.mu.Unlock()
		f.wg.Wait()
	})
	return f
}

// serve accepts on ln until it is closed; f.mu is held or not needed.
func (f *registryFront) serve(ln net.Listener) {
	f.ln = ln
	f.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f.wg.Go(func() { f.pipe(c) })
		}
	})
}

func (f *registryFront) pipe(c net.Conn) {
	f.mu.Lock()
	resume := f.resume
	f.conns[c] = true
	f.mu.Unlock()
	defer f.drop(c)
	if resume != nil {
		<-resume
	}
	d, err := net.DialTimeout("tcp", f.target, 10*time.Second)
	if err != nil {
		return
	}
	f.mu.Lock()
	f.conns[d] = true
	f.mu.Unlock()
	defer f.drop(d)
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(d, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, d); done <- struct{}{} }()
	<-done // the deferred drops end the other copy
}

func (f *registryFront) drop(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

// cutLocked resets every connection; f.mu is held.
func (f *registryFront) cutLocked() {
	for c := range f.conns {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		c.Close()
	}
	clear(f.conns)
}

// refuse closes the port: connecting is refused.
func (f *registryFront) refuse() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cutLocked()
	if f.ln != nil {
		f.ln.Close()
		f.ln = nil
	}
}

// hang accepts connections and answers nothing on them; the open ones
// are reset, so that the client's next request opens one that hangs.
func (f *registryFront) hang() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cutLocked()
	if f.resume == nil {
		f.resume = make(chan struct{})
	}
}

// forward forwards again: the port reopened, and the connections held by
// a hang forwarded with what they sent.
func (f *registryFront) forward() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ln == nil {
		ln, err := net.Listen("tcp", f.addr)
		if err != nil {
			f.t.Fatalf("reopen the registry's front on %s: %v", f.addr, err)
		}
		f.serve(ln)
	}
	if f.resume != nil {
		close(f.resume)
		f.resume = nil
	}
}
