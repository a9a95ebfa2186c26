package bench

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// The standby scenario: what decoding on a hot standby (PostgreSQL 16+,
// --primary-url) saves the primary, and what it adds to the latency. One
// topology for both legs, the bench's cluster and a hot standby of it
// (hot_standby_feedback on, a physical slot), so that the physical
// walsender's cost is in both; the relay reads the primary in one leg, the
// standby in the other.

// standbyMinVersion is the first PostgreSQL that decodes on a standby.
const standbyMinVersion = 16

// checkStandbyVersion refuses, in one line naming the fix, a cluster that
// cannot decode on a standby: an external one (the scenario makes a
// standby of its own throwaway cluster) or one before 16.
func (b *bencher) checkStandbyVersion(ctx context.Context) error {
	if b.pg == nil {
		return errors.New("the standby scenario starts a hot standby of its own throwaway cluster: drop --pg-url")
	}
	major, err := b.pg.Major(ctx)
	if err != nil {
		return err
	}
	if major < standbyMinVersion {
		return fmt.Errorf("the standby scenario needs PostgreSQL %d or later (decoding on a standby), the cluster runs %d (%s): set %s=%d or later (installed by `make deps-pg-versions`)",
			standbyMinVersion, major, b.pg.BinDir(), devcluster.TestPGEnv, standbyMinVersion)
	}
	return nil
}

func (b *bencher) standbyAll(ctx context.Context) ([]Result, error) {
	if err := b.checkStandbyVersion(ctx); err != nil {
		return nil, err
	}
	sb, err := b.pg.StartStandby(ctx, devcluster.StandbyOptions{})
	if err != nil {
		return nil, err
	}
	defer b.closeStandby(sb)
	b.logf("hot standby at %s (physical slot %s)", sb.URL("postgres"), sb.Slot)

	// The legs alternate (primary, standby, primary, …) so that a slow
	// phase of the shared machine does not fall on one of them only; each
	// leg's runs are followed by a row of their medians, and each rate and
	// delivery mode by a row comparing the two legs' medians.
	var out []Result
	for _, rate := range b.cfg.Rates {
		for _, d := range b.cfg.Deliveries {
			var legs [2][]Result
			for range b.cfg.Repeat {
				for i, onStandby := range []bool{false, true} {
					r, err := b.standbyLeg(ctx, sb, rate, d, onStandby)
					if err != nil {
						return append(out, append(legs[0], legs[1]...)...), err
					}
					legs[i] = append(legs[i], r)
				}
			}
			var med [2]Result
			for i, rs := range legs {
				out = append(out, rs...)
				med[i] = rs[0]
				if len(rs) > 1 {
					med[i] = medians(rs)
					out = append(out, med[i])
				}
			}
			out = append(out, compareLegs(med[0], med[1]))
		}
	}
	return out, nil
}

// compareLegs is the row that says what reading the standby changed, from
// the two legs' (median) rows.
func compareLegs(primary, standby Result) Result {
	p, s := primary.Metrics, standby.Metrics
	m := map[string]float64{
		"added_p50_ms": s["p50_ms"] - p["p50_ms"],
		"added_p99_ms": s["p99_ms"] - p["p99_ms"],
	}
	if v := p["primary_cpu_us_per_event"]; v > 0 {
		m["primary_cpu_ratio"] = s["primary_cpu_us_per_event"] / v
		m["primary_cpu_us_saved"] = v - s["primary_cpu_us_per_event"]
	}
	if v := p["primary_cpu_us_per_event"] + p["standby_cpu_us_per_event"]; v > 0 {
		m["both_cpu_ratio"] = (s["primary_cpu_us_per_event"] + s["standby_cpu_us_per_event"]) / v
	}
	return Result{Scenario: "standby", Params: strings.TrimSuffix(standby.Params, " read=standby") + " standby against primary", Metrics: m}
}

// closeStandby stops the standby and drops its physical slot on the
// primary, which would otherwise keep WAL for the scenarios after it.
func (b *bencher) closeStandby(sb *devcluster.Postgres) {
	if err := sb.Close(); err != nil {
		b.logf("stop the standby: %v", err)
	}
	conn, err := pgx.Connect(context.Background(), b.admin)
	if err != nil {
		b.logf("drop the standby's slot: %v", err)
		return
	}
	defer conn.Close(context.Background())
	// Its walsender ends once it notices the standby gone.
	err = devcluster.WaitFor(30*time.Second, 20*time.Millisecond, func() (bool, error) {
		_, err := conn.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", sb.Slot)
		return err == nil, err
	})
	if err != nil {
		b.logf("drop the standby's slot %s: %v", sb.Slot, err)
	}
}

// standbyLeg runs one leg: a fresh database with the slot "relay" on the
// primary or (onStandby) on the standby, a fresh broker and relay, and
// writers committing one-row transactions on the primary at rate for the
// configured duration after a 2 s warm-up. It measures the commit-to-read
// latency as the latency scenario does (the record's timestamp is the
// commit's time on the primary, so reading the standby adds its replay),
// and the CPU time of the primary's and the standby's process trees over
// the writes and the drain after them, per event committed.
func (b *bencher) standbyLeg(ctx context.Context, sb *devcluster.Postgres, rate int, delivery string, onStandby bool) (Result, error) {
	load := loadAverage()
	su, err := b.newSetup(ctx)
	if err != nil {
		return Result{}, err
	}
	defer su.close()
	read, pgURL, slotConn := "primary", su.url, su.conn
	var extra []string
	if onStandby {
		read = "standby"
		if err := sb.WaitReplayed(ctx); err != nil { // the database and its publication
			return Result{}, fmt.Errorf("the standby does not replay: %w", err)
		}
		pgURL = sb.URL(su.conn.Config().Database)
		if su.slotConn, err = pgx.Connect(ctx, pgURL); err != nil {
			return Result{}, err
		}
		slotConn = su.slotConn
		extra = []string{"--primary-url", su.url}
	}
	if err := createSlotOn(ctx, slotConn, su.conn, onStandby); err != nil {
		return Result{}, err
	}
	standbyConn, err := pgx.Connect(ctx, sb.URL("postgres"))
	if err != nil {
		return Result{}, err
	}
	defer standbyConn.Close(context.Background())
	primaryPM, err := postmasterPID(ctx, su.conn)
	if err != nil {
		return Result{}, err
	}
	standbyPM, err := postmasterPID(ctx, standbyConn)
	if err != nil {
		return Result{}, err
	}

	mode := "store"
	if has(b.cfg.Brokers, "apache") {
		mode = "apache"
	}
	k := b.oneBroker(mode)
	if err := su.startBroker(k); err != nil {
		return Result{}, err
	}
	rl, err := b.startRelay(pgURL, "relay", k.addrs, delivery, extra...)
	if err != nil {
		return Result{}, err
	}
	su.relay = rl
	if _, err := walsenderPID(ctx, slotConn, "relay", 60*time.Second); err != nil {
		return Result{}, fmt.Errorf("%w\n%s", err, rl.out)
	}

	measureFrom := time.Now().Add(2 * time.Second)
	cr, err := readCommits(ctx, k.addrs, "outbox.event.bench", measureFrom, time.Time{})
	if err != nil {
		return Result{}, err
	}
	defer cr.Stop()

	p0, err := readTree(primaryPM)
	if err != nil {
		return Result{}, err
	}
	s0, err := readTree(standbyPM)
	if err != nil {
		return Result{}, err
	}
	relay0, _ := cpuTime(rl.cmd.Process.Pid)
	total := b.cfg.Duration + time.Until(measureFrom)
	committed, err := commitAtRate(ctx, su.url, rate, total, b.cfg.PayloadBytes)
	if err != nil {
		return Result{}, err
	}
	cr.WaitFor(committed, 30*time.Second)
	p1, err := readTree(primaryPM)
	if err != nil {
		return Result{}, err
	}
	s1, err := readTree(standbyPM)
	if err != nil {
		return Result{}, err
	}
	relay1, _ := cpuTime(rl.cmd.Process.Pid)
	lat := cr.Stop()
	if len(lat) == 0 || committed == 0 {
		return Result{}, fmt.Errorf("no record measured (%d committed, %d read)\n%s", committed, cr.Seen(), rl.out)
	}
	pAll, pWS := treeDelta(p0, p1)
	sAll, sWS := treeDelta(s0, s1)
	perEvent := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(committed) }
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	res := Result{
		Scenario: "standby",
		Params:   fmt.Sprintf("rate=%d/s duration=%s payload=%dB broker=%s delivery=%s read=%s", rate, b.cfg.Duration, b.cfg.PayloadBytes, k.name, delivery, read),
		Metrics: map[string]float64{
			"primary_cpu_us_per_event":       perEvent(pAll),
			"primary_walsender_us_per_event": perEvent(pWS),
			"primary_rest_us_per_event":      perEvent(pAll - pWS),
			"standby_cpu_us_per_event":       perEvent(sAll),
			"standby_walsender_us_per_event": perEvent(sWS),
			"relay_cpu_us_per_event":         perEvent(relay1 - relay0),
			"p50_ms":                         ms(lat[len(lat)/2]),
			"p99_ms":                         ms(lat[len(lat)*99/100]),
			"max_ms":                         ms(lat[len(lat)-1]),
			"achieved_rate":                  float64(committed) / total.Seconds(),
			"events":                         float64(len(lat)),
			"load1":                          (load + loadAverage()) / 2,
		},
	}
	if cr.Seen() < committed {
		res.Notes = fmt.Sprintf("MISSING %d records", committed-cr.Seen())
	}
	b.logf("standby scenario, relay reading the %s, rate=%d delivery=%s: primary %.1f µs/event (walsenders %.1f), standby %.1f µs/event (walsenders %.1f), p50 %.1fms p99 %.1fms, load %.1f",
		read, rate, delivery, res.Metrics["primary_cpu_us_per_event"], res.Metrics["primary_walsender_us_per_event"],
		res.Metrics["standby_cpu_us_per_event"], res.Metrics["standby_walsender_us_per_event"], res.Metrics["p50_ms"], res.Metrics["p99_ms"], res.Metrics["load1"])
	return res, nil
}

// createSlotOn creates the pgoutput slot "relay" on slotConn's server. On a
// standby, creating a logical slot waits for a record of the running
// transactions from the primary, which a quiet primary writes only at its
// next checkpoint: primary asks for one every 100 ms meanwhile, as the
// relay does when it creates its slot on a standby.
func createSlotOn(ctx context.Context, slotConn, primary *pgx.Conn, onStandby bool) error {
	if !onStandby {
		return createSlot(ctx, slotConn, "relay")
	}
	done := make(chan error, 1)
	go func() { done <- createSlot(ctx, slotConn, "relay") }()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := primary.Exec(ctx, "SELECT pg_log_standby_snapshot()"); err != nil {
			// The creation ends by itself at the primary's next record of
			// the running transactions (the bgwriter's, within 15 s).
			return errors.Join(err, <-done)
		}
		select {
		case err := <-done:
			if err != nil {
				return fmt.Errorf("create the slot on the standby: %w", err)
			}
			return nil
		case <-tick.C:
		}
	}
}
