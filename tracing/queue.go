package tracing

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/metrics"
)

// queue is the export queue between the spans and the OTLP client: a
// bounded buffer that adding to never waits on (a full queue drops the
// span and counts it), and one goroutine that exports it in batches, a
// batch as soon as one is full, what waits every Delay. It takes the
// relay's producer spans (Producer, encoded by encode.go) and, as the
// SDK's span processor, the spans of the Provider's TracerProvider
// (exported by OpenTelemetry's exporter over the same client). The SDK's
// own batch span processor drops as well when full, but counts its drops
// nowhere walrelay can export them, and wakes its goroutine for every
// span; this one counts every span it loses, by reason, says so in the
// log once per streak of drops, and wakes its goroutine once per batch.
type queue struct {
	client  otlptrace.Client
	sdk     sdktrace.SpanExporter // OpenTelemetry's exporter over client, for SDK spans
	req     request               // the relay spans' export request, reused
	size    int
	batch   int
	delay   time.Duration
	timeout time.Duration
	log     *zap.Logger

	// The drops: the metric's series, and the spans dropped for a full
	// queue so far, which a streak's report reads.
	full, failed, shut prometheus.Counter
	fullN              atomic.Int64
	streak             atomic.Bool // a streak of queue_full drops is being reported
	dropFirst          time.Duration
	dropQuiet          time.Duration
	dropEvery          time.Duration

	mu    sync.Mutex
	wait  []entry       // waiting for export, at most size
	ready chan struct{} // a full batch waits

	out         []entry // the batch being exported (run's)
	failing     bool    // the last export failed (logged once until one succeeds)
	failedSince time.Time
	failedN     int // spans lost to failed exports since failedSince

	flush    chan chan struct{}
	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once
}

// entry is a span waiting for export: the relay's, or an SDK span.
type entry struct {
	relay *span
	sdk   sdktrace.ReadOnlySpan
}

// How a streak of queue_full drops is reported: one WARN when the first
// drop is dropFirst old (with the count so far), another each dropEvery
// while it lasts, and one line with its total once no span was dropped
// for dropQuiet.
const (
	dropFirst = time.Second
	dropQuiet = 10 * time.Second
	dropEvery = time.Minute
)

func newQueue(client otlptrace.Client, req request, cfg Config, m *metrics.Metrics, log *zap.Logger, o Options) *queue {
	q := &queue{
		client: client, sdk: otlptrace.NewUnstarted(client), req: req,
		size: cfg.QueueSize, batch: cfg.BatchSize, delay: cfg.Delay, timeout: cfg.ExportTimeout, log: log,
		full: nopCounter{}, failed: nopCounter{}, shut: nopCounter{},
		dropFirst: cmpOr(o.dropFirst, dropFirst), dropQuiet: cmpOr(o.dropQuiet, dropQuiet), dropEvery: cmpOr(o.dropEvery, dropEvery),
		wait: make([]entry, 0, min(cfg.QueueSize, 4096)), ready: make(chan struct{}, 1),
		flush: make(chan chan struct{}), stop: make(chan struct{}), done: make(chan struct{}),
	}
	if m != nil {
		q.full = m.TraceSpansDropped.WithLabelValues(metrics.DropQueueFull)
		q.failed = m.TraceSpansDropped.WithLabelValues(metrics.DropExportFailed)
		q.shut = m.TraceSpansDropped.WithLabelValues(metrics.DropShutdown)
	}
	go q.run()
	return q
}

func cmpOr(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}

// nopCounter stands for the metric's series without metrics.
type nopCounter struct{ prometheus.Counter }

func (nopCounter) Inc()        {}
func (nopCounter) Add(float64) {}

// add queues e for export, or drops it when the queue is full; it never
// waits.
func (q *queue) add(e entry) {
	q.mu.Lock()
	if len(q.wait) >= q.size {
		q.mu.Unlock()
		q.dropFull()
		return
	}
	q.wait = append(q.wait, e)
	full := len(q.wait) >= q.batch
	q.mu.Unlock()
	if full {
		select {
		case q.ready <- struct{}{}:
		default:
		}
	}
}

// dropFull counts a span dropped for a full queue, and begins the report
// of a streak of drops if none is under way.
func (q *queue) dropFull() {
	q.full.Inc()
	n := q.fullN.Add(1)
	if q.streak.CompareAndSwap(false, true) {
		go q.reportStreak(n - 1)
	}
}

// reportStreak logs a streak of queue_full drops, from the count before
// it began: one WARN once its first drop is dropFirst old, with the
// count so far, the queue's size and the variable that sets it; one each
// dropEvery while it lasts; and its total once no span was dropped for
// dropQuiet (or walrelay stops).
func (q *queue) reportStreak(before int64) {
	start := time.Now()
	tick := time.NewTicker(min(q.dropFirst, q.dropQuiet) / 2)
	defer tick.Stop()
	last, lastAt := q.fullN.Load(), start
	warned, reportedAt, reported := false, start, before
	warn := func(now time.Time, n int64) {
		if !warned {
			q.log.Warn("trace spans are being dropped: the export queue is full (OTEL_BSP_MAX_QUEUE_SIZE): the collector, or the export to it, does not keep up; events are not affected. "+
				"If the collector is healthy, raise OTEL_BSP_MAX_QUEUE_SIZE (or OTEL_BSP_MAX_EXPORT_BATCH_SIZE), or sample fewer traces (OTEL_TRACES_SAMPLER_ARG); counted in walrelay_trace_spans_dropped_total{reason=\"queue_full\"}",
				zap.Int64("dropped", n-before), zap.Int("queue_size", q.size), zap.Int("batch_size", q.batch))
		} else {
			q.log.Warn("trace spans are still being dropped: the export queue is full (OTEL_BSP_MAX_QUEUE_SIZE)",
				zap.Int64("dropped", n-reported), zap.Duration("in", now.Sub(reportedAt).Round(time.Second)), zap.Int64("total", n-before), zap.Int("queue_size", q.size))
		}
		warned, reportedAt, reported = true, now, n
	}
	for {
		select {
		case <-tick.C:
		case <-q.done:
			n := q.fullN.Load()
			if !warned {
				warn(time.Now(), n)
			}
			q.log.Info("trace spans were being dropped until walrelay stopped: the export queue was full (OTEL_BSP_MAX_QUEUE_SIZE)",
				zap.Int64("dropped", n-before), zap.Duration("for", time.Since(start).Round(time.Millisecond)))
			return
		}
		now, n := time.Now(), q.fullN.Load()
		if n != last {
			last, lastAt = n, now
		}
		switch {
		case now.Sub(lastAt) >= q.dropQuiet:
			q.streak.Store(false)
			n = q.fullN.Load() // a drop since counts here, and begins the next streak
			if !warned {
				warn(now, n)
			}
			q.log.Info("trace spans are no longer dropped: the export queue has room again",
				zap.Int64("dropped", n-before), zap.Duration("for", lastAt.Sub(start).Round(time.Millisecond)))
			return
		case !warned && now.Sub(start) >= q.dropFirst, warned && now.Sub(reportedAt) >= q.dropEvery:
			warn(now, n)
		}
	}
}

// OnStart implements sdktrace.SpanProcessor.
func (q *queue) OnStart(context.Context, sdktrace.ReadWriteSpan) {}

// OnEnd implements sdktrace.SpanProcessor: it never blocks.
func (q *queue) OnEnd(s sdktrace.ReadOnlySpan) {
	if s.SpanContext().IsSampled() {
		q.add(entry{sdk: s})
	}
}

// run exports what the queue holds: a batch as soon as one is full, what
// waits every Delay, until Shutdown.
func (q *queue) run() {
	defer close(q.done)
	tick := time.NewTicker(q.delay)
	defer tick.Stop()
	for {
		all := false
		select {
		case <-q.ready:
		case <-tick.C:
			all = true
		case reply := <-q.flush:
			q.exportWaiting(context.Background(), true)
			close(reply)
			continue
		case <-q.stop:
			return
		}
		q.exportWaiting(context.Background(), all)
	}
}

// exportWaiting exports the full batches waiting and, when all, the rest;
// it returns early when the queue stops.
func (q *queue) exportWaiting(ctx context.Context, all bool) {
	for {
		select {
		case <-q.stop:
			return
		default:
		}
		batch := q.take(all)
		if len(batch) == 0 {
			return
		}
		q.export(ctx, batch)
		if len(batch) < q.batch {
			return // that was the rest
		}
	}
}

// take removes the oldest batch from the queue: a full one, else (when
// all) what waits; nil when none.
func (q *queue) take(all bool) []entry {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := len(q.wait)
	if n == 0 || n < q.batch && !all {
		return nil
	}
	k := min(n, q.batch)
	q.out = append(q.out[:0], q.wait[:k]...)
	copy(q.wait, q.wait[k:])
	clear(q.wait[n-k:])
	q.wait = q.wait[:n-k]
	return q.out
}

// export sends batch, the relay's spans in one request and any SDK spans
// in another, each bounded by ExportTimeout (and ctx). Spans of a failed
// export are dropped, counted: the queue goes on with the next ones
// rather than retry behind a dead collector (the client retries within
// the timeout).
func (q *queue) export(ctx context.Context, batch []entry) {
	var sdk []sdktrace.ReadOnlySpan
	relay := q.req.spans[:0]
	for _, e := range batch {
		if e.relay != nil {
			relay = append(relay, e.relay)
		} else {
			sdk = append(sdk, e.sdk)
		}
	}
	q.req.spans = relay
	if len(relay) > 0 {
		ctx, cancel := context.WithTimeout(ctx, q.timeout)
		q.exported(len(relay), q.client.UploadTraces(ctx, q.req.encode(relay)))
		cancel()
		q.req.release()
	}
	if len(sdk) > 0 {
		ctx, cancel := context.WithTimeout(ctx, q.timeout)
		q.exported(len(sdk), q.sdk.ExportSpans(ctx, sdk))
		cancel()
	}
	clear(batch)
}

// exported accounts for an export of n spans that ended with err: a
// failure drops them, logged once until an export succeeds again.
func (q *queue) exported(n int, err error) {
	switch {
	case err != nil:
		q.failed.Add(float64(n))
		if !q.failing {
			q.failing, q.failedSince, q.failedN = true, time.Now(), 0
			q.log.Warn("trace export failed: spans are dropped, counted in walrelay_trace_spans_dropped_total{reason=\"export_failed\"}, until the collector answers (events are not affected); check the collector and OTEL_EXPORTER_OTLP_ENDPOINT",
				zap.Int("spans", n), zap.Error(err))
		}
		q.failedN += n
	case q.failing:
		q.failing = false
		q.log.Info("trace export works again", zap.Int("dropped", q.failedN), zap.Duration("after", time.Since(q.failedSince).Round(time.Millisecond)))
	}
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
// within ctx, counts what it could not as dropped at shutdown, and stops
// the client.
func (q *queue) Shutdown(ctx context.Context) error {
	q.stopOnce.Do(func() { close(q.stop) })
	select {
	case <-q.done:
	case <-ctx.Done():
		// run is stuck in an export, which counts its batch should it
		// fail; what waits behind it is lost.
		q.mu.Lock()
		q.shut.Add(float64(len(q.wait)))
		q.wait = q.wait[:0]
		q.mu.Unlock()
		return ctx.Err()
	}
	for ctx.Err() == nil {
		batch := q.take(true)
		if len(batch) == 0 {
			break
		}
		q.export(ctx, batch)
	}
	q.mu.Lock()
	q.shut.Add(float64(len(q.wait)))
	q.wait = q.wait[:0]
	q.mu.Unlock()
	return q.client.Stop(ctx)
}
