package tracing

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Protocols of the OTLP exporter (OTEL_EXPORTER_OTLP_PROTOCOL).
const (
	ProtocolGRPC = "grpc"
	ProtocolHTTP = "http/protobuf"
)

// Config is the tracing configuration, as FromEnv reads it from the
// OpenTelemetry environment variables.
type Config struct {
	// Enabled turns tracing on. Off by default.
	Enabled bool
	// Protocol is the OTLP transport: ProtocolGRPC or ProtocolHTTP (the
	// default, as OpenTelemetry specifies). Endpoint, headers, TLS,
	// compression and timeout are the exporter's own OTEL_EXPORTER_OTLP_*
	// variables, which it reads itself.
	Protocol string
	// Sampler decides which traces are recorded (default: the parent's
	// decision, and every trace the relay starts).
	Sampler sdktrace.Sampler
	// QueueSize bounds the spans waiting for export: more are dropped,
	// counted, never waited for (default DefaultQueueSize). BatchSize is
	// the most one export sends (default DefaultBatchSize); Delay the
	// longest a span waits for a batch to fill (default 5s);
	// ExportTimeout bounds one export, retries included (default 30s).
	QueueSize, BatchSize int
	Delay, ExportTimeout time.Duration
}

// The export queue's defaults (OTEL_BSP_MAX_QUEUE_SIZE,
// OTEL_BSP_MAX_EXPORT_BATCH_SIZE), larger than OpenTelemetry's 2048 and
// 512: the relay makes a span per event, and in a catch-up at 20,000 to
// 100,000 events a second OpenTelemetry's queue holds 20 to 100 ms of
// them, less than a collector's pause; this one holds a fraction of a
// second to a second, about 5 MB of spans when full, and a batch of
// 1024 spans is about half a megabyte on the wire.
const (
	DefaultQueueSize = 16384
	DefaultBatchSize = 1024
)

// FromEnv reads the configuration from the OpenTelemetry environment
// variables (getenv is os.Getenv). Tracing is on when OTEL_TRACES_EXPORTER
// is otlp, or when it is unset and an OTLP endpoint is set
// (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); off
// when OTEL_SDK_DISABLED is true or OTEL_TRACES_EXPORTER is none. It reads
// OTEL_EXPORTER_OTLP_PROTOCOL (and its _TRACES_ form), OTEL_TRACES_SAMPLER
// and _ARG, and the batch span processor's OTEL_BSP_* variables. A value
// walrelay cannot use is an error naming the variable and what it takes.
func FromEnv(getenv func(string) string) (Config, error) {
	cfg := Config{Protocol: ProtocolHTTP, QueueSize: DefaultQueueSize, BatchSize: DefaultBatchSize, Delay: 5 * time.Second, ExportTimeout: 30 * time.Second}
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return cfg, nil
	}
	switch exp := strings.ToLower(strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER"))); exp {
	case "otlp":
		cfg.Enabled = true
	case "none":
		return cfg, nil
	case "":
		cfg.Enabled = getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
	default:
		return cfg, fmt.Errorf("OTEL_TRACES_EXPORTER=%q: walrelay exports traces over OTLP only: set it to otlp (or none to turn tracing off)", exp)
	}
	if !cfg.Enabled {
		return cfg, nil
	}
	name := "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	p := strings.TrimSpace(getenv(name))
	if p == "" {
		name = "OTEL_EXPORTER_OTLP_PROTOCOL"
		p = strings.TrimSpace(getenv(name))
	}
	switch p {
	case "":
	case ProtocolGRPC, ProtocolHTTP:
		cfg.Protocol = p
	default:
		return cfg, fmt.Errorf("%s=%q: use grpc or http/protobuf (walrelay sends its spans as protobuf, not http/json)", name, p)
	}
	var err error
	if cfg.Sampler, err = samplerFromEnv(getenv); err != nil {
		return cfg, err
	}
	ints := []struct {
		name string
		dst  *int
	}{{"OTEL_BSP_MAX_QUEUE_SIZE", &cfg.QueueSize}, {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE", &cfg.BatchSize}}
	for _, v := range ints {
		if s := strings.TrimSpace(getenv(v.name)); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n <= 0 {
				return cfg, fmt.Errorf("%s=%q: want a positive number of spans", v.name, s)
			}
			*v.dst = n
		}
	}
	cfg.BatchSize = min(cfg.BatchSize, cfg.QueueSize)
	durations := []struct {
		name string
		dst  *time.Duration
	}{{"OTEL_BSP_SCHEDULE_DELAY", &cfg.Delay}, {"OTEL_BSP_EXPORT_TIMEOUT", &cfg.ExportTimeout}}
	for _, v := range durations {
		if s := strings.TrimSpace(getenv(v.name)); s != "" {
			ms, err := strconv.Atoi(s)
			if err != nil || ms <= 0 {
				return cfg, fmt.Errorf("%s=%q: want a positive number of milliseconds", v.name, s)
			}
			*v.dst = time.Duration(ms) * time.Millisecond
		}
	}
	return cfg, nil
}

// samplerFromEnv is the sampler OTEL_TRACES_SAMPLER and
// OTEL_TRACES_SAMPLER_ARG name; parentbased_always_on when unset.
func samplerFromEnv(getenv func(string) string) (sdktrace.Sampler, error) {
	name := strings.ToLower(strings.TrimSpace(getenv("OTEL_TRACES_SAMPLER")))
	arg := strings.TrimSpace(getenv("OTEL_TRACES_SAMPLER_ARG"))
	ratio := func() (sdktrace.Sampler, error) {
		if arg == "" {
			return sdktrace.TraceIDRatioBased(1), nil
		}
		r, err := strconv.ParseFloat(arg, 64)
		if err != nil || r < 0 || r > 1 {
			return nil, fmt.Errorf("OTEL_TRACES_SAMPLER_ARG=%q: want the ratio of traces to sample, from 0 to 1 (e.g. 0.01)", arg)
		}
		return sdktrace.TraceIDRatioBased(r), nil
	}
	switch name {
	case "", "parentbased_always_on":
		return sdktrace.ParentBased(sdktrace.AlwaysSample()), nil
	case "always_on":
		return sdktrace.AlwaysSample(), nil
	case "always_off":
		return sdktrace.NeverSample(), nil
	case "parentbased_always_off":
		return sdktrace.ParentBased(sdktrace.NeverSample()), nil
	case "traceidratio":
		return ratio()
	case "parentbased_traceidratio":
		s, err := ratio()
		if err != nil {
			return nil, err
		}
		return sdktrace.ParentBased(s), nil
	}
	return nil, fmt.Errorf("OTEL_TRACES_SAMPLER=%q: use always_on, always_off, traceidratio or their parentbased_ forms (parentbased_always_on, the default)", name)
}
