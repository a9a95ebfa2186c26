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
