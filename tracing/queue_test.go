package tracing

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/test/otlptest"
)

// stuckExporter blocks every export until released or its context ends,
// as a collector that stopped answering; then it fails.
type stuckExporter struct {
	release  chan struct{}
	exported atomic.Int64
	calls    atomic.Int64
}

func (e *stuckExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.calls.Add(1)
	select {
	case <-e.release:
		e.exported.Add(int64(len(spans)))
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
func (e *stuckExporter) Shutdown(context.Context) error { return nil }

func dropped(m *metrics.Metrics, reason string) float64 {
	return testutil.ToFloat64(m.TraceSpansDropped.WithLabelValues(reason))
}

// TestQueueNeverBlocks: with the exporter stuck, ending spans never waits:
// the spans beyond the queue and the batch in export are dropped and
// counted as queue_full; once the exporter answers again the queue
// exports what it held, and every span is accounted for.
func TestQueueNeverBlocks(t *testing.T) {
	m := metrics.NewUnregistered()
	exp := &stuckExporter{release: make(chan struct{})}
	p, err := Start(context.Background(), Config{Enabled: true, QueueSize: 8, BatchSize: 4, Delay: 10 * time.Millisecond, ExportTimeout: time.Hour},
		Options{Metrics: m, Exporter: exp, Log: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	tr := p.TracerProvider().Tracer("test")
	const n = 1000
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range n {
			_, s := tr.Start(context.Background(), "s")
			s.End()
		}
	}()
	// Ending spans behind a stuck exporter must not wait for it; the
	// deadline guards against a hang, it is not a timing assertion.
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("ending spans blocked behind a stuck exporter")
	}
	// The queue holds 8; the export stuck holds 0 to 4 (a batch, what the
	// delay found, or nothing yet when the exporter's goroutine had not
	// run by the time every span ended: a busy machine).
	if d := dropped(m, metrics.DropQueueFull); d < n-8-4 || d > n-8 {
		t.Errorf("dropped (queue_full) = %v, want %d to %d of %d spans", d, n-12, n-8, n)
	}
	close(exp.release)
	_, s := tr.Start(context.Background(), "after")
	s.End()
	if err := p.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if total := dropped(m, metrics.DropQueueFull) + float64(exp.exported.Load()); total != n+1 {
		t.Errorf("dropped + exported = %v, want every one of the %d spans accounted for", total, n+1)
	}
	if err := p.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestQueueCountsFailedExports: an export that times out (the exporter's
// retries included) loses its spans, counted as export_failed.
func TestQueueCountsFailedExports(t *testing.T) {
	m := metrics.NewUnregistered()
	exp := &stuckExporter{release: make(chan struct{})}
	defer close(exp.release)
	p, err := Start(context.Background(), Config{Enabled: true, QueueSize: 8, BatchSize: 2, Delay: time.Hour, ExportTimeout: 20 * time.Millisecond},
		Options{Metrics: m, Exporter: exp, Log: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	tr := p.TracerProvider().Tracer("test")
	for range 2 {
		_, s := tr.Start(context.Background(), "s")
		s.End()
	}
	if err := devcluster.WaitFor(time.Minute, 5*time.Millisecond, func() (bool, error) { return dropped(m, metrics.DropExportFailed) == 2, nil }); err != nil {
		t.Fatalf("dropped (export_failed) = %v, want the batch of 2: %v", dropped(m, metrics.DropExportFailed), err)
	}
}

// TestQueueShutdownCountsWhatItCannotExport: a Shutdown whose context
// ends while the exporter is stuck returns, and counts the spans still
// queued as dropped at shutdown.
func TestQueueShutdownCountsWhatItCannotExport(t *testing.T) {
	m := metrics.NewUnregistered()
	exp := &stuckExporter{release: make(chan struct{})}
	p, err := Start(context.Background(), Config{Enabled: true, QueueSize: 64, BatchSize: 1, Delay: time.Hour, ExportTimeout: time.Hour},
		Options{Metrics: m, Exporter: exp})
	if err != nil {
		t.Fatal(err)
	}
	tr := p.TracerProvider().Tracer("test")
	for range 10 {
		_, s := tr.Start(context.Background(), "s")
		s.End()
	}
	if err := devcluster.WaitFor(time.Minute, 5*time.Millisecond, func() (bool, error) { return exp.calls.Load() > 0, nil }); err != nil {
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
	close(exp.release)
}

// TestStartExportsOverOTLP: the OTLP exporters, gRPC and HTTP, configured
// by the standard variables, reach a receiver with the resource.
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
		if err := p.Shutdown(context.Background()); err != nil {
			t.Fatalf("%s: shutdown: %v", tc.protocol, err)
		}
	}
	got := map[string]string{}
	for _, s := range r.Spans() {
		got[s.Name] = s.Service
	}
	if got["over grpc"] != "relay-grpc" || got["over http/protobuf"] != "relay-http/protobuf" {
		t.Errorf("received %v, want a span over each protocol with its service name", got)
	}
}
