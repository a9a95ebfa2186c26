package tracing

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/test/otlptest"
)

// gatedClient is an OTLP client whose exports wait while it is held, as
// behind a collector that stopped answering, and fail when their context
// ends first; open, they go on to next (a real client), or nowhere when
// next is nil. It counts the spans it exported.
type gatedClient struct {
	next     otlptrace.Client
	mu       sync.Mutex
	gate     chan struct{} // nil: open
	exported atomic.Int64
	calls    atomic.Int64
}

func (c *gatedClient) hold() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gate == nil {
		c.gate = make(chan struct{})
	}
}

func (c *gatedClient) open() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gate != nil {
		close(c.gate)
		c.gate = nil
	}
}

func (c *gatedClient) Start(ctx context.Context) error {
	if c.next == nil {
		return nil
	}
	return c.next.Start(ctx)
}

func (c *gatedClient) Stop(ctx context.Context) error {
	if c.next == nil {
		return nil
	}
	return c.next.Stop(ctx)
}

func (c *gatedClient) UploadTraces(ctx context.Context, rs []*tracepb.ResourceSpans) error {
	c.calls.Add(1)
	c.mu.Lock()
	gate := c.gate
	c.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if c.next != nil {
		if err := c.next.UploadTraces(ctx, rs); err != nil {
			return err
		}
	}
	n := 0
	for _, r := range rs {
		for _, s := range r.ScopeSpans {
			n += len(s.Spans)
		}
	}
	c.exported.Add(int64(n))
	return nil
}

func dropped(m *metrics.Metrics, reason string) float64 {
	return testutil.ToFloat64(m.TraceSpansDropped.WithLabelValues(reason))
}

// endSpans makes and ends n of the relay's producer spans.
func endSpans(p *Provider, n int) {
	pr := p.Producer()
	for i := range n {
		rec := &kgo.Record{Topic: "outbox.event.order", Key: []byte("order-1")}
		pr.Start(rec, router.TraceStart{Commit: time.Now(), ID: []byte(strconv.Itoa(i)), Grow: true})
		pr.End(rec, nil)
	}
}

// TestQueueNeverBlocks: with the collector stuck, ending spans never
// waits: the spans beyond the queue and the batch in export are dropped
// and counted as queue_full; once the collector answers again the queue
// exports what it held, the relay's spans and the SDK's alike, and every
// span is accounted for.
func TestQueueNeverBlocks(t *testing.T) {
	m := metrics.NewUnregistered()
	cl := &gatedClient{}
	cl.hold()
	p, err := Start(context.Background(), Config{Enabled: true, QueueSize: 8, BatchSize: 4, Delay: 10 * time.Millisecond, ExportTimeout: time.Hour},
		Options{Metrics: m, Client: cl, Log: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	const n = 1000
	done := make(chan struct{})
	go func() {
		defer close(done)
		endSpans(p, n)
	}()
	// Ending spans behind a stuck collector must not wait for it; the
	// deadline guards against a hang, it is not a timing assertion.
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("ending spans blocked behind a stuck collector")
	}
	// The queue holds 8; the export stuck holds 0 to 4 (a batch, what the
	// delay found, or nothing yet when the exporter's goroutine had not
	// run by the time every span ended: a busy machine).
	if d := dropped(m, metrics.DropQueueFull); d < n-8-4 || d > n-8 {
		t.Errorf("dropped (queue_full) = %v, want %d to %d of %d spans", d, n-12, n-8, n)
	}
	cl.open()
	_, s := p.TracerProvider().Tracer("test").Start(context.Background(), "after")
	s.End()
	if err := p.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if total := dropped(m, metrics.DropQueueFull) + float64(cl.exported.Load()); total != n+1 {
		t.Errorf("dropped + exported = %v, want every one of the %d spans accounted for", total, n+1)
	}
	if err := p.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestQueueDropStreakWarnsOnce: spans dropped because the export queue is
// full make one WARN per dropping streak, saying how many so far and
// which variable sizes the queue, not one per span; when the drops stop,
// one line gives the streak's total; a later streak warns again. The
// spans go over OTLP/gRPC to a receiver, held for a while as a collector
// that does not keep up.
func TestQueueDropStreakWarnsOnce(t *testing.T) {
	rcv, err := otlptest.StartCounting()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rcv.Stop) // after the provider's shutdown, which exports to it
	m := metrics.NewUnregistered()
	core, logs := observer.New(zapcore.InfoLevel)
	cl := &gatedClient{next: otlptracegrpc.NewClient(otlptracegrpc.WithEndpointURL(rcv.GRPCEndpoint()))}
	cl.hold()
	p, err := Start(context.Background(), Config{Enabled: true, QueueSize: 8, BatchSize: 4, Delay: 10 * time.Millisecond, ExportTimeout: time.Hour},
		Options{Metrics: m, Client: cl, Log: zap.New(core), dropFirst: 20 * time.Millisecond, dropQuiet: 200 * time.Millisecond, dropEvery: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cl.open()
		if err := p.Shutdown(context.Background()); err != nil {
			t.Error(err)
		}
	})
	warnings := func() []observer.LoggedEntry {
		return logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet("dropped").All()
	}
	endSpans(p, 1000)
	if err := devcluster.WaitFor(30*time.Second, 5*time.Millisecond, func() (bool, error) { return len(warnings()) > 0, nil }); err != nil {
		t.Fatalf("no WARN about the dropped spans: %v", err)
	}
	endSpans(p, 1000) // the same streak: no second WARN
	w := warnings()
	if len(w) != 1 {
		t.Fatalf("%d WARNs for one dropping streak, want 1: %v", len(w), w)
	}
	f := w[0].ContextMap()
	if !strings.Contains(w[0].Message, "OTEL_BSP_MAX_QUEUE_SIZE") || f["queue_size"] != int64(8) {
		t.Errorf("WARN %q %v: want it to name OTEL_BSP_MAX_QUEUE_SIZE and the queue's size, 8", w[0].Message, f)
	}
	if n, ok := f["dropped"].(int64); !ok || n < 1 || float64(n) > dropped(m, metrics.DropQueueFull) {
		t.Errorf("WARN says %v spans dropped; the metric %v", f["dropped"], dropped(m, metrics.DropQueueFull))
	}

	cl.open() // the collector keeps up again: the queue empties, drops stop
	var end []observer.LoggedEntry
	if err := devcluster.WaitFor(30*time.Second, 5*time.Millisecond, func() (bool, error) {
		end = logs.FilterMessageSnippet("no longer dropped").All()
		return len(end) > 0, nil
	}); err != nil {
		t.Fatalf("no line when the drops stopped: %v", err)
	}
	if n := end[0].ContextMap()["dropped"]; n != int64(dropped(m, metrics.DropQueueFull)) {
		t.Errorf("the streak's end says %v spans dropped, the metric %v", n, dropped(m, metrics.DropQueueFull))
	}
	if err := p.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := rcv.Count(), 2000-int(dropped(m, metrics.DropQueueFull)); got != want {
		t.Errorf("the receiver has %d spans, want the %d not dropped", got, want)
	}

	// A second streak warns again, once.
	cl.hold()
	endSpans(p, 1000)
	if err := devcluster.WaitFor(30*time.Second, 5*time.Millisecond, func() (bool, error) { return len(warnings()) >= 2, nil }); err != nil {
		t.Fatalf("no WARN for a second streak: %v", err)
	}
	if n := len(warnings()); n != 2 {
		t.Errorf("%d WARNs after two streaks, want 2", n)
	}
}

// TestQueueCountsFailedExports: an export that times out (the client's
// retries included) loses its spans, counted as export_failed, logged
// once; the line when exports work again says how many were lost.
func TestQueueCountsFailedExports(t *testing.T) {
	m := metrics.NewUnregistered()
	core, logs := observer.New(zapcore.InfoLevel)
	cl := &gatedClient{}
	cl.hold()
	p, err := Start(context.Background(), Config{Enabled: true, QueueSize: 8, BatchSize: 2, Delay: time.Hour, ExportTimeout: 20 * time.Millisecond},
		Options{Metrics: m, Client: cl, Log: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = p.Shutdown(context.Background()) }()
	endSpans(p, 4)
	if err := devcluster.WaitFor(time.Minute, 5*time.Millisecond, func() (bool, error) { return dropped(m, metrics.DropExportFailed) == 4, nil }); err != nil {
		t.Fatalf("dropped (export_failed) = %v, want the two batches of 2: %v", dropped(m, metrics.DropExportFailed), err)
	}
	if n := logs.FilterMessageSnippet("trace export failed").Len(); n != 1 {
		t.Errorf("%d lines about the failed exports, want 1", n)
	}
	cl.open()
	endSpans(p, 2)
	if err := devcluster.WaitFor(time.Minute, 5*time.Millisecond, func() (bool, error) { return logs.FilterMessageSnippet("works again").Len() == 1, nil }); err != nil {
		t.Fatal(err)
	}
	if n := logs.FilterMessageSnippet("works again").All()[0].ContextMap()["dropped"]; n != int64(4) {
		t.Errorf("works again after %v spans dropped, want 4", n)
	}
}

// TestQueueShutdownCountsWhatItCannotExport: a Shutdown whose context
// ends while the collector is stuck returns, and counts the spans still
// queued as dropped at shutdown.
func TestQueueShutdownCountsWhatItCannotExport(t *testing.T) {
	m := metrics.NewUnregistered()
	cl := &gatedClient{}
	cl.hold()
	defer cl.open()
	p, err := Start(context.Background(), Config{Enabled: true, QueueSize: 64, BatchSize: 1, Delay: time.Hour, ExportTimeout: time.Hour},
		Options{Metrics: m, Client: cl})
	if err != nil {
		t.Fatal(err)
	}
	endSpans(p, 10)
	if err := devcluster.WaitFor(time.Minute, 5*time.Millisecond, func() (bool, error) { return cl.calls.Load() > 0, nil }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := p.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown = %v, want the deadline", err)
	}
	if d := dropped(m, metrics.DropShutdown); d != 9 {
		t.Errorf("dropped (shutdown) = %v, want the 9 spans behind the stuck export", d)
	}
}

// TestStartExportsOverOTLP: the OTLP clients, gRPC and HTTP, configured
// by the standard variables, reach a receiver with the resource, the
// relay's spans and the SDK's.
func TestStartExportsOverOTLP(t *testing.T) {
	r, err := otlptest.Start()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Stop()
	for _, tc := range []struct{ protocol, endpoint string }{{ProtocolGRPC, r.GRPCEndpoint()}, {ProtocolHTTP, r.HTTPEndpoint()}} {
		t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", tc.endpoint)
		t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tc.protocol)
		t.Setenv("OTEL_SERVICE_NAME", "relay-"+tc.protocol)
		cfg, err := FromEnv(getenv)
		if err != nil || !cfg.Enabled {
			t.Fatalf("FromEnv: %+v, %v", cfg, err)
		}
		p, err := Start(context.Background(), cfg, Options{})
		if err != nil {
			t.Fatal(err)
		}
		_, s := p.TracerProvider().Tracer("test").Start(context.Background(), "over "+tc.protocol)
		s.End()
		rec := &kgo.Record{Topic: tc.protocol}
		p.Producer().Start(rec, router.TraceStart{Commit: time.Now(), ID: []byte("e1"), Grow: true})
		p.Producer().End(rec, nil)
		if err := p.Shutdown(context.Background()); err != nil {
			t.Fatalf("%s: shutdown: %v", tc.protocol, err)
		}
	}
	got := map[string]string{}
	for _, s := range r.Spans() {
		got[s.Name] = s.Service
	}
	for _, p := range []string{ProtocolGRPC, ProtocolHTTP} {
		if got["over "+p] != "relay-"+p || got["send "+p] != "relay-"+p {
			t.Errorf("received %v, want an SDK span and a producer span over %s with its service name", got, p)
		}
	}
}
