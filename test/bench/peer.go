package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/test/debezium"
	"github.com/walrelay/walrelay/test/kafkacluster"
)

// The peer scenario runs walrelay --preset debezium and Debezium's
// PostgreSQL connector with its Outbox Event Router (Kafka Connect
// standalone, test/debezium) one after the other on the same
// PostgreSQL, the same Apache Kafka node and the same rows, each on a slot
// of its own in a fresh database per measurement.

// debeziumTuned is what a careful operator changes from Debezium's
// defaults: offsets (and so the slot's confirmed position) every second
// instead of every minute, larger batches and queue, a short poll
// interval, and a producer that batches (linger, batch size) and keeps
// several requests in flight with idempotence (Connect otherwise forces
// one in flight without idempotence).
var debeziumTuned = debezium.Options{
	Worker: map[string]string{
		"offset.flush.interval.ms":                       "1000",
		"producer.linger.ms":                             "5",
		"producer.batch.size":                            "262144",
		"producer.enable.idempotence":                    "true",
		"producer.max.in.flight.requests.per.connection": "5",
	},
	Connector: map[string]string{
		"max.batch.size":   "8192",
		"max.queue.size":   "32768",
		"poll.interval.ms": "10",
	},
}

// contender is one relay of the peer scenario on one slot.
type contender interface {
	start() error
	stop() // graceful
	kill() // kill -9
	pid() int
}

type walrelayPeer struct {
	b                   *bencher
	url, slot, template string
	brokers             []string
	rl                  *relay
}

func (w *walrelayPeer) start() (err error) {
	w.rl, err = w.b.startRelay(w.url, w.slot, w.brokers, "at-least-once", "--preset", "debezium", "--topic-template", w.template)
	return err
}
func (w *walrelayPeer) stop() { w.rl.stop() }
func (w *walrelayPeer) kill() {
	_ = w.rl.cmd.Process.Kill()
	_ = w.rl.cmd.Wait()
}
func (w *walrelayPeer) pid() int { return w.rl.cmd.Process.Pid }

type debeziumPeer struct {
	opts debezium.Options
	c    *debezium.Connect
}

func (d *debeziumPeer) start() (err error) {
	if d.c != nil {
		return d.c.Restart()
	}
	d.c, err = debezium.Start(context.Background(), d.opts)
	return err
}
func (d *debeziumPeer) stop() {
	if d.c != nil {
		_ = d.c.Stop(time.Minute)
	}
}
func (d *debeziumPeer) kill() {
	if d.c != nil {
		d.c.Kill()
	}
}
func (d *debeziumPeer) pid() int { return d.c.Pid() }

// peerRun is one measurement's database, slot, topic and contender.
type peerRun struct {
	b      *bencher
	name   string // walrelay, debezium, debezium-tuned
	url    string
	slot   string // slots are the cluster's: one name per run
	conn   *pgx.Conn
	topic  string
	c      contender
	client *kgo.Client

	mu       sync.Mutex
	reads    map[int][]time.Time // seq -> read times
	appended map[int]time.Time   // seq -> the broker's append time of its first copy
	first    time.Time
	onRead   func(seq int, appended time.Time)
}

func (b *bencher) peerAll(ctx context.Context) ([]Result, error) {
	if err := debezium.Available(); err != nil {
		return nil, err
	}
	if _, err := debezium.Classpath(); err != nil {
		return nil, err
	}
	kc, err := kafkacluster.Start(ctx, kafkacluster.Options{HeapMB: 1024})
	if err != nil {
		return nil, err
	}
	defer kc.Close()
	b.logf("peer: Apache Kafka at %s", kc.Addrs()[0])
	peers := b.cfg.Peers
	if len(peers) == 0 {
		peers = []string{"walrelay", "debezium", "debezium-tuned"}
	}
	for _, name := range peers {
		if name != "walrelay" && name != "debezium" && name != "debezium-tuned" {
			return nil, fmt.Errorf("peer %q: want walrelay, debezium or debezium-tuned", name)
		}
	}
	// Repeats interleave the contenders, so that a slow phase of the
	// machine does not fall on one of them only; each measurement's runs
	// are followed by a row of their medians.
	runs := map[string][]Result{}
	var order []string
	keep := func(r Result) {
		if _, ok := runs[r.Params]; !ok {
			order = append(order, r.Params)
		}
		runs[r.Params] = append(runs[r.Params], r)
	}
	for range b.cfg.Repeat {
		for _, name := range peers {
			for _, size := range b.peerSizes("drain") {
				r, err := b.peerDrain(ctx, kc.Addrs(), name, size)
				if err != nil {
					return collect(runs, order), fmt.Errorf("%s drain: %w", name, err)
				}
				keep(r)
			}
			for _, rate := range b.peerSizes("latency") {
				r, err := b.peerLatency(ctx, kc.Addrs(), name, rate)
				if err != nil {
					return collect(runs, order), fmt.Errorf("%s latency: %w", name, err)
				}
				keep(r)
			}
			if b.peerMeasures("kill") {
				r, err := b.peerKill(ctx, kc.Addrs(), name)
				if err != nil {
					return collect(runs, order), fmt.Errorf("%s kill: %w", name, err)
				}
				keep(r)
			}
		}
	}
	return collect(runs, order), nil
}

// peerMeasures reports whether the peer scenario measures what (drain,
// latency, kill: Config.PeerMeasures, all when empty).
func (b *bencher) peerMeasures(what string) bool {
	return len(b.cfg.PeerMeasures) == 0 || has(b.cfg.PeerMeasures, what)
}

// peerSizes is what the peer scenario runs what at: the transaction sizes
// of its drains, the rates of its latency runs; none when it is not
// measured.
func (b *bencher) peerSizes(what string) []int {
	switch {
	case !b.peerMeasures(what):
		return nil
	case what == "drain":
		return b.cfg.TxnSizes
	default:
		return b.cfg.PeerRates
	}
}

// collect lists each measurement's runs in order, each followed by their
// medians when there are several.
func collect(runs map[string][]Result, order []string) []Result {
	var out []Result
	for _, p := range order {
		out = append(out, runs[p]...)
		if len(runs[p]) > 1 {
			out = append(out, medians(runs[p]))
		}
	}
	return out
}

// newPeerRun makes a database with Debezium's outbox table, an
// insert-only publication, the contender's slot, and a consumer of its
// topic; then starts the contender and waits for a first row to arrive.
func (b *bencher) newPeerRun(ctx context.Context, brokers []string, name string) (*peerRun, error) {
	b.seq++
	db := fmt.Sprintf("peer_%d_%d", os.Getpid(), b.seq)
	url, err := devcluster.CreateDatabase(ctx, b.admin, db)
	if err != nil {
		return nil, err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, `
		CREATE TABLE outbox (
			id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
			aggregatetype varchar(255) NOT NULL,
			aggregateid varchar(255) NOT NULL,
			type varchar(255) NOT NULL,
			payload jsonb
		);
		CREATE PUBLICATION bench FOR TABLE outbox WITH (publish = 'insert');`); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	slotName := db
	if err := createSlot(ctx, conn, slotName); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	prefix := db + "."
	r := &peerRun{b: b, name: name, url: url, slot: slotName, conn: conn, topic: prefix + "outbox.event.bench", reads: map[int][]time.Time{}, appended: map[int]time.Time{}}
	switch name {
	case "walrelay":
		r.c = &walrelayPeer{b: b, url: url, slot: slotName, template: prefix + "outbox.event.{aggregate_type}", brokers: brokers}
	default:
		opts := debezium.Options{}
		if name == "debezium-tuned" {
			opts = debeziumTuned
		}
		opts.Brokers, opts.PGURL, opts.Slot, opts.Publication = brokers, url, slotName, "bench"
		opts.Tables = []string{"public.outbox"}
		opts.TopicReplacement = prefix + "outbox.event.${routedByValue}"
		r.c = &debeziumPeer{opts: opts}
	}
	// The topic exists before either contender runs, with the broker's
	// append time as record timestamp: after a kill, a record appended
	// after it is the new process's work (the contenders' own timestamps
	// differ: commit time, processing time).
	adm, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		r.close()
		return nil, err
	}
	_, err = kadm.NewClient(adm).CreateTopic(ctx, 3, -1, map[string]*string{"message.timestamp.type": kadm.StringPtr("LogAppendTime")}, r.topic)
	adm.Close()
	if err != nil {
		r.close()
		return nil, fmt.Errorf("create %s: %w", r.topic, err)
	}
	r.client, err = kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(r.topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(10*time.Millisecond),
		kgo.MetadataMinAge(100*time.Millisecond), kgo.MetadataMaxAge(time.Second))
	if err != nil {
		r.close()
		return nil, err
	}
	go r.consume(ctx)
	if err := r.c.start(); err != nil {
		r.close()
		return nil, err
	}
	// A first row (seq 0) proves the pipeline, creates the topic and warms
	// the JVM before anything is measured.
	if err := r.insert(ctx, conn, 0, 0); err != nil {
		r.close()
		return nil, err
	}
	if err := r.waitSeqs(0, 0, 5*time.Minute); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

func (r *peerRun) close() {
	if r.c != nil {
		r.c.kill()
		if d, ok := r.c.(*debeziumPeer); ok && d.c != nil {
			d.c.Close()
		}
	}
	if r.client != nil {
		r.client.Close()
	}
	// The killed walsender may take a moment to release the slot.
	for range 100 {
		if _, err := r.conn.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", r.slot); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.conn.Close(context.Background())
}

// consume records when each seq was read, as often as it is read.
func (r *peerRun) consume(ctx context.Context) {
	for {
		fs := r.client.PollFetches(ctx)
		if fs.IsClientClosed() || ctx.Err() != nil {
			return
		}
		now := time.Now()
		fs.EachRecord(func(rec *kgo.Record) {
			var p struct {
				Seq int `json:"seq"`
			}
			if json.Unmarshal(rec.Value, &p) != nil {
				return
			}
			r.mu.Lock()
			if r.first.IsZero() && p.Seq > 0 {
				r.first = now
			}
			r.reads[p.Seq] = append(r.reads[p.Seq], now)
			if _, ok := r.appended[p.Seq]; !ok {
				r.appended[p.Seq] = rec.Timestamp
			}
			f := r.onRead
			r.mu.Unlock()
			if f != nil {
				f(p.Seq, rec.Timestamp)
			}
		})
	}
}

// waitSeqs waits until every seq in lo..hi was read.
func (r *peerRun) waitSeqs(lo, hi int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		r.mu.Lock()
		missing := 0
		for s := lo; s <= hi; s++ {
			if len(r.reads[s]) == 0 {
				missing++
			}
		}
		r.mu.Unlock()
		if missing == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: %d of rows %d..%d not on %s after %s", r.name, missing, lo, hi, r.topic, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (r *peerRun) insert(ctx context.Context, conn *pgx.Conn, seq, padBytes int) error {
	_, err := conn.Exec(ctx, `INSERT INTO outbox (aggregatetype, aggregateid, type, payload)
		VALUES ('bench', $1, 'BenchEvent', jsonb_build_object('seq', $2::int, 'pad', repeat('x', $3::int)))`,
		fmt.Sprintf("key-%d", seq%1000), seq, padBytes)
	return err
}

// peerDrain: the contender streams, is stopped gracefully, a backlog of
// --events rows is written, the contender starts again. The drain rate is
// the broker's: the backlog's rows over the window from the first
// record's append time to the last's (the topic's timestamps are
// LogAppendTime), so neither the contender's start (a JVM's, a connector's
// snapshot of its offsets) nor the consumer's pace counts; the
// contender's CPU is over the same window (sampled when the consumer reads
// the first and the last record).
func (b *bencher) peerDrain(ctx context.Context, brokers []string, name string, txnSize int) (Result, error) {
	r, err := b.newPeerRun(ctx, brokers, name)
	if err != nil {
		return Result{}, err
	}
	defer r.close()
	r.c.stop()
	n := b.cfg.Events
	pad := max(b.cfg.PayloadBytes-30, 0)
	b.logf("peer %s: writing %d rows in transactions of %d", name, n, txnSize)
	if _, err := r.conn.Exec(ctx, fmt.Sprintf(`
		DO $$
		DECLARE i int := 1;
		BEGIN
			WHILE i <= %d LOOP
				INSERT INTO outbox (aggregatetype, aggregateid, type, payload)
				SELECT 'bench', 'key-' || ((i + g) %% 1000), 'BenchEvent', jsonb_build_object('seq', i + g, 'pad', repeat('x', %d))
				FROM generate_series(0, least(%d, %d - i + 1) - 1) g;
				COMMIT;
				i := i + %d;
			END LOOP;
		END $$`, n, pad, txnSize, n, txnSize)); err != nil {
		return Result{}, err
	}
	var cpuFirst time.Duration
	var firstOnce sync.Once
	started := time.Now()
	r.mu.Lock()
	r.onRead = func(seq int, _ time.Time) {
		if seq > 0 {
			firstOnce.Do(func() { cpuFirst, _ = cpuTime(r.c.pid()) })
		}
	}
	r.mu.Unlock()
	if err := r.c.start(); err != nil {
		return Result{}, err
	}
	if err := r.waitSeqs(1, n, 30*time.Minute); err != nil {
		return Result{}, err
	}
	cpuEnd, _ := cpuTime(r.c.pid())
	// The walsender streaming now started with the contender: its CPU
	// time is decoding the backlog (and a few idle seconds at most).
	ws, err := walsenderPID(ctx, r.conn, r.slot, time.Minute)
	if err != nil {
		return Result{}, err
	}
	wsEnd, err := cpuTime(ws)
	if err != nil {
		return Result{}, err
	}
	rss, _ := peakRSS(r.c.pid())
	r.mu.Lock()
	var first, last time.Time
	for s := 1; s <= n; s++ {
		t := r.appended[s]
		if first.IsZero() || t.Before(first) {
			first = t
		}
		if t.After(last) {
			last = t
		}
	}
	r.mu.Unlock()
	// Append times are in milliseconds: a window of none is one.
	window := max(last.Sub(first).Seconds(), 0.001)
	res := Result{
		Scenario: "peer-drain",
		Params:   fmt.Sprintf("peer=%s events=%d txn=%d payload=%dB", name, n, txnSize, b.cfg.PayloadBytes),
		Metrics: map[string]float64{
			"relay_events_per_s":           float64(n) / window,
			"first_record_s":               first.Sub(started).Seconds(),
			"relay_cpu_us_per_event":       float64((cpuEnd - cpuFirst).Microseconds()) / float64(n),
			"relay_walsender_us_per_event": float64(wsEnd.Microseconds()) / float64(n),
			"peak_rss_mb":                  float64(rss) / (1 << 20),
		},
	}
	b.logf("peer drain %s txn=%d: %.0f ev/s, peak RSS %.0f MiB", name, txnSize, res.Metrics["relay_events_per_s"], res.Metrics["peak_rss_mb"])
	return res, nil
}

// peerLoad commits one-row transactions at rate per second from four
// writers (synchronous commit) until stop is closed, numbering them from
// next; it returns each seq's commit time (when COMMIT returned).
type peerLoad struct {
	mu        sync.Mutex
	committed map[int]time.Time
	next      atomic.Int64
	stop      chan struct{}
	wg        sync.WaitGroup
	err       atomic.Value
}

func (r *peerRun) load(ctx context.Context, rate, padBytes int) *peerLoad {
	l := &peerLoad{committed: map[int]time.Time{}, stop: make(chan struct{})}
	const writers = 4
	for w := range writers {
		l.wg.Go(func() {
			wc, err := pgx.Connect(ctx, r.url)
			if err != nil {
				l.err.Store(err)
				return
			}
			defer wc.Close(context.Background())
			if _, err := wc.Exec(ctx, "SET synchronous_commit = on"); err != nil {
				l.err.Store(err)
				return
			}
			interval := time.Duration(float64(time.Second) * writers / float64(rate))
			next := time.Now().Add(time.Duration(w) * interval / writers)
			for {
				select {
				case <-l.stop:
					return
				default:
				}
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				}
				next = next.Add(interval)
				seq := int(l.next.Add(1))
				if err := r.insert(ctx, wc, seq, padBytes); err != nil {
					l.err.Store(err)
					return
				}
				now := time.Now()
				l.mu.Lock()
				l.committed[seq] = now
				l.mu.Unlock()
			}
		})
	}
	return l
}

// end stops the writers and returns the last seq committed.
func (l *peerLoad) end() (int, error) {
	close(l.stop)
	l.wg.Wait()
	if err, ok := l.err.Load().(error); ok {
		return 0, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	last := 0
	for s := range l.committed {
		last = max(last, s)
	}
	return last, nil
}

// peerLatency: writers at rate for --duration after a 2s warm-up; per row,
// from its COMMIT returning to the consumer reading it (the record
// timestamps differ between the two, so neither is used).
func (b *bencher) peerLatency(ctx context.Context, brokers []string, name string, rate int) (Result, error) {
	r, err := b.newPeerRun(ctx, brokers, name)
	if err != nil {
		return Result{}, err
	}
	defer r.close()
	l := r.load(ctx, rate, max(b.cfg.PayloadBytes-30, 0))
	warm := time.Now().Add(2 * time.Second)
	time.Sleep(time.Until(warm.Add(b.cfg.Duration)))
	last, err := l.end()
	if err != nil {
		return Result{}, err
	}
	if err := r.waitSeqs(1, last, 3*time.Minute); err != nil {
		return Result{}, err
	}
	rss, _ := peakRSS(r.c.pid())
	var lat []time.Duration
	r.mu.Lock()
	l.mu.Lock()
	measured := 0
	for s := 1; s <= last; s++ {
		c := l.committed[s]
		if c.Before(warm) {
			continue
		}
		measured++
		lat = append(lat, max(r.reads[s][0].Sub(c), 0))
	}
	l.mu.Unlock()
	r.mu.Unlock()
	if len(lat) == 0 {
		return Result{}, errors.New("no row measured")
	}
	slices.Sort(lat)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	res := Result{
		Scenario: "peer-latency",
		Params:   fmt.Sprintf("peer=%s rate=%d/s duration=%s", name, rate, b.cfg.Duration),
		Metrics: map[string]float64{
			"p50_ms":        ms(lat[len(lat)/2]),
			"p99_ms":        ms(lat[len(lat)*99/100]),
			"max_ms":        ms(lat[len(lat)-1]),
			"achieved_rate": float64(measured) / b.cfg.Duration.Seconds(),
			"events":        float64(measured),
			"peak_rss_mb":   float64(rss) / (1 << 20),
		},
	}
	b.logf("peer latency %s rate=%d: p50 %.1fms p99 %.1fms max %.1fms", name, rate, res.Metrics["p50_ms"], res.Metrics["p99_ms"], res.Metrics["max_ms"])
	return res, nil
}

// peerKill: writers at 1,000 rows/s; after 10s the contender is killed
// (SIGKILL) and started again at once; 15s later the writers stop. Time
// from the kill to the first row not read before it, and rows read twice.
func (b *bencher) peerKill(ctx context.Context, brokers []string, name string) (Result, error) {
	r, err := b.newPeerRun(ctx, brokers, name)
	if err != nil {
		return Result{}, err
	}
	defer r.close()
	l := r.load(ctx, 1000, max(b.cfg.PayloadBytes-30, 0))
	time.Sleep(10 * time.Second)
	r.mu.Lock()
	seenBefore := map[int]bool{}
	for s := range r.reads {
		seenBefore[s] = true
	}
	var firstNew time.Time
	var killed time.Time
	r.onRead = func(seq int, appended time.Time) {
		r.mu.Lock()
		defer r.mu.Unlock()
		if !seenBefore[seq] && firstNew.IsZero() && !killed.IsZero() && appended.After(killed) {
			firstNew = appended
		}
	}
	r.mu.Unlock()
	r.c.kill()
	r.mu.Lock()
	killed = time.Now() // the old process is gone: what is appended now is the new one's
	r.mu.Unlock()
	if err := r.c.start(); err != nil {
		return Result{}, err
	}
	time.Sleep(15 * time.Second)
	last, err := l.end()
	if err != nil {
		return Result{}, err
	}
	if err := r.waitSeqs(1, last, 5*time.Minute); err != nil {
		return Result{}, err
	}
	r.mu.Lock()
	twice := 0
	for s := 1; s <= last; s++ {
		twice += len(r.reads[s]) - 1
	}
	fn, k := firstNew, killed
	r.mu.Unlock()
	res := Result{
		Scenario: "peer-kill",
		Params:   fmt.Sprintf("peer=%s rate=1000/s kill -9 after 10s, restarted at once", name),
		Metrics: map[string]float64{
			"first_new_record_s": fn.Sub(k).Seconds(),
			"delivered_twice":    float64(twice),
			"events":             float64(last),
		},
	}
	b.logf("peer kill %s: first new record %.1fs after the kill, %d rows delivered twice of %d", name, res.Metrics["first_new_record_s"], twice, last)
	return res, nil
}
