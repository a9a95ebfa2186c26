package tracing

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/metrics"
)

// Options are what Start needs besides the configuration.
type Options struct {
	// ServiceName and ServiceVersion describe the process in the
	// resource (OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win).
	// Default service name "walrelay".
	ServiceName, ServiceVersion string
	// Metrics receives the dropped spans (walrelay_trace_spans_dropped_total).
	Metrics *metrics.Metrics
	// Log receives export failures (once until exports work again) and
	// the OpenTelemetry SDK's errors. Default none.
	Log *zap.Logger
	// Exporter replaces the OTLP exporter (tests); nil: OTLP over
	// Config.Protocol.
	Exporter sdktrace.SpanExporter
}

// Provider is the OpenTelemetry SDK walrelay traces with: its
// TracerProvider, the export queue and the OTLP exporter.
type Provider struct {
	tp *sdktrace.TracerProvider
}

// Start builds the SDK of cfg (which must be Enabled; fields left zero
// take FromEnv's defaults): the resource, the
// sampler, the OTLP exporter behind the bounded queue. Nothing is
// connected yet: a collector that is down costs spans later, not a
// failed start. It sets the OpenTelemetry error handler to log to
// o.Log. Call Shutdown at exit.
func Start(ctx context.Context, cfg Config, o Options) (*Provider, error) {
	if !cfg.Enabled {
		return nil, errors.New("tracing: Start with tracing off (Config.Enabled false)")
	}
	def, _ := FromEnv(func(string) string { return "" })
	if cfg.Sampler == nil {
		cfg.Sampler = sdktrace.ParentBased(sdktrace.AlwaysSample())
	}
	if cfg.QueueSize <= 0 {
		cfg.QueueSize = def.QueueSize
	}
	if cfg.BatchSize <= 0 || cfg.BatchSize > cfg.QueueSize {
		cfg.BatchSize = min(def.BatchSize, cfg.QueueSize)
	}
	if cfg.Delay <= 0 {
		cfg.Delay = def.Delay
	}
	if cfg.ExportTimeout <= 0 {
		cfg.ExportTimeout = def.ExportTimeout
	}
	log := o.Log
	if log == nil {
		log = zap.NewNop()
	}
	name := o.ServiceName
	if name == "" {
		name = "walrelay"
	}
	attrs := []attribute.KeyValue{attribute.String("service.name", name)}
	if o.ServiceVersion != "" {
		attrs = append(attrs, attribute.String("service.version", o.ServiceVersion))
	}
	// Later detectors win: the variables over walrelay's own name.
	res, err := resource.New(ctx, resource.WithAttributes(attrs...), resource.WithTelemetrySDK(), resource.WithHost(), resource.WithFromEnv())
	if err != nil {
		return nil, fmt.Errorf("tracing: the resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME): %w", err)
	}
	exp := o.Exporter
	if exp == nil {
		switch cfg.Protocol {
		case ProtocolGRPC:
			exp, err = otlptracegrpc.New(ctx)
		default:
			exp, err = otlptracehttp.New(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("tracing: OTLP exporter (%s; OTEL_EXPORTER_OTLP_*): %w", cfg.Protocol, err)
		}
	}
	dropped := func(string, int) {}
	if o.Metrics != nil {
		dropped = func(reason string, n int) { o.Metrics.TraceSpansDropped.WithLabelValues(reason).Add(float64(n)) }
	}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { log.Warn("OpenTelemetry", zap.Error(err)) }))
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithResource(res),
		sdktrace.WithSampler(cfg.Sampler),
		sdktrace.WithSpanProcessor(newQueue(exp, cfg, dropped, log)),
	)
	return &Provider{tp: tp}, nil
}

// TracerProvider is the SDK's provider.
func (p *Provider) TracerProvider() trace.TracerProvider { return p.tp }

// Producer is the router's Tracer of this provider's spans.
func (p *Provider) Producer() *Producer { return NewProducer(p.tp) }

// ForceFlush exports the spans ended so far, within ctx.
func (p *Provider) ForceFlush(ctx context.Context) error { return p.tp.ForceFlush(ctx) }

// Shutdown exports what is queued within ctx and stops; spans it could
// not export are counted as dropped (shutdown).
func (p *Provider) Shutdown(ctx context.Context) error { return p.tp.Shutdown(ctx) }
