package bench

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

func (b *bencher) latencyAll(ctx context.Context) ([]Result, error) {
	// Every run shares one broker, warmed before the first (warmFor): a
	// broker in service has long compiled its code paths, and a fresh
	// Apache Kafka JVM spends a 15 s run compiling its transaction
	// coordinator's (on one node: exactly-once commits took 10.9 ms and the
	// markers 7.7 ms on a fresh broker each run, 4.5 and 3.3 ms on one
	// warmed by a transactional loop, with p50 and p99 halved). Each run
	// has its own topics. Repeats interleave the delivery modes (and the
	// --latency-floor variants, on the same broker), so that a slow phase
	// of the machine does not fall on one of them only; each measurement's
	// runs are followed by a row of their medians.
	k, err := b.sharedBroker()
	if err != nil {
		return nil, err
	}
	defer k.stop()
	var floors []floorVariant
	if len(b.cfg.LatencyFloor) > 0 {
		if floors, err = floorVariants(b.cfg.LatencyFloor); err != nil {
			return nil, err
		}
	}
	if k.apache != nil {
		// A minute: a 15 s loop left the floor's p99 falling over the next
		// three runs (32.8, 39.2, 16.4 ms at 2,000/s).
		if _, err := b.txnFloor(ctx, k, slices.Max(b.cfg.Rates), floorVariant{producers: 1, settle: true, checkpoint: true}, warmFor); err != nil {
			return nil, fmt.Errorf("warm up the broker: %w", err)
		}
	}
	runs := map[string][]Result{}
	var order []string
	add := func(r Result) {
		if _, ok := runs[r.Params]; !ok {
			order = append(order, r.Params)
		}
		runs[r.Params] = append(runs[r.Params], r)
	}
	relays := b.relayRuns()
	defer func() { b.cfg.Binary = relays[0].bin }()
	for _, rate := range b.cfg.Rates {
		for range b.cfg.Repeat {
			// The build under test, then the compared one (--compare-binary,
			// --compare-arg), on the same broker in the same round.
			for _, rb := range relays {
				b.cfg.Binary = rb.bin
				for _, d := range b.cfg.Deliveries {
					r, err := b.latency(ctx, k, rate, d, rb.args...)
					if err != nil {
						return collect(runs, order), err
					}
					r.Params += rb.label
					add(r)
				}
			}
			for _, v := range floors {
				r, err := b.txnFloor(ctx, k, rate, v, b.cfg.Duration)
				if err != nil {
					return collect(runs, order), err
				}
				add(r)
			}
		}
	}
	return collect(runs, order), nil
}

// warmFor is how long a transactional loop warms the latency scenario's
// Apache Kafka before its first run.
const warmFor = time.Minute

// latency commits one-row transactions at rate per second for the
// configured duration and measures, per record, the time from the
// transaction's commit (the record's timestamp) to a consumer reading it.
// It runs on k, which the caller started, with topics of its own.
func (b *bencher) latency(ctx context.Context, k *broker, rate int, delivery string, relayArgs ...string) (Result, error) {
	su, err := b.newSetup(ctx, "relay")
	if err != nil {
		return Result{}, err
	}
	defer su.close()
	su.broker = k
	defer func() { su.broker = nil }() // before close: k outlives the run
	url := su.url
	b.seq++
	topic, ckpt := fmt.Sprintf("outbox.event.bench.%d", b.seq), fmt.Sprintf("walrelay.checkpoints.%d", b.seq)
	metricsAddr, err := freeAddr()
	if err != nil {
		return Result{}, err
	}
	args := append([]string{"--topic-template", fmt.Sprintf("outbox.event.{aggregate_type}.%d", b.seq),
		"--checkpoint-topic", ckpt, "--metrics-addr", metricsAddr}, relayArgs...)
	if _, err := su.startRelay(ctx, delivery, args...); err != nil {
		return Result{}, err
	}
	rl := su.relay

	// The consumer records commit-to-read latencies of records committed
	// after the warm-up.
	measureFrom := time.Now().Add(2 * time.Second)
	cr, err := readCommits(ctx, k.addrs, topic, measureFrom, time.Time{})
	if err != nil {
		return Result{}, err
	}
	defer cr.Stop()

	// The broker's CPU over the run (with an in-process kfake, the bench
	// process's own: writers and consumer included, alike in both modes).
	brokerStart := k.cpu()
	runStart := time.Now()
	total := b.cfg.Duration + time.Until(measureFrom)
	before, scrapeErr := scrapeRelay(metricsAddr)
	committed, err := commitAtRate(ctx, url, rate, total, b.cfg.PayloadBytes)
	if err != nil {
		return Result{}, err
	}
	after, err := scrapeRelay(metricsAddr)
	if scrapeErr == nil {
		scrapeErr = err
	}
	// Let the last records arrive.
	cr.WaitFor(committed, 30*time.Second)
	lat := cr.Stop()
	runTime, brokerCPU := time.Since(runStart), k.cpu()-brokerStart
	txns, err := kafkaTxns(ctx, k.addrs, ckpt)
	if err != nil {
		return Result{}, err
	}
	if len(lat) == 0 {
		return Result{}, fmt.Errorf("no record measured (%d committed, %d read)\n%s", committed, cr.Seen(), rl.out)
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	res := Result{
		Scenario: "latency",
		Params:   fmt.Sprintf("rate=%d/s duration=%s payload=%dB broker=%s delivery=%s", rate, b.cfg.Duration, b.cfg.PayloadBytes, k.name, delivery),
		Metrics: map[string]float64{
			"p50_ms":        ms(lat[len(lat)/2]),
			"p99_ms":        ms(lat[len(lat)*99/100]),
			"max_ms":        ms(lat[len(lat)-1]),
			"achieved_rate": float64(committed) / total.Seconds(),
			"events":        float64(len(lat)),
		},
	}
	if scrapeErr == nil {
		cycleMetrics(res.Metrics, before, after)
	} else {
		b.logf("latency: the relay's /metrics: %v", scrapeErr)
	}
	if txns > 0 {
		res.Metrics["kafka_txns_per_s"] = float64(txns) / runTime.Seconds()
	}
	if k.kafka != nil || k.apache != nil {
		res.Metrics["broker_cpu_percent"] = 100 * brokerCPU.Seconds() / runTime.Seconds()
	}
	if cr.Seen() < committed {
		res.Notes = fmt.Sprintf("MISSING %d records", committed-cr.Seen())
	}
	b.logf("latency rate=%d delivery=%s: p50 %.1fms p99 %.1fms max %.1fms over %d records, %.0f Kafka transactions/s", rate, delivery,
		res.Metrics["p50_ms"], res.Metrics["p99_ms"], res.Metrics["max_ms"], len(lat), res.Metrics["kafka_txns_per_s"])
	return res, nil
}

// commitAtRate commits one-row outbox transactions at rate per second for
// total from four connections (each at rate/4, evenly spaced) and returns
// how many it committed.
func commitAtRate(ctx context.Context, url string, rate int, total time.Duration, payloadBytes int) (int64, error) {
	const writers = 4
	var committed atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Go(func() {
			wc, err := pgx.Connect(ctx, url)
			if err != nil {
				errs <- err
				return
			}
			defer wc.Close(context.Background())
			// The cluster runs with synchronous_commit off to write
			// backlogs fast; here commits must be durable, as in
			// production: the walsender sends only flushed WAL.
			if _, err := wc.Exec(ctx, "SET synchronous_commit = on"); err != nil {
				errs <- err
				return
			}
			interval := time.Duration(float64(time.Second) * writers / float64(rate))
			next := time.Now().Add(time.Duration(w) * interval / writers)
			stop := time.Now().Add(total)
			for i := 0; time.Now().Before(stop); i++ {
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				}
				next = next.Add(interval)
				if _, err := wc.Exec(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
					VALUES ('bench', $1, 'BenchEvent', '{"pad": "`+pad(payloadBytes)+`"}')`, fmt.Sprintf("key-%d-%d", w, i%100)); err != nil {
					errs <- err
					return
				}
				committed.Add(1)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return committed.Load(), err
	}
	return committed.Load(), nil
}

func pad(n int) string {
	b := make([]byte, max(n-12, 0))
	for i := range b {
		b[i] = 'x'
	}
	return string(b)
}

// kafkaTxns counts the Kafka transactions the relay committed with
// checkpoints in topic: each holds exactly one checkpoint record keyed by
// its slot ("relay"); the startup probe is keyed "relay/probe" and not
// counted. 0 without exactly-once.
func kafkaTxns(ctx context.Context, addrs []string, topic string) (int, error) {
	adm, err := kgo.NewClient(kgo.SeedBrokers(addrs...))
	if err != nil {
		return 0, err
	}
	ends, err := kadm.NewClient(adm).ListEndOffsets(ctx, topic)
	adm.Close()
	if err != nil {
		return 0, err
	}
	end, ok := ends.Lookup(topic, 0)
	if !ok || end.Err != nil || end.Offset == 0 {
		return 0, nil // no checkpoint topic: at-least-once
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	n := 0
	for {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return n, fmt.Errorf("count checkpoint records: %w", err)
		}
		last := int64(-1)
		fs.EachRecord(func(r *kgo.Record) {
			if string(r.Key) == "relay" {
				n++
			}
			last = r.Offset
		})
		// The end offset lies past the last record and one commit
		// marker, or two with two transactional producers: the last
		// checkpoint may land before the other producer's marker.
		if last >= end.Offset-3 {
			return n, nil
		}
	}
}
