package bench

import (
	"context"
	"fmt"
	"os/exec"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// The txnfloor scenario is the broker's own cost of exactly-once latency,
// with no relay and no PostgreSQL: events made in the bench process at
// each --rate, evenly spaced, go through a minimal franz-go transactional
// loop (begin, produce what is waiting, flush, commit) to a read_committed
// consumer, which measures event-to-read latency as the latency scenario
// does. It runs with one transactional producer (each transaction's first
// record waits for the previous commit: the relay's protocol) and with two
// taking turns (one fills and flushes its transaction while the other's
// EndTxn is in flight), with or without waiting for the markers, with or
// without a second partition (floorVariant, --floor). All runs share one
// broker. The relay's exactly-once p99 is judged as a ratio to this floor
// (issue 36): if the broker alone cannot reach a latency on this machine,
// neither can the relay. The floor is kind to the broker: PostgreSQL, its
// writers and the walsender, which share the machine's cores in the
// latency scenario, are idle here, unless the variant asks for them
// (pgLoad): then the latency scenario's writers commit one-row
// transactions at the same rate to a throwaway database and
// pg_recvlogical streams them from a slot, so the broker shares the cores
// as it does under the relay, and the relay's own share is what is left.

// floorVariant is one way a txnfloor run commits: with how many
// transactional producers taking turns, and whether a producer, after its
// commit, waits for the coordinator to complete it (the markers written)
// before its next transaction's first record, as the relay's settle does.
// Without that wait, Apache Kafka answers the next produce
// CONCURRENT_TRANSACTIONS inside the broker and retries it after
// add.partitions.to.txn.retry.backoff.ms (20 ms).
// With checkpoint, each transaction ends with one record to a second
// topic, as the relay's ends with its checkpoint: two partitions' markers.
// With pgLoad, PostgreSQL works beside it as in the latency scenario.
type floorVariant struct {
	producers  int
	settle     bool
	checkpoint bool
	pgLoad     bool
}

// parseFloorVariant reads a --floor value: "1" or "2", then "s" for
// settle, "c" for checkpoint and "p" for pgLoad.
func parseFloorVariant(s string) (floorVariant, error) {
	var v floorVariant
	if s == "" || s[0] != '1' && s[0] != '2' {
		return v, fmt.Errorf("--floor %q: want 1 or 2 producers, then s (settle), c (checkpoint) and/or p (PostgreSQL's load beside it), as in 2sc", s)
	}
	v.producers = int(s[0] - '0')
	for _, c := range s[1:] {
		switch c {
		case 's':
			v.settle = true
		case 'c':
			v.checkpoint = true
		case 'p':
			v.pgLoad = true
		default:
			return v, fmt.Errorf("--floor %q: want 1 or 2 producers, then s (settle), c (checkpoint) and/or p (PostgreSQL's load beside it), as in 2sc", s)
		}
	}
	return v, nil
}

// CheckFloorVariants refuses a --floor value parseFloorVariant cannot
// read, before anything starts.
func CheckFloorVariants(names []string) error {
	_, err := floorVariants(names)
	return err
}

// floorVariants reads the --floor values; none means every default.
func floorVariants(names []string) ([]floorVariant, error) {
	if len(names) == 0 {
		names = []string{"1", "1s", "2", "2s", "1sc", "2sc"}
	}
	var variants []floorVariant
	for _, n := range names {
		v, err := parseFloorVariant(n)
		if err != nil {
			return nil, err
		}
		variants = append(variants, v)
	}
	return variants, nil
}

func (b *bencher) txnFloorAll(ctx context.Context) ([]Result, error) {
	variants, err := floorVariants(b.cfg.FloorVariants)
	if err != nil {
		return nil, err
	}
	// One broker for all runs (each has its own topic and transactional
	// ids): Apache Kafka's start is most of a run's time otherwise.
	k, err := b.sharedBroker()
	if err != nil {
		return nil, err
	}
	defer k.stop()
	runs := map[string][]Result{}
	var order []string
	for _, rate := range b.cfg.Rates {
		for range b.cfg.Repeat {
			for _, v := range variants {
				r, err := b.txnFloor(ctx, k, rate, v, b.cfg.Duration)
				if err != nil {
					return collect(runs, order), err
				}
				if _, ok := runs[r.Params]; !ok {
					order = append(order, r.Params)
				}
				runs[r.Params] = append(runs[r.Params], r)
			}
		}
	}
	return collect(runs, order), nil
}

// floorPartitions is the event topic's partitions, as the relay's in the
// latency scenario (--topic-partitions 3): each transaction's markers go
// to every partition it wrote to.
const floorPartitions = 3

// txnFloor runs the transactional loop on k at rate events per second for
// dur, committing as v says.
func (b *bencher) txnFloor(ctx context.Context, k *broker, rate int, v floorVariant, dur time.Duration) (Result, error) {
	producers := v.producers
	b.seq++
	topic := fmt.Sprintf("bench.txnfloor.%d", b.seq)
	adm, err := kgo.NewClient(kgo.SeedBrokers(k.addrs...))
	if err != nil {
		return Result{}, err
	}
	admin := kadm.NewClient(adm)
	defer adm.Close()
	_, err = admin.CreateTopic(ctx, floorPartitions, -1, nil, topic)
	if err == nil && v.checkpoint {
		_, err = admin.CreateTopic(ctx, 1, -1, nil, topic+".ckpt")
	}
	if err != nil {
		return Result{}, fmt.Errorf("create %s: %w", topic, err)
	}

	// The producers, each with its own transactional id, initialized
	// before anything is timed, each
	// having committed a first transaction.
	pcs := make([]*kgo.Client, producers)
	for i := range pcs {
		pc, err := kgo.NewClient(kgo.SeedBrokers(k.addrs...), kgo.DefaultProduceTopic(topic),
			kgo.TransactionalID(fmt.Sprintf("%s-%d", topic, i)), kgo.ProducerLinger(0),
			kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)), kgo.MetadataMinAge(250*time.Millisecond))
		if err != nil {
			return Result{}, err
		}
		defer pc.Close()
		// A first transaction to the new topic waits for the broker and
		// the client to learn of it (seconds on Apache Kafka): paid here.
		warm := []string{topic}
		if v.checkpoint {
			warm = append(warm, topic+".ckpt")
		}
		if err := warmTxn(ctx, pc, warm); err != nil {
			return Result{}, fmt.Errorf("warm up producer %d: %w", i, err)
		}
		pcs[i] = pc
	}

	measureFrom := time.Now().Add(2 * time.Second)
	cr, err := readCommits(ctx, k.addrs, topic, measureFrom, time.Unix(2, 0))
	if err != nil {
		return Result{}, err
	}
	defer cr.Stop()

	events := make(chan time.Time, 1<<16)
	total := dur + time.Until(measureFrom)
	stop := time.Now().Add(total)
	var made atomic.Int64
	go func() {
		// Events are due at evenly spaced times; a late wake-up makes
		// every event due by then, each stamped with its due time.
		defer close(events)
		interval := time.Second / time.Duration(rate)
		for next := time.Now(); next.Before(stop); {
			if d := time.Until(next); d > 0 {
				time.Sleep(d)
			}
			for now := time.Now(); !next.After(now) && next.Before(stop); next = next.Add(interval) {
				events <- next
				made.Add(1)
			}
		}
	}()

	if v.pgLoad {
		stopLoad, err := b.pgLoad(ctx, rate, total)
		if err != nil {
			return Result{}, err
		}
		defer func() {
			if err := stopLoad(); err != nil {
				b.logf("txnfloor: PostgreSQL's load beside the floor: %v", err)
			}
		}()
	}

	brokerStart := k.cpu()
	runStart := time.Now()
	// turn[i] holds a token while producer i may open the next
	// transaction: it passes the token on once its records are
	// acknowledged, before its commit, so that the next producer's
	// records follow them in the log while its EndTxn is in flight.
	turn := make([]chan struct{}, producers)
	for i := range turn {
		turn[i] = make(chan struct{}, 1)
	}
	turn[0] <- struct{}{}
	// Where a transaction's time goes, summed over all: its flush, its
	// EndTxn, the wait for its markers (settle).
	var txns, flushNs, endNs, settleNs atomic.Int64
	errs := make(chan error, 1)
	pctx, pcancel := context.WithCancel(ctx)
	defer pcancel()
	fail := func(err error) {
		select {
		case errs <- err:
		default:
		}
		pcancel()
	}
	var wg sync.WaitGroup
	for i, pc := range pcs {
		wg.Go(func() {
			n := i * 1_000_003 // keys as the latency scenario's writers': 400 of them
			for {
				var first time.Time
				ok := false
				select {
				case <-turn[i]:
					first, ok = <-events
				case <-pctx.Done():
					return
				}
				if !ok {
					turn[(i+1)%producers] <- struct{}{}
					return
				}
				if err := pc.BeginTransaction(); err != nil {
					fail(err)
					return
				}
				produce := func(at time.Time) {
					n++
					pc.Produce(pctx, &kgo.Record{Timestamp: at, Key: fmt.Appendf(nil, "key-%d", n%400), Value: []byte("floor")}, func(_ *kgo.Record, err error) {
						if err != nil {
							fail(err)
						}
					})
				}
				produce(first)
			more:
				for {
					select {
					case at, ok := <-events:
						if !ok {
							break more
						}
						produce(at)
					default:
						break more
					}
				}
				if v.checkpoint {
					pc.Produce(pctx, &kgo.Record{Topic: topic + ".ckpt", Value: []byte("checkpoint")}, func(_ *kgo.Record, err error) {
						if err != nil {
							fail(err)
						}
					})
				}
				t0 := time.Now()
				if err := pc.Flush(pctx); err != nil {
					fail(err)
					return
				}
				turn[(i+1)%producers] <- struct{}{}
				t1 := time.Now()
				if err := pc.EndTransaction(pctx, kgo.TryCommit); err != nil {
					fail(err)
					return
				}
				t2 := time.Now()
				txns.Add(1)
				if v.settle {
					settleTxn(pctx, admin, fmt.Sprintf("%s-%d", topic, i))
				}
				flushNs.Add(int64(t1.Sub(t0)))
				endNs.Add(int64(t2.Sub(t1)))
				settleNs.Add(int64(time.Since(t2)))
			}
		})
	}
	wg.Wait()
	select {
	case err := <-errs:
		return Result{}, err
	default:
	}
	cr.WaitFor(made.Load(), 30*time.Second)
	lat := cr.Stop()
	runTime, brokerCPU := time.Since(runStart), k.cpu()-brokerStart
	if len(lat) == 0 {
		return Result{}, fmt.Errorf("no record measured (%d made, %d read)", made.Load(), cr.Seen())
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	res := Result{
		Scenario: "txnfloor",
		Params:   fmt.Sprintf("rate=%d/s duration=%s broker=%s producers=%d settle=%v checkpoint=%v pgload=%v", rate, dur, k.name, producers, v.settle, v.checkpoint, v.pgLoad),
		Metrics: map[string]float64{
			"p50_ms":           ms(lat[len(lat)/2]),
			"p99_ms":           ms(lat[len(lat)*99/100]),
			"max_ms":           ms(lat[len(lat)-1]),
			"achieved_rate":    float64(made.Load()) / total.Seconds(),
			"events":           float64(len(lat)),
			"kafka_txns_per_s": float64(txns.Load()) / runTime.Seconds(),
		},
	}
	if n := txns.Load(); n > 0 {
		per := func(sum int64) float64 { return float64(sum) / float64(n) / 1e6 }
		res.Metrics["flush_ms_per_txn"] = per(flushNs.Load())
		res.Metrics["endtxn_ms_per_txn"] = per(endNs.Load())
		res.Metrics["settle_ms_per_txn"] = per(settleNs.Load())
	}
	if k.kafka != nil || k.apache != nil {
		res.Metrics["broker_cpu_percent"] = 100 * brokerCPU.Seconds() / runTime.Seconds()
	}
	if cr.Seen() < made.Load() {
		res.Notes = fmt.Sprintf("MISSING %d records", made.Load()-cr.Seen())
	}
	b.logf("txnfloor rate=%d producers=%d settle=%v checkpoint=%v pgload=%v: p50 %.1fms p99 %.1fms max %.1fms over %d records, %.0f Kafka transactions/s", rate, producers, v.settle, v.checkpoint, v.pgLoad,
		res.Metrics["p50_ms"], res.Metrics["p99_ms"], res.Metrics["max_ms"], len(lat), res.Metrics["kafka_txns_per_s"])
	return res, nil
}

// pgLoad makes PostgreSQL work beside a floor run as it does in the
// latency scenario: its writers commit one-row transactions at rate for
// total to a throwaway database, and pg_recvlogical, standing in for the
// relay's reading, streams them from a slot to /dev/null. stop ends it
// and says whether the writers kept up.
func (b *bencher) pgLoad(ctx context.Context, rate int, total time.Duration) (stop func() error, err error) {
	su, err := b.newSetup(ctx, "recv")
	if err != nil {
		return nil, err
	}
	cfg, err := pgconn.ParseConfig(su.url)
	if err != nil {
		su.close()
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	recv := exec.CommandContext(rctx, "pg_recvlogical", "-h", cfg.Host, "-p", fmt.Sprint(cfg.Port), "-U", cfg.User,
		"-d", cfg.Database, "-S", "recv", "--start", "-f", "/dev/null", "-F", "0", "-n",
		"-o", "proto_version=1", "-o", "publication_names=bench")
	if err := recv.Start(); err != nil {
		cancel()
		su.close()
		return nil, fmt.Errorf("pg_recvlogical: %w", err)
	}
	done := make(chan error, 1)
	go func() {
		n, err := commitAtRate(rctx, su.url, rate, total, b.cfg.PayloadBytes)
		if err == nil && float64(n) < 0.9*float64(rate)*total.Seconds() {
			err = fmt.Errorf("the writers committed %d of %.0f transactions", n, float64(rate)*total.Seconds())
		}
		done <- err
	}()
	return func() error {
		err := <-done
		cancel()
		_ = recv.Wait()
		su.close()
		return err
	}, nil
}

// settleTxn waits until the coordinator completed the transaction id just
// committed (at most 100 ms), asking every 500 µs, as router.Txn's settle.
func settleTxn(ctx context.Context, admin *kadm.Client, id string) {
	ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	for ctx.Err() == nil {
		d, err := admin.DescribeTransactions(ctx, id)
		if err != nil || d[id].Err != nil {
			return
		}
		if st := d[id].State; st != "PrepareCommit" && st != "PrepareAbort" {
			return
		}
		time.Sleep(500 * time.Microsecond)
	}
}

// warmTxn commits one transaction of one record to each topic, stamped in
// the past so that it is never measured.
func warmTxn(ctx context.Context, pc *kgo.Client, topics []string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := pc.BeginTransaction(); err != nil {
		return err
	}
	for _, t := range topics {
		for p := range 10 * floorPartitions { // keys enough to reach every partition
			rec := &kgo.Record{Topic: t, Timestamp: time.Unix(1, 0), Key: fmt.Appendf(nil, "warm-%d", p), Value: []byte("warm")}
			if err := pc.ProduceSync(ctx, rec).FirstErr(); err != nil {
				return err
			}
		}
	}
	return pc.EndTransaction(ctx, kgo.TryCommit)
}
