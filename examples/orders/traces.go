package main

// traces.go: the chain's traces. With OTEL_* variables that turn tracing
// on (OTEL_EXPORTER_OTLP_ENDPOINT, …), the order service, walrelay and the
// ledger export their spans to that collector, each under its own service
// name; the demo's -traces runs an OTLP receiver in-process instead and
// prints one trace per event: the order service's transaction, walrelay's
// hop (its wait in the WAL, in the relay and for Kafka) and the ledger's
// handling.

import (
	"context"
	"fmt"
	"io"
	"os"
	"sort"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/walrelay/walrelay/test/otlptest"
	"github.com/walrelay/walrelay/tracing"
)

// chainTracing holds a tracing SDK per part of the chain; the zero value
// (tracing off) traces nothing.
type chainTracing struct {
	rcv                 *otlptest.Receiver // the demo's own receiver (-traces)
	shop, relay, ledger *tracing.Provider
}

// startTracing starts the parts' SDKs when the OTEL_* variables turn
// tracing on, or, with own, an OTLP receiver in-process to export to.
func startTracing(ctx context.Context, own bool, parts ...string) (*chainTracing, error) {
	ct := &chainTracing{}
	if own {
		rcv, err := otlptest.Start()
		if err != nil {
			return nil, err
		}
		ct.rcv = rcv
		os.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rcv.GRPCEndpoint())
		os.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tracing.ProtocolGRPC)
	}
	cfg, err := tracing.FromEnv(os.Getenv)
	if err != nil || !cfg.Enabled {
		return ct, err
	}
	cfg.Delay = 100 * time.Millisecond
	for _, part := range parts {
		p, err := tracing.Start(ctx, cfg, tracing.Options{ServiceName: part})
		if err != nil {
			ct.shutdown()
			return nil, err
		}
		switch part {
		case "shop":
			ct.shop = p
		case "walrelay":
			ct.relay = p
		case "ledger":
			ct.ledger = p
		}
	}
	return ct, nil
}

// tracer is the order service's tracer, nil when off (the global
// provider's then, which records nothing).
func (ct *chainTracing) tracer() trace.Tracer {
	if ct.shop == nil {
		return nil
	}
	return ct.shop.TracerProvider().Tracer("shop")
}

// consumerProvider is the ledger's provider, nil when off.
func (ct *chainTracing) consumerProvider() trace.TracerProvider {
	if ct.ledger == nil {
		return nil
	}
	return ct.ledger.TracerProvider()
}

// shutdown exports what is left and stops.
func (ct *chainTracing) shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, p := range []*tracing.Provider{ct.shop, ct.relay, ct.ledger} {
		if p != nil {
			_ = p.Shutdown(ctx)
		}
	}
	if ct.rcv != nil {
		ct.rcv.Stop()
	}
}

// print writes the trace of each of n events the receiver got (waiting
// for them a little: the last spans end after the ledger's commit), the
// earliest commit first.
func (ct *chainTracing) print(w io.Writer, n int) error {
	if ct.rcv == nil {
		return nil
	}
	// The ledger's spans end just after its commits, which the demo saw.
	var lines []traceLine
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		for _, p := range []*tracing.Provider{ct.shop, ct.relay, ct.ledger} {
			_ = p.ForceFlush(context.Background())
		}
		if lines = ct.traces(); len(lines) >= n {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d complete traces received, want %d", len(lines), n)
		}
	}
	fmt.Fprintln(w, "\ntraces, one per event: the order service's transaction → walrelay (waits in the WAL, in the relay, for Kafka) → the ledger")
	for _, l := range lines {
		fmt.Fprintln(w, l.text)
	}
	return nil
}

type traceLine struct {
	at   time.Time
	text string
}

// traces renders each trace of writer, producer and consumer span.
func (ct *chainTracing) traces() []traceLine {
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1fms", float64(d.Microseconds())/1000) }
	var lines []traceLine
	for id, spans := range ct.rcv.Traces() {
		if len(spans) < 3 {
			continue
		}
		wr, p, c := spans[0], spans[1], spans[2]
		if p.Service != "walrelay" || c.Service != "ledger" || p.ParentSpanID != wr.SpanID || c.ParentSpanID != p.SpanID {
			continue
		}
		ev := map[string]time.Time{}
		for _, e := range p.Events {
			ev[e.Name] = e.Time
		}
		read, produce := ev[tracing.EventRead], ev[tracing.EventProduce]
		lines = append(lines, traceLine{at: p.Start, text: fmt.Sprintf("  %s  %-13s %7s → %s: WAL %s, relay %s, Kafka %s → %s %s",
			id[:8], wr.Name, ms(wr.End.Sub(wr.Start)), p.Name, ms(read.Sub(p.Start)), ms(produce.Sub(read)), ms(p.End.Sub(produce)),
			c.Name, ms(c.End.Sub(c.Start)))})
	}
	sort.Slice(lines, func(i, j int) bool { return lines[i].at.Before(lines[j].at) })
	return lines
}
