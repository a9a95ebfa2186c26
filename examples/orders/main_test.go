package main

import (
	"context"
	"testing"
	"time"
)

// TestDemo runs what the README and examples/orders/README.md tell a user
// to run, `go run ./examples/orders`, with three orders: a throwaway
// PostgreSQL and the dev broker, the relay in-process at relay.DefaultConfig,
// the writer and the ledger consumer. demo returns nil only when the ledger
// holds every event once, in version order per order.
func TestDemo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := demo(ctx, []string{"-orders", "3"}); err != nil {
		t.Fatal(err)
	}
}

// TestDemoTraces runs `go run ./examples/orders -traces`: the chain traced
// to an OTLP receiver in-process, and one trace per event printed (demo
// fails unless every event's trace of the writer's, walrelay's and the
// ledger's span arrived).
func TestDemoTraces(t *testing.T) {
	// demo points the OpenTelemetry variables at its receiver: restored
	// after the test.
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := demo(ctx, []string{"-traces", "-orders", "2"}); err != nil {
		t.Fatal(err)
	}
}
