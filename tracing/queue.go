package tracing

import (
	"context"
	"sync"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/metrics"
)

// queue is the span processor between the SDK and the OTLP exporter: a
// bounded channel that OnEnd never waits on (a full queue drops the span
// and counts it), and one goroutine that exports it in batches. The SDK's
// own batch span processor drops as well when full, but counts its drops
// nowhere walrelay can export them; this one counts every span it loses,
// by reason.
type queue struct {
	exp     sdktrace.SpanExporter
	spans   chan sdktrace.ReadOnlySpan
	batch   int
	delay   time.Duration
	timeout time.Duration
	dropped func(reason string, n int)
	log     *zap.Logger

	flush    chan chan struct{}
	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once
	failing  bool                    // the last export failed (logged once until one succeeds)
	pending  []sdktrace.ReadOnlySpan // the batch run was filling when stopped
}

func newQueue(exp sdktrace.SpanExporter, cfg Config, dropped func(string, int), log *zap.Logger) *queue {
	q := &queue{
		exp: exp, spans: make(chan sdktrace.ReadOnlySpan, cfg.QueueSize), batch: cfg.BatchSize,
		delay: cfg.Delay, timeout: cfg.ExportTimeout, dropped: dropped, log: log,
		flush: make(chan chan struct{}), stop: make(chan struct{}), done: make(chan struct{}),
	}
	go q.run()
	return q
}

// OnStart implements sdktrace.SpanProcessor.
func (q *queue) OnStart(context.Context, sdktrace.ReadWriteSpan) {}

// OnEnd implements sdktrace.SpanProcessor: it never blocks.
func (q *queue) OnEnd(s sdktrace.ReadOnlySpan) {
	if !s.SpanContext().IsSampled() {
		return
	}
	select {
	case q.spans <- s:
	default:
		q.dropped(metrics.DropQueueFull, 1)
	}
}

// run exports what the queue holds, a batch when one is full or the
// oldest span waited Delay, until Shutdown.
func (q *queue) run() {
	defer close(q.done)
	buf := make([]sdktrace.ReadOnlySpan, 0, q.batch)
	tick := time.NewTicker(q.delay)
	defer tick.Stop()
	for {
		select {
		case s := <-q.spans:
			if buf = append(buf, s); len(buf) >= q.batch {
				buf = q.export(context.Background(), buf)
			}
		case <-tick.C:
			buf = q.export(context.Background(), buf)
		case reply := <-q.flush:
			buf = q.drain(context.Background(), buf)
			close(reply)
		case <-q.stop:
			q.pending = buf
			return
		}
	}
}

// drain exports buf and everything queued now, in batches.
func (q *queue) drain(ctx context.Context, buf []sdktrace.ReadOnlySpan) []sdktrace.ReadOnlySpan {
	for {
		select {
		case s := <-q.spans:
			if buf = append(buf, s); len(buf) >= q.batch {
				buf = q.export(ctx, buf)
			}
		default:
			return q.export(ctx, buf)
		}
	}
}

// export sends buf in one export, bounded by ExportTimeout (and ctx),
// and returns it emptied. Spans of a failed export are dropped, counted:
// the queue goes on with the next ones rather than retry behind a dead
// collector (the exporter retries within the timeout).
func (q *queue) export(ctx context.Context, buf []sdktrace.ReadOnlySpan) []sdktrace.ReadOnlySpan {
	if len(buf) == 0 {
		return buf
	}
	ctx, cancel := context.WithTimeout(ctx, q.timeout)
	err := q.exp.ExportSpans(ctx, buf)
	cancel()
	switch {
	case err != nil:
		q.dropped(metrics.DropExportFailed, len(buf))
		if !q.failing {
			q.failing = true
			q.log.Warn("trace export failed: spans are dropped, counted in walrelay_trace_spans_dropped_total, until the collector answers (events are not affected)",
				zap.Int("spans", len(buf)), zap.Error(err))
		}
	case q.failing:
		q.failing = false
		q.log.Info("trace export works again")
	}
	clear(buf)
	return buf[:0]
}

// ForceFlush implements sdktrace.SpanProcessor: it exports what is queued
// now, or gives up when ctx ends.
func (q *queue) ForceFlush(ctx context.Context) error {
	reply := make(chan struct{})
	select {
	case q.flush <- reply:
	case <-q.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-reply:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Shutdown implements sdktrace.SpanProcessor: it exports what is queued,
// within ctx, counts what it could not as dropped at shutdown, and shuts
// the exporter down.
func (q *queue) Shutdown(ctx context.Context) error {
	q.stopOnce.Do(func() { close(q.stop) })
	select {
	case <-q.done:
	case <-ctx.Done():
		// run is stuck in an export, which counts its batch should it
		// fail; what waits behind it is lost.
		q.dropped(metrics.DropShutdown, len(q.spans))
		return ctx.Err()
	}
	left := q.pending
	for more := true; more; {
		select {
		case s := <-q.spans:
			left = append(left, s)
		default:
			more = false
		}
	}
	for len(left) > 0 && ctx.Err() == nil {
		n := min(len(left), q.batch)
		q.export(ctx, left[:n])
		left = left[n:]
	}
	if len(left) > 0 {
		q.dropped(metrics.DropShutdown, len(left))
	}
	return q.exp.Shutdown(ctx)
}
