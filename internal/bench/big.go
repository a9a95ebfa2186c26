package bench

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

func (b *bencher) bigAll(ctx context.Context) ([]Result, error) {
	var out []Result
	for _, rows := range b.cfg.BigRows {
		for range b.cfg.Repeat {
			r, err := b.big(ctx, rows)
			if err != nil {
				return out, err
			}
			out = append(out, r)
		}
	}
	return out, nil
}

// big commits one transaction of rows outbox rows and measures the relay's
// drain time and peak RSS: memory must not grow with transaction size.
func (b *bencher) big(ctx context.Context, rows int) (Result, error) {
	url, err := b.database(ctx)
	if err != nil {
		return Result{}, err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return Result{}, err
	}
	defer conn.Close(context.Background())
	if err := createSlot(ctx, conn, "relay"); err != nil {
		return Result{}, err
	}
	defer dropSlots(conn, "relay")
	b.logf("big: one transaction of %d rows", rows)
	if err := writeBacklog(ctx, conn, rows, rows, b.cfg.PayloadBytes); err != nil {
		return Result{}, err
	}
	end, _ := currentLSN(ctx, conn)
	conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'bench', 'end')")

	k := &broker{name: "discard", addrs: b.cfg.KafkaBrokers}
	if len(k.addrs) > 0 {
		k.name = "external"
	}
	if err := k.start(); err != nil {
		return Result{}, err
	}
	defer k.stop()
	start := time.Now()
	rl, err := b.startRelay(url, "relay", k.addrs, "")
	if err != nil {
		return Result{}, err
	}
	defer rl.stop()
	err = waitConfirmed(ctx, conn, "relay", end, 30*time.Minute, func() error {
		if rl.cmd.ProcessState != nil {
			return errors.New("relay exited: " + rl.out.String())
		}
		return nil
	})
	if err != nil {
		return Result{}, err
	}
	elapsed := time.Since(start)
	rss, err := peakRSS(rl.cmd.Process.Pid)
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
	url, err := b.database(ctx)
	if err != nil {
		return nil, err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	if err := createSlot(ctx, conn, "relay"); err != nil {
		return nil, err
	}
	defer dropSlots(conn, "relay")
	k := &broker{name: "store", addrs: b.cfg.KafkaBrokers}
	if len(k.addrs) > 0 {
		k.name = "external"
	}
	if err := k.start(); err != nil {
		return nil, err
	}
	defer k.stop()
	rl, err := b.startRelay(url, "relay", k.addrs, "")
	if err != nil {
		return nil, err
	}
	defer rl.stop()
	if _, err := walsenderPID(ctx, conn, "relay", 60*time.Second); err != nil {
		return nil, fmt.Errorf("%w\n%s", err, rl.out)
	}
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
