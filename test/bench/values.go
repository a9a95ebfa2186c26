package bench

import (
	"fmt"

	"github.com/twmb/franz-go/pkg/sr"
	"github.com/twmb/franz-go/pkg/sr/srfake"
)

// benchSchemas are the schemas of the drain's events ({"n": …, "pad": …},
// type BenchEvent) in each value format.
var benchSchemas = map[string]sr.Schema{
	"avro": {Type: sr.TypeAvro, Schema: `{"type":"record","name":"BenchEvent","namespace":"walrelay.bench",
		"fields":[{"name":"n","type":"long"},{"name":"pad","type":"string"}]}`},
	"json": {Type: sr.TypeJSON, Schema: `{"type":"object","properties":{"n":{"type":"integer"},"pad":{"type":"string"}},
		"required":["n","pad"],"additionalProperties":false}`},
	"protobuf": {Type: sr.TypeProtobuf, Schema: `syntax = "proto3"; package walrelay.bench; message BenchEvent { int64 n = 1; string pad = 2; }`},
}

// valueArgs are the relay's flags framing the drain's values in format
// (none for asis), with a registry holding the format's schema for the
// bench topic; stop closes that registry. The registry is franz-go's
// in-process one: the relay reads the schema once and caches it, so what
// is measured is the relay's conversion, validation and framing, not the
// registry.
func valueArgs(format string) (args []string, stop func(), err error) {
	if format == "" || format == "asis" {
		return nil, func() {}, nil
	}
	s, ok := benchSchemas[format]
	if !ok {
		return nil, nil, fmt.Errorf("value format %q: want asis, json, avro or protobuf", format)
	}
	reg := srfake.New()
	reg.SeedSchema("outbox.event.bench-value", 1, 1, s)
	return []string{"--value-format", format, "--schema-registry-url", reg.URL()}, reg.Close, nil
}
