package main

import (
	"context"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/tracing"
)

// tracingShutdown bounds the export of the last spans at exit: a
// collector that is down must not hold walrelay's stop.
const tracingShutdown = 5 * time.Second

// startTracing turns on the OpenTelemetry tracing the OTEL_* variables
// ask for (package tracing), and returns the router's Tracer and what
// stops it at exit. Off, the default, it returns no Tracer: the router
// then does no tracing work.
func startTracing(ctx context.Context, m *metrics.Metrics, log *zap.Logger) (router.Tracer, func(), error) {
	cfg, err := tracing.FromEnv(os.Getenv)
	if err != nil || !cfg.Enabled {
		return nil, func() {}, err
	}
	p, err := tracing.Start(ctx, cfg, tracing.Options{ServiceVersion: version, Metrics: m, Log: log})
	if err != nil {
		return nil, func() {}, err
	}
	log.Info("tracing on: a span per event, exported over OTLP", zap.String("protocol", cfg.Protocol),
		zap.String("sampler", cfg.Sampler.Description()), zap.Int("queue", cfg.QueueSize), zap.Int("batch", cfg.BatchSize))
	stop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), tracingShutdown)
		defer cancel()
		if err := p.Shutdown(ctx); err != nil {
			log.Warn("tracing: the last spans were not all exported (counted in walrelay_trace_spans_dropped_total)", zap.Error(err))
		}
	}
	return p.Producer(), stop, nil
}
