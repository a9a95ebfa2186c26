package tracing

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
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
	// Client replaces the OTLP client (tests); nil: OTLP over
	// Config.Protocol, configured by the OTEL_EXPORTER_OTLP_* variables.
	Client otlptrace.Client

	// dropFirst, dropQuiet, dropEvery: tests shorten the report of a
	// dropping streak (queue.go); zero: the defaults.
	dropFirst, dropQuiet, dropEvery time.Duration
}

// Provider is walrelay's tracing: the relay's Producer, the OpenTelemetry
// SDK's TracerProvider (for other spans of the process), the export
// queue they share and the OTLP client.
type Provider struct {
	tp       *sdktrace.TracerProvider
	producer *Producer
	res      *resource.Resource
}

// Start builds the tracing of cfg (which must be Enabled; fields left
// zero take FromEnv's defaults): the resource, the sampler, the OTLP
// client behind the bounded queue. Nothing is
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
	client := o.Client
	if client == nil {
		switch cfg.Protocol {
		case ProtocolGRPC:
			client = otlptracegrpc.NewClient()
		default:
			// Protobuf whatever OTEL_EXPORTER_OTLP_PROTOCOL says: the
			// relay's spans are encoded for it (encode.go).
			client = otlptracehttp.NewClient(otlptracehttp.WithEncoding(otlptracehttp.EncodingProtobuf))
		}
	}
	// Nothing is connected yet (a gRPC client connects on its first
	// export).
	if err := client.Start(ctx); err != nil {
		return nil, fmt.Errorf("tracing: OTLP client (%s; OTEL_EXPORTER_OTLP_*): %w", cfg.Protocol, err)
	}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { log.Warn("OpenTelemetry", zap.Error(err)) }))
	limit := sdktrace.NewSpanLimits().AttributeValueLengthLimit
	q := newQueue(client, newRequest(res, limit), cfg, o.Metrics, log, o)
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithResource(res),
		sdktrace.WithSampler(cfg.Sampler),
		sdktrace.WithSpanProcessor(q),
	)
	return &Provider{tp: tp, producer: &Producer{sampler: cfg.Sampler, q: q, limit: limit}, res: res}, nil
}

// TracerProvider is the SDK's provider.
func (p *Provider) TracerProvider() trace.TracerProvider { return p.tp }

// Producer is the router's Tracer: the relay's producer spans, sampled
// and exported as this provider's.
func (p *Provider) Producer() *Producer { return p.producer }

// ForceFlush exports the spans ended so far, within ctx.
func (p *Provider) ForceFlush(ctx context.Context) error { return p.tp.ForceFlush(ctx) }

// Shutdown exports what is queued within ctx and stops; spans it could
// not export are counted as dropped (shutdown).
func (p *Provider) Shutdown(ctx context.Context) error { return p.tp.Shutdown(ctx) }
