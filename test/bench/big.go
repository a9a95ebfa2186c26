package bench

import (
	"context"
	"fmt"
	"time"
)

// bigAll runs big per --big-rows, each --repeat times followed by a row of
// their medians.
func (b *bencher) bigAll(ctx context.Context) ([]Result, error) {
	runs := map[string][]Result{}
	var order []string
	for _, rows := range b.cfg.BigRows {
		for range b.cfg.Repeat {
			r, err := b.big(ctx, rows)
			if err != nil {
				return collect(runs, order), err
			}
			if _, ok := runs[r.Params]; !ok {
				order = append(order, r.Params)
			}
			runs[r.Params] = append(runs[r.Params], r)
		}
	}
	return collect(runs, order), nil
}

// big commits one transaction of rows outbox rows and measures the relay's
// drain time and peak RSS: memory must not grow with transaction size.
func (b *bencher) big(ctx context.Context, rows int) (Result, error) {
	su, err := b.newSetup(ctx, "relay")
	if err != nil {
		return Result{}, err
	}
	defer su.close()
	conn := su.conn
	b.logf("big: one transaction of %d rows", rows)
	if err := writeBacklog(ctx, conn, rows, rows, b.cfg.PayloadBytes); err != nil {
		return Result{}, err
	}
	end, _ := currentLSN(ctx, conn)
	if _, err := conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'bench', 'end')"); err != nil {
		return Result{}, fmt.Errorf("write the end marker: %w", err)
	}

	// On Apache Kafka when it is asked for: its acknowledgements pace the
	// relay, and so what the relay holds meanwhile.
	mode := "discard"
	if has(b.cfg.Brokers, "apache") {
		mode = "apache"
	}
	k := b.oneBroker(mode)
	if err := su.startBroker(k); err != nil {
		return Result{}, err
	}
	start := time.Now()
	if _, err := su.startRelay(ctx, ""); err != nil {
		return Result{}, err
	}
	if err := su.waitRelayConfirmed(ctx, end); err != nil {
		return Result{}, err
	}
	elapsed := time.Since(start)
	rss, err := peakRSS(su.relay.cmd.Process.Pid)
	if err != nil {
		return Result{}, err
	}
	res := Result{
		Scenario: "big",
		Params:   fmt.Sprintf("rows=%d payload=%dB broker=%s", rows, b.cfg.PayloadBytes, k.name),
		Metrics: map[string]float64{
			"drain_s":            elapsed.Seconds(),
			"relay_events_per_s": float64(rows) / elapsed.Seconds(),
			"peak_rss_mb":        float64(rss) / (1 << 20),
		},
	}
	b.logf("big rows=%d: %s, peak RSS %.1f MiB", rows, elapsed.Round(time.Millisecond), res.Metrics["peak_rss_mb"])
	return res, nil
}

// idle runs the relay with nothing to do and measures its CPU use.
func (b *bencher) idle(ctx context.Context) ([]Result, error) {
	su, err := b.newSetup(ctx, "relay")
	if err != nil {
		return nil, err
	}
	defer su.close()
	if err := su.startBroker(b.oneBroker("store")); err != nil {
		return nil, err
	}
	if _, err := su.startRelay(ctx, ""); err != nil {
		return nil, err
	}
	rl := su.relay
	time.Sleep(time.Second) // past startup
	before, err := cpuTime(rl.cmd.Process.Pid)
	if err != nil {
		return nil, err
	}
	b.logf("idle: measuring the relay's CPU for %s", b.cfg.IdleFor)
	time.Sleep(b.cfg.IdleFor)
	after, err := cpuTime(rl.cmd.Process.Pid)
	if err != nil {
		return nil, err
	}
	pct := 100 * (after - before).Seconds() / b.cfg.IdleFor.Seconds()
	return []Result{{
		Scenario: "idle",
		Params:   fmt.Sprintf("duration=%s (default heartbeat and status intervals)", b.cfg.IdleFor),
		Metrics:  map[string]float64{"cpu_percent": pct},
		Notes:    fmt.Sprintf("cpu=%s", after-before),
	}}, nil
}
