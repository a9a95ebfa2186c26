package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/walrelay/walrelay/test/otlptest"
)

// tracingMode is one way the tracing scenario runs the relay: its
// OpenTelemetry variables (none: tracing off).
type tracingMode struct {
	name string
	env  []string
}

// tracingAll measures what tracing costs the relay: the drain of the
// same backlog in each of Config.TracingModes, by default off, on with
// every trace sampled and on with 1%
// (OTEL_TRACES_SAMPLER=parentbased_traceidratio; the backlog's rows carry
// no trace context, so each event's span is a root sampled at that
// ratio), exporting over OTLP (Config.TracingProtocol: HTTP as walrelay
// does by default, or gRPC) to a receiver in the bench process that
// counts spans (spans_per_event: 1 when none was dropped), with the
// export queue at walrelay's defaults (Config.TracingEnv sets others).
// Besides the relay's CPU to the end of the drain, its CPU to its exit
// (relay_cpu_total_us_per_event: the spans exported after the drain
// included), from which each mode's cost against off is reckoned: the
// drain's rate alone is a poor measure of it, the stream's reading being
// bimodal (BENCHMARKS.md, "How the stream is read"), and a relay slowed
// a little coalesces better. Repeats interleave the modes; each mode's
// medians follow its runs, then the cost of each mode against off. The
// load average is noted with every run: the machine is shared.
func (b *bencher) tracingAll(ctx context.Context) ([]Result, error) {
	rcv, err := otlptest.StartCounting()
	if err != nil {
		return nil, err
	}
	defer rcv.Stop()
	on := func(ratio string) []string {
		// The export queue and batches at walrelay's defaults unless
		// TracingEnv says otherwise: spans the receiver does not take in
		// time are dropped, and spans_per_event shows it.
		endpoint, protocol := rcv.HTTPEndpoint(), "http/protobuf"
		if b.cfg.TracingProtocol == "grpc" {
			endpoint, protocol = rcv.GRPCEndpoint(), "grpc"
		}
		return append([]string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL=" + protocol,
			"OTEL_TRACES_SAMPLER=parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG=" + ratio}, b.cfg.TracingEnv...)
	}
	names := b.cfg.TracingModes
	if len(names) == 0 {
		names = []string{"off", "1.0", "0.01"}
	}
	var modes []tracingMode
	for _, n := range names {
		if n == "off" {
			modes = append(modes, tracingMode{"off", nil})
			continue
		}
		if r, err := strconv.ParseFloat(n, 64); err != nil || r <= 0 || r > 1 {
			return nil, fmt.Errorf("tracing mode %q: want off or a sampling ratio above 0, at most 1 (e.g. 1.0, 0.01)", n)
		}
		modes = append(modes, tracingMode{"sampled-" + n, on(n)})
	}
	mode := "discard"
	if len(b.cfg.Brokers) > 0 {
		mode = b.cfg.Brokers[0]
	}
	// Each mode of the build under test is followed by the compared
	// one's (--compare-binary, --compare-arg), in the same minutes.
	relays := b.relayRuns()
	defer func() { b.cfg.Binary = relays[0].bin }()
	var out []Result
	for _, size := range b.cfg.TxnSizes {
		byMode := map[string][]Result{}
		for range b.cfg.Repeat {
			for _, m := range modes {
				for _, rb := range relays {
					b.cfg.Binary = rb.bin
					r, err := b.tracingDrain(ctx, size, b.oneBroker(mode), m, rcv, rb.args...)
					if err != nil {
						return out, err
					}
					r.Params += rb.label
					byMode[m.name+rb.label] = append(byMode[m.name+rb.label], r)
				}
			}
		}
		for _, rb := range relays {
			for _, m := range modes {
				rs := byMode[m.name+rb.label]
				out = append(out, rs...)
				if len(rs) > 1 {
					out = append(out, medians(rs))
				}
			}
		}
		for _, rb := range relays {
			off := byMode["off"+rb.label]
			for _, m := range modes {
				if m.name == "off" || len(off) == 0 {
					continue
				}
				rs := byMode[m.name+rb.label]
				out = append(out, Result{
					Scenario: "tracing",
					Params:   fmt.Sprintf("events=%d txn=%d broker=%s tracing=%s against off%s", b.cfg.Events, size, mode, m.name, rb.label),
					Metrics: map[string]float64{
						"tracing_cpu_us_per_event": medianOf(rs, "relay_cpu_total_us_per_event") - medianOf(off, "relay_cpu_total_us_per_event"),
						"rate_ratio":               medianOf(rs, "relay_events_per_s") / medianOf(off, "relay_events_per_s"),
					},
					Notes: fmt.Sprintf("medians of %d runs each", len(rs)),
				})
			}
		}
	}
	return out, nil
}

// tracingDrain drains a backlog of txnSize-row transactions with the relay
// (b.cfg.Binary, with relayArgs) run in mode m, and counts the spans rcv
// received from it.
func (b *bencher) tracingDrain(ctx context.Context, txnSize int, k *broker, m tracingMode, rcv *otlptest.Receiver, relayArgs ...string) (Result, error) {
	su, err := b.newSetup(ctx, "relay")
	if err != nil {
		return Result{}, err
	}
	defer su.close()
	if err := writeBacklog(ctx, su.conn, b.cfg.Events, txnSize, b.cfg.PayloadBytes); err != nil {
		return Result{}, fmt.Errorf("write backlog: %w", err)
	}
	end, _ := currentLSN(ctx, su.conn)
	if _, err := su.conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'bench', 'end')"); err != nil {
		return Result{}, fmt.Errorf("write the end marker: %w", err)
	}
	if err := su.startBroker(k); err != nil {
		return Result{}, err
	}
	load := loadAverage()
	spans := rcv.Count()
	b.relayEnv = m.env
	start := time.Now()
	_, err = su.startRelay(ctx, "at-least-once", relayArgs...)
	b.relayEnv = nil
	if err != nil {
		return Result{}, err
	}
	err = su.waitRelayConfirmed(ctx, end)
	took := time.Since(start)
	if err != nil {
		return Result{}, err
	}
	pid := su.relay.cmd.Process.Pid
	cpu, _ := cpuTime(pid)
	rss, _ := peakRSS(pid)
	rl := su.relay
	rl.stop() // exports the last spans
	su.relay = nil
	// The relay's CPU to the end of its life: every span it exported
	// included, those exported after the drain too.
	var total time.Duration
	if st := rl.cmd.ProcessState; st != nil {
		total = st.UserTime() + st.SystemTime()
	}
	n := float64(b.cfg.Events)
	res := Result{
		Scenario: "tracing",
		Params:   fmt.Sprintf("events=%d txn=%d broker=%s tracing=%s", b.cfg.Events, txnSize, k.name, m.name),
		Metrics: map[string]float64{
			"relay_events_per_s":           n / took.Seconds(),
			"relay_cpu_us_per_event":       float64(cpu.Microseconds()) / n,
			"relay_cpu_total_us_per_event": float64(total.Microseconds()) / n,
			"peak_rss_mb":                  float64(rss) / (1 << 20),
			"spans_per_event":              float64(rcv.Count()-spans) / n,
			"load1":                        (load + loadAverage()) / 2,
		},
	}
	b.logf("tracing %s txn=%d (%s): %s, %.0f events/s, %.1f µs CPU per event (%.1f to its exit), %.3f spans per event, load %.1f", m.name, txnSize, b.cfg.Binary,
		took.Round(time.Millisecond), res.Metrics["relay_events_per_s"], res.Metrics["relay_cpu_us_per_event"], res.Metrics["relay_cpu_total_us_per_event"], res.Metrics["spans_per_event"], res.Metrics["load1"])
	return res, nil
}

// loadAverage is the 1-minute load average (/proc/loadavg), 0 when
// unreadable.
func loadAverage() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
