package tracing

import (
	"os"
	"strings"
	"testing"
	"time"
)

func env(kv ...string) func(string) string {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) string { return m[k] }
}

// TestFromEnv: off unless an exporter or an endpoint is named, the
// standard variables read, and a value walrelay cannot use refused at
// once, naming the variable.
func TestFromEnv(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     []string
		enabled bool
		check   func(Config) string
		wantErr string
	}{
		{name: "nothing set: off", env: nil},
		{name: "endpoint: on, http by default", env: []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"}, enabled: true,
			check: func(c Config) string {
				if c.Protocol != ProtocolHTTP || c.QueueSize != 16384 || c.BatchSize != 1024 || c.Delay != 5*time.Second || c.ExportTimeout != 30*time.Second {
					return "defaults"
				}
				return ""
			}},
		{name: "traces endpoint", env: []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces"}, enabled: true},
		{name: "exporter otlp, grpc", env: []string{"OTEL_TRACES_EXPORTER", "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"}, enabled: true,
			check: func(c Config) string {
				if c.Protocol != ProtocolGRPC {
					return "protocol " + c.Protocol
				}
				return ""
			}},
		{name: "traces protocol wins", env: []string{"OTEL_TRACES_EXPORTER", "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"}, enabled: true,
			check: func(c Config) string {
				if c.Protocol != ProtocolHTTP {
					return "protocol " + c.Protocol
				}
				return ""
			}},
		{name: "exporter none", env: []string{"OTEL_TRACES_EXPORTER", "none", "OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"}},
		{name: "SDK disabled", env: []string{"OTEL_SDK_DISABLED", "true", "OTEL_TRACES_EXPORTER", "otlp"}},
		{name: "sampler ratio", env: []string{"OTEL_TRACES_EXPORTER", "otlp", "OTEL_TRACES_SAMPLER", "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG", "0.01"}, enabled: true,
			check: func(c Config) string {
				if d := c.Sampler.Description(); !strings.Contains(d, "TraceIDRatioBased{0.01}") || !strings.HasPrefix(d, "ParentBased") {
					return "sampler " + d
				}
				return ""
			}},
		{name: "queue sizes", env: []string{"OTEL_TRACES_EXPORTER", "otlp", "OTEL_BSP_MAX_QUEUE_SIZE", "16", "OTEL_BSP_SCHEDULE_DELAY", "50", "OTEL_BSP_EXPORT_TIMEOUT", "1000"}, enabled: true,
			check: func(c Config) string {
				if c.QueueSize != 16 || c.BatchSize != 16 || c.Delay != 50*time.Millisecond || c.ExportTimeout != time.Second {
					return "queue settings"
				}
				return ""
			}},
		{name: "zipkin", env: []string{"OTEL_TRACES_EXPORTER", "zipkin"}, wantErr: "OTEL_TRACES_EXPORTER=\"zipkin\""},
		{name: "http/json", env: []string{"OTEL_TRACES_EXPORTER", "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"}, wantErr: "OTEL_EXPORTER_OTLP_PROTOCOL=\"http/json\": use grpc or http/protobuf"},
		{name: "bad sampler", env: []string{"OTEL_TRACES_EXPORTER", "otlp", "OTEL_TRACES_SAMPLER", "jaeger_remote"}, wantErr: "OTEL_TRACES_SAMPLER=\"jaeger_remote\""},
		{name: "bad ratio", env: []string{"OTEL_TRACES_EXPORTER", "otlp", "OTEL_TRACES_SAMPLER", "traceidratio", "OTEL_TRACES_SAMPLER_ARG", "2"}, wantErr: "OTEL_TRACES_SAMPLER_ARG=\"2\""},
		{name: "bad queue", env: []string{"OTEL_TRACES_EXPORTER", "otlp", "OTEL_BSP_MAX_QUEUE_SIZE", "-1"}, wantErr: "OTEL_BSP_MAX_QUEUE_SIZE=\"-1\""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := FromEnv(env(tc.env...))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Enabled != tc.enabled {
				t.Fatalf("Enabled = %v, want %v", c.Enabled, tc.enabled)
			}
			if tc.check != nil {
				if what := tc.check(c); what != "" {
					t.Errorf("%s: %+v", what, c)
				}
			}
		})
	}
}

var getenv = os.Getenv
