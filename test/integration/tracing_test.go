package integration

// OpenTelemetry across the chain (issue 34): the order service's span,
// walrelay's producer span and the ledger consumer's span of each event in
// one trace, in that parent order, exported to an OTLP receiver the test
// runs in-process; a collector killed mid-run costing spans, counted,
// never an event; and a catch-up's spans exported, or their loss said
// (issue 47).

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/outbox"
	"github.com/walrelay/walrelay/test/otlptest"
	"github.com/walrelay/walrelay/tracing"
)

// startReceiver runs an OTLP receiver until the test ends.
func startReceiver(t *testing.T) *otlptest.Receiver {
	t.Helper()
	r, err := otlptest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	return r
}

// otelEnv sets the OpenTelemetry variables for exports to endpoint over
// protocol (and the rest, name and value pairs) until the test ends: the
// relay binary inherits them, and FromEnv reads them.
func otelEnv(t *testing.T, endpoint, protocol string, more ...string) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
	for i := 0; i+1 < len(more); i += 2 {
		t.Setenv(more[i], more[i+1])
	}
}

// provider is a tracing SDK configured from the environment, for one
// part of the chain (its service name), shut down when the test ends.
func provider(t *testing.T, service string) *tracing.Provider {
	t.Helper()
	cfg, err := tracing.FromEnv(lookupEnv)
	if err != nil || !cfg.Enabled {
		t.Fatalf("tracing from the environment: %+v, %v", cfg, err)
	}
	p, err := tracing.Start(context.Background(), cfg, tracing.Options{ServiceName: service})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Shutdown(context.Background()) })
	return p
}

// TestChainTracing runs the chain with tracing on in each delivery mode
// (exports over gRPC at-least-once, HTTP exactly-once): every event is one
// trace of the writer's span, walrelay's producer span (its child, from
// the commit to Kafka's acknowledgement, with the messaging attributes and
// where Kafka put the record) and the ledger's consumer span (the
// producer's child, for the same partition and offset); a copy of a
// record is a second consumer span marked duplicate; a poison event's
// consumer span is marked dead-lettered, and so is the producer span of
// an event the relay dead-letters.
func TestChainTracing(t *testing.T) {
	for _, mode := range []struct {
		name     string
		eos      bool
		protocol string
	}{{"at-least-once", false, tracing.ProtocolGRPC}, {"exactly-once", true, tracing.ProtocolHTTP}} {
		t.Run(mode.name, func(t *testing.T) {
			rcv := startReceiver(t)
			endpoint := rcv.GRPCEndpoint()
			if mode.protocol == tracing.ProtocolHTTP {
				endpoint = rcv.HTTPEndpoint()
			}
			otelEnv(t, endpoint, mode.protocol, "OTEL_BSP_SCHEDULE_DELAY", "100")
			shop, relayTP, ledger := provider(t, "shop"), provider(t, "walrelay"), provider(t, "ledger")

			ch := newChain(t)
			ch.svc.Tracer = shop.TracerProvider().Tracer("shop")
			ch.transactional = mode.eos
			ch.createTopics()
			cfg := ch.e.config()
			cfg.Router.Tracer = relayTP.Producer()
			cfg.ExactlyOnce = mode.eos
			ch.e.startRelay(cfg)
			var extra []kgo.Opt
			if mode.eos {
				extra = append(extra, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
			}
			ccfg := ch.consumerConfig(prometheus.NewRegistry(), extra...)
			ccfg.TracerProvider = ledger.TracerProvider()
			ccfg.MaxAttempts = 2
			lc := ch.startConsumer(ccfg, nil)

			ch.writeOrders(2) // six events
			poison := ch.writeTraced(shop, "poison", outbox.Event{AggregateType: "order", AggregateID: "1", Type: "OrderPaid", Payload: []byte(`"not an order event"`)})
			invalid := ch.writeInvalidTraced(shop)
			ch.waitLedger(time.Minute)

			// A copy of a record, as a relay's resend after a crash
			// delivers it: the same headers, so the same producer span.
			var orig *kgo.Record
			raw := ch.e.consumeWith(extra...)
			ch.e.waitFor("an order record", time.Minute, func() (bool, error) {
				for _, r := range raw.records() {
					if r.Topic == ch.topic {
						orig = r
						return true, nil
					}
				}
				return false, nil
			})
			ch.produceCopy(orig)
			ch.e.waitFor("the copy skipped as a duplicate", time.Minute, func() (bool, error) {
				return lc.metric("inbox_duplicates_total") == 1, nil
			})
			dupID, _ := header(orig, "id")

			var ids []string
			rows, err := ch.db.Query(ch.e.ctx, "SELECT event_id FROM ledger")
			if err != nil {
				t.Fatal(err)
			}
			if ids, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
				t.Fatal(err)
			}
			for _, p := range []*tracing.Provider{shop, relayTP, ledger} {
				if err := p.ForceFlush(ch.e.ctx); err != nil {
					t.Fatal(err)
				}
			}
			var traces map[string][]otlptest.Span
			ch.e.waitFor("the traces of every event", time.Minute, func() (bool, error) {
				traces = rcv.Traces()
				var missing []string
				for _, id := range append(ids, poison.String()) {
					want := 3
					if id == dupID {
						want = 4
					}
					if n := len(traceOf(traces, id)); n != want {
						missing = append(missing, fmt.Sprintf("%s: %d spans of %d", id, n, want))
					}
				}
				if n := len(traceOf(traces, invalid)); n != 2 {
					missing = append(missing, fmt.Sprintf("dead-lettered %s: %d spans of 2", invalid, n))
				}
				return len(missing) == 0, fmt.Errorf("%d traces incomplete: %s", len(missing), strings.Join(missing, "; "))
			})

			for _, id := range ids {
				checkChainTrace(t, traceOf(traces, id), id, ch.topic, ch.group, mode.eos, id == dupID)
			}
			// The poison event: the ledger's span says it was dead-lettered
			// after its attempts.
			pt := traceOf(traces, poison.String())
			checkChainTrace(t, pt, poison.String(), ch.topic, ch.group, mode.eos, false)
			if c := pt[2]; c.Status != tracepb.Status_STATUS_CODE_ERROR || c.Attrs["inbox.dead_letter.reason"] != "handler-failed" || countEvents(c, "inbox.handler_failed") != 2 {
				t.Errorf("poison's consumer span: status %v %q, attributes %v, events %v: want dead-lettered after 2 failed attempts", c.Status, c.StatusMessage, c.Attrs, c.Events)
			}
			// The event the relay dead-lettered: its producer span, to the
			// dead-letter topic, has an error status and the reason.
			it := traceOf(traces, invalid)
			if p := it[1]; p.Status != tracepb.Status_STATUS_CODE_ERROR || p.Attrs["walrelay.dead_letter.reason"] != "missing_aggregate_type" ||
				p.Attrs["messaging.destination.name"] != ch.e.topicPrefix()+"dlq" || p.ParentSpanID != it[0].SpanID {
				t.Errorf("dead-lettered event's producer span %+v: want an error, the reason, the dead-letter topic, the writer's span as parent", p)
			}
			t.Logf("%d traces received, %d spans", len(traces), len(rcv.Spans()))
		})
	}
}

// traceOf is the trace (spans in parent order) of the event id: the one
// whose producer span names it.
func traceOf(traces map[string][]otlptest.Span, id string) []otlptest.Span {
	for _, spans := range traces {
		for _, s := range spans {
			if s.Service == "walrelay" && s.Attrs["messaging.message.id"] == id {
				return spans
			}
		}
	}
	return nil
}

func countEvents(s otlptest.Span, name string) int {
	n := 0
	for _, e := range s.Events {
		if e.Name == name {
			n++
		}
	}
	return n
}

// checkChainTrace checks the trace of one published event: the writer's
// span, walrelay's producer span and the ledger's consumer span (two with
// a duplicate), each the child of the one before.
func checkChainTrace(t *testing.T, spans []otlptest.Span, id, topic, group string, eos, dup bool) {
	t.Helper()
	if len(spans) < 3 {
		t.Errorf("event %s: trace of %d spans", id, len(spans))
		return
	}
	w, p, c := spans[0], spans[1], spans[2]
	if w.Service != "shop" || w.ParentSpanID != "" || !strings.HasSuffix(w.Name, "order") && w.Name != "poison" {
		t.Errorf("event %s: first span %s/%q (parent %q), want the order service's root span", id, w.Service, w.Name, w.ParentSpanID)
	}
	if p.Service != "walrelay" || p.ParentSpanID != w.SpanID || p.Kind != tracepb.Span_SPAN_KIND_PRODUCER || p.Name != "send "+topic {
		t.Errorf("event %s: second span %s/%q kind %v parent %q, want walrelay's producer span %q, child of %s", id, p.Service, p.Name, p.Kind, p.ParentSpanID, "send "+topic, w.SpanID)
	}
	for k, v := range map[string]string{"messaging.system": "kafka", "messaging.operation.type": "send", "messaging.destination.name": topic, "messaging.message.id": id} {
		if p.Attrs[k] != v {
			t.Errorf("event %s: producer attribute %s = %q, want %q", id, k, p.Attrs[k], v)
		}
	}
	if p.Attrs["messaging.destination.partition.id"] == "" || p.Attrs["messaging.kafka.offset"] == "" || p.Status == tracepb.Status_STATUS_CODE_ERROR {
		t.Errorf("event %s: producer span without where Kafka put the record, or failed: %v, status %v %q", id, p.Attrs, p.Status, p.StatusMessage)
	}
	// The waits in the WAL, in the relay and for Kafka, on the relay's
	// clock: read, then produce, then (exactly-once) in the open Kafka
	// transaction, then the end.
	wantEvents := []string{tracing.EventRead, tracing.EventProduce}
	if eos {
		wantEvents = append(wantEvents, tracing.EventKafkaAck)
	}
	var got []string
	for i, e := range p.Events {
		got = append(got, e.Name)
		if i > 0 && e.Time.Before(p.Events[i-1].Time) || e.Time.After(p.End) {
			t.Errorf("event %s: producer span events out of order: %+v, end %v", id, p.Events, p.End)
		}
	}
	if strings.Join(got, ",") != strings.Join(wantEvents, ",") {
		t.Errorf("event %s: producer span events %v, want %v", id, got, wantEvents)
	}
	consumers := spans[2:]
	if want := 1 + map[bool]int{true: 1}[dup]; len(consumers) != want {
		t.Errorf("event %s: %d consumer spans, want %d", id, len(consumers), want)
	}
	dups := 0
	for _, c = range consumers {
		if c.Service != "ledger" || c.ParentSpanID != p.SpanID || c.Kind != tracepb.Span_SPAN_KIND_CONSUMER || c.Name != "process "+topic {
			t.Errorf("event %s: consumer span %s/%q kind %v parent %q, want the ledger's, child of the producer span %s", id, c.Service, c.Name, c.Kind, c.ParentSpanID, p.SpanID)
		}
		for k, v := range map[string]string{"messaging.system": "kafka", "messaging.operation.type": "process", "messaging.consumer.group.name": group, "messaging.message.id": id,
			"messaging.destination.partition.id": p.Attrs["messaging.destination.partition.id"]} {
			if c.Attrs[k] != v {
				t.Errorf("event %s: consumer attribute %s = %q, want %q", id, k, c.Attrs[k], v)
			}
		}
		if c.Attrs["inbox.duplicate"] == "true" {
			dups++
		} else if c.Attrs["messaging.kafka.offset"] != p.Attrs["messaging.kafka.offset"] {
			t.Errorf("event %s: consumer span at offset %s, producer span at %s: not the same record", id, c.Attrs["messaging.kafka.offset"], p.Attrs["messaging.kafka.offset"])
		}
	}
	if want := map[bool]int{true: 1}[dup]; dups != want {
		t.Errorf("event %s: %d consumer spans marked duplicate, want %d", id, dups, want)
	}
}

// writeTraced writes ev in a transaction of its own, in a span of the
// order service named name.
func (ch *chain) writeTraced(p *tracing.Provider, name string, ev outbox.Event) outbox.ID {
	ch.e.t.Helper()
	ctx, span := p.TracerProvider().Tracer("shop").Start(ch.e.ctx, name)
	defer span.End()
	var id outbox.ID
	err := pgx.BeginFunc(ctx, ch.db, func(tx pgx.Tx) error {
		var err error
		id, err = ch.svc.Outbox.Write(ctx, tx, ev)
		return err
	})
	if err != nil {
		ch.e.t.Fatal(err)
	}
	return id
}

// writeInvalidTraced inserts an outbox row with an empty aggregate type
// (the outbox.Writer refuses one, a hand-written INSERT does not), carrying
// the trace context of a span of the order service, and returns its id.
func (ch *chain) writeInvalidTraced(p *tracing.Provider) string {
	ch.e.t.Helper()
	ctx, span := p.TracerProvider().Tracer("shop").Start(ch.e.ctx, "invalid")
	defer span.End()
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, carrier)
	var id string
	if err := ch.db.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, traceparent) VALUES ('', '1', 'Invalid', '{}', $1) RETURNING id::text`,
		carrier.Get("traceparent")).Scan(&id); err != nil {
		ch.e.t.Fatal(err)
	}
	return id
}

// produceCopy produces a copy of rec (key, value, headers) to its topic.
func (ch *chain) produceCopy(rec *kgo.Record) {
	ch.e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(ch.e.brokers...))
	if err != nil {
		ch.e.t.Fatal(err)
	}
	defer cl.Close()
	cp := &kgo.Record{Topic: rec.Topic, Key: rec.Key, Value: rec.Value, Headers: rec.Headers}
	if err := cl.ProduceSync(ch.e.ctx, cp).FirstErr(); err != nil {
		ch.e.t.Fatal(err)
	}
}

// TestChainTracingCollectorKilled runs the walrelay binary with tracing
// on through the OTEL_* variables, a small export queue and short export
// timeouts, and kills the collector mid-run: every event still reaches
// the ledger once, without a stall, and the spans lost are counted in
// walrelay_trace_spans_dropped_total.
func TestChainTracingCollectorKilled(t *testing.T) {
	rcv := startReceiver(t)
	// The queue holds the first orders' 9 spans even if they come before
	// the exporter takes any (on a loaded machine it did not, and a
	// bounded queue drops the ninth); with the collector gone, spans are
	// lost to failed exports and a full queue both.
	otelEnv(t, rcv.GRPCEndpoint(), tracing.ProtocolGRPC,
		"OTEL_BSP_MAX_QUEUE_SIZE", "16", "OTEL_BSP_SCHEDULE_DELAY", "50",
		"OTEL_BSP_EXPORT_TIMEOUT", "1000", "OTEL_EXPORTER_OTLP_TIMEOUT", "500")
	ch := newChain(t)
	ch.createTopics()
	addr := freeAddr(t)
	relay := watch(t, ch.e.runBinary(replaceFlag(ch.e.args(), "--metrics-addr", addr)...))
	// The writer deletes its rows in their transaction: written before
	// the slot exists, they would be in no snapshot.
	ch.e.waitFor("slot active", time.Minute, func() (bool, error) {
		i, err := ch.e.slotInfoErr()
		return err == nil && i.Active, err
	})
	ch.startLedger()

	ch.writeOrders(3)
	ch.e.waitFor("the relay's spans at the collector", time.Minute, func() (bool, error) {
		n := 0
		for _, s := range rcv.Spans() {
			if s.Service == "walrelay" {
				n++
			}
		}
		return n == 9, fmt.Errorf("%d of 9 spans", n)
	})
	ch.waitLedger(time.Minute)

	rcv.Stop()
	ch.writeOrders(40) // 120 events, 7.5 times the queue
	ch.waitLedger(2 * time.Minute)
	if exited, err := relay.exited(); exited {
		t.Fatalf("the relay exited with the collector down: %v", err)
	}
	var dropped float64
	ch.e.waitFor("spans counted as dropped", time.Minute, func() (bool, error) {
		var err error
		dropped, err = scrapeSum(addr, "walrelay_trace_spans_dropped_total")
		return dropped > 0, err
	})
	t.Logf("collector down: %d events in the ledger, %.0f spans dropped", ch.ledgerRows(), dropped)
}

// TestTracingCatchUp: a catch-up of 20,000 events (one transaction, sent
// as fast as the relay goes) with every trace sampled and the export queue
// at its defaults, the spans going over OTLP/gRPC to a receiver that
// keeps up as well as this machine lets it: every span arrives, or the
// spans that did not are counted and said in one WARN with their number
// and the variable that sizes the queue; every event is delivered either
// way.
func TestTracingCatchUp(t *testing.T) {
	rcv, err := otlptest.StartCounting()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rcv.Stop)
	otelEnv(t, rcv.GRPCEndpoint(), tracing.ProtocolGRPC)
	cfg, err := tracing.FromEnv(lookupEnv)
	if err != nil || !cfg.Enabled {
		t.Fatalf("tracing from the environment: %+v, %v", cfg, err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	m := metrics.NewUnregistered()
	p, err := tracing.Start(context.Background(), cfg, tracing.Options{Metrics: m, Log: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Shutdown(context.Background()) })

	e := newEnv(t)
	rc := e.config()
	rc.Router.Tracer = p.Producer()
	e.startRelay(rc)
	c := e.consume()
	const events = 20000
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'o', 'k' || (g % 100), 'T', jsonb_build_object('n', g), g FROM generate_series(1, $1) g`, events)
	c.waitIDs(events, 3*time.Minute)
	if err := p.ForceFlush(e.ctx); err != nil {
		t.Fatal(err)
	}
	full := testutil.ToFloat64(m.TraceSpansDropped.WithLabelValues(metrics.DropQueueFull))
	failed := testutil.ToFloat64(m.TraceSpansDropped.WithLabelValues(metrics.DropExportFailed))
	if got := rcv.Count() + int(full) + int(failed); got != events {
		t.Errorf("%d spans received, %v dropped for a full queue, %v for failed exports: %d accounted for, want %d", rcv.Count(), full, failed, got, events)
	}
	dropWarnings := func() []observer.LoggedEntry { return warnings(logs, "spans are being dropped") }
	if full > 0 {
		e.waitFor("the WARN about the dropped spans", time.Minute, func() (bool, error) { return len(dropWarnings()) > 0, nil })
	}
	switch w := dropWarnings(); {
	case full == 0 && len(w) != 0:
		t.Errorf("no span dropped, yet %d WARNs: %v", len(w), w)
	case full > 0 && len(w) != 1:
		t.Errorf("%v spans dropped: %d WARNs, want 1", full, len(w))
	case full > 0:
		if n, ok := w[0].ContextMap()["dropped"].(int64); !ok || n < 1 || float64(n) > full || !strings.Contains(w[0].Message, "OTEL_BSP_MAX_QUEUE_SIZE") {
			t.Errorf("WARN %q %v: want the spans dropped so far (of %v) and the variable that sizes the queue", w[0].Message, w[0].ContextMap(), full)
		}
	}
	t.Logf("%d events: %d spans received, %v dropped (queue full), %v (export failed)", events, rcv.Count(), full, failed)
}

// lookupEnv is os.Getenv.
var lookupEnv = os.Getenv

// scrapeSum reads a relay's /metrics and sums the series of metric name,
// whatever their labels.
func scrapeSum(addr, name string) (float64, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" ") {
			f := strings.Fields(line)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			if err != nil {
				return 0, fmt.Errorf("%s: %w", line, err)
			}
			sum += v
		}
	}
	return sum, nil
}
