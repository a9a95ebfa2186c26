package integration

// The inbox consumer's batches (a poll's records of one partition in one
// transaction) and its partitions handled in parallel, on real PostgreSQL
// and the suite's broker, with records produced straight to a topic (no
// relay): a handler failing in the middle of a batch, copies within and
// across batches, per-key order across parallel partitions, and a
// rebalance while batches are in flight. Each handler records its effect
// in a table of the test's; the transaction that wrote an effect is its
// row's xmin, so "one transaction" is read from the database itself.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/inbox"
)

// inboxWorld is one test's topic, dead-letter topic, consumer group and
// effects table.
type inboxWorld struct {
	e     *env
	db    *pgxpool.Pool
	topic string
	dlq   string
	group string
	prod  *kgo.Client
}

func newInboxWorld(t *testing.T, partitions int) *inboxWorld {
	e := newEnv(t)
	e.exec(inbox.DDL("inbox") + `
		CREATE TABLE effects (seq bigserial PRIMARY KEY, id text NOT NULL, key text NOT NULL, n int NOT NULL, part int NOT NULL, attempt int NOT NULL, who text NOT NULL DEFAULT '')`)
	db, err := pgxpool.New(e.ctx, e.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	w := &inboxWorld{e: e, db: db, topic: e.topic("events"), dlq: e.topicPrefix() + "dlq", group: e.name + "_g"}
	w.prod, err = kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.prod.Close)
	res, err := kadm.NewClient(w.prod).CreateTopics(e.ctx, int32(partitions), -1, nil, w.topic)
	if err == nil {
		err = res.Error()
	}
	if err == nil {
		res, err = kadm.NewClient(w.prod).CreateTopics(e.ctx, 1, -1, nil, w.dlq)
		if err == nil {
			err = res.Error()
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// event is a record to produce: its id header, key (one aggregate),
// sequence number within the key, and partition.
type event struct {
	id, key string
	n       int
	part    int32
}

// produce writes the events, in order.
func (w *inboxWorld) produce(evs ...event) {
	w.e.t.Helper()
	var recs []*kgo.Record
	for _, ev := range evs {
		recs = append(recs, &kgo.Record{Topic: w.topic, Partition: ev.part, Key: []byte(ev.key), Value: []byte(strconv.Itoa(ev.n)),
			Headers: []kgo.RecordHeader{{Key: "id", Value: []byte(ev.id)}}})
	}
	if err := w.prod.ProduceSync(w.e.ctx, recs...).FirstErr(); err != nil {
		w.e.t.Fatal(err)
	}
}

// apply records m's effect in tx.
func apply(ctx context.Context, tx pgx.Tx, m *inbox.Message) error { return applyBy("")(ctx, tx, m) }

// applyBy is apply recording who applied the effect.
func applyBy(who string) inbox.Handler {
	return func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		n, err := strconv.Atoi(string(m.Record.Value))
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, "INSERT INTO effects (id, key, n, part, attempt, who) VALUES ($1, $2, $3, $4, $5, $6)",
			m.ID, string(m.Record.Key), n, m.Record.Partition, m.Attempt, who)
		return err
	}
}

func (w *inboxWorld) config(reg prometheus.Registerer, extra ...kgo.Opt) inbox.Config {
	lvl := zap.WarnLevel
	if *verbose {
		lvl = zap.DebugLevel
	}
	return inbox.Config{
		Group:           w.group,
		Topics:          []string{w.topic},
		KafkaOptions:    append([]kgo.Opt{kgo.SeedBrokers(w.e.brokers...), kgo.FetchMaxWait(100 * time.Millisecond)}, extra...),
		DB:              w.db,
		DeadLetterTopic: w.dlq,
		RetryBackoff:    10 * time.Millisecond,
		MaxRetryBackoff: 100 * time.Millisecond,
		Logger:          zaptest.NewLogger(w.e.t, zaptest.Level(lvl)).Named("inbox"),
		Registerer:      reg,
	}
}

// start runs a consumer until the test ends; the registry has its
// metrics.
func (w *inboxWorld) start(cfg inbox.Config, h inbox.Handler) *prometheus.Registry {
	w.e.t.Helper()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	c, err := inbox.New(cfg, h)
	if err != nil {
		w.e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(w.e.ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	w.e.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			w.e.t.Errorf("Run: %v", err)
		}
	})
	return reg
}

func metric(reg *prometheus.Registry, name string) float64 { return sumValues(gathered(reg, name)) }

// batches is the number of batches the consumer of reg committed.
func batches(reg *prometheus.Registry) uint64 {
	mfs, _ := reg.Gather()
	var n uint64
	for _, mf := range mfs {
		if mf.GetName() == "inbox_batch_records" {
			for _, m := range mf.GetMetric() {
				n += m.GetHistogram().GetSampleCount()
			}
		}
	}
	return n
}

// waitEffects waits for n effects and the group's committed offsets at
// the end of the topic.
func (w *inboxWorld) waitEffects(n int) {
	w.e.t.Helper()
	w.e.waitFor(fmt.Sprintf("%d effects and the group drained", n), time.Minute, func() (bool, error) {
		var got int
		if err := w.db.QueryRow(w.e.ctx, "SELECT count(*) FROM effects").Scan(&got); err != nil {
			return false, err
		}
		lag, err := w.lag()
		return got == n && lag == 0, fmt.Errorf("%d effects, group lag %d (err %v)", got, lag, err)
	})
}

func (w *inboxWorld) lag() (int64, error) {
	adm := kadm.NewClient(w.prod)
	ends, err := adm.ListEndOffsets(w.e.ctx, w.topic)
	if err != nil {
		return 0, err
	}
	committed, err := adm.FetchOffsets(w.e.ctx, w.group)
	if err != nil {
		return 0, err
	}
	var lag int64
	ends.Each(func(o kadm.ListedOffset) {
		at := int64(0)
		if c, ok := committed.Lookup(o.Topic, o.Partition); ok {
			at = c.At
		}
		lag += o.Offset - at
	})
	return lag, nil
}

// effectsOf lists the effects' ids, the ids repeated, and the number of
// transactions that wrote them (distinct xmin), of the ids given (all
// when none), in the order they were written.
func (w *inboxWorld) effectsOf(ids ...string) (got []string, txns int) {
	w.e.t.Helper()
	rows, err := w.db.Query(w.e.ctx, "SELECT id, xmin::text FROM effects WHERE coalesce(cardinality($1::text[]), 0) = 0 OR id = ANY($1) ORDER BY seq", ids)
	if err != nil {
		w.e.t.Fatal(err)
	}
	xids := map[string]bool{}
	for rows.Next() {
		var id, xid string
		if err := rows.Scan(&id, &xid); err != nil {
			w.e.t.Fatal(err)
		}
		got = append(got, id)
		xids[xid] = true
	}
	if err := rows.Err(); err != nil {
		w.e.t.Fatal(err)
	}
	return got, len(xids)
}

func ids(prefix string, from, to int) []string {
	var out []string
	for i := from; i < to; i++ {
		out = append(out, fmt.Sprintf("%s%02d", prefix, i))
	}
	return out
}

// TestInboxBatchHandlerFailsInTheMiddle: thirty records of one key wait
// on one partition when the consumer starts, so its first batch holds
// them all. The handler fails for good at the 11th (e10) and once at the
// 21st (e20). The records before e10 commit in one transaction without
// it, e10 is dead-lettered after its attempts, the records between the
// two failures commit in one transaction, e20 commits alone at its
// second attempt, and the records after it in one more: every other
// record's effect once, in offset order, and the attempts, failures and
// dead letter as for records handled one by one.
func TestInboxBatchHandlerFailsInTheMiddle(t *testing.T) {
	w := newInboxWorld(t, 1)
	var evs []event
	for i, id := range ids("e", 0, 30) {
		evs = append(evs, event{id: id, key: "k", n: i})
	}
	w.produce(evs...)
	cfg := w.config(nil)
	cfg.MaxAttempts = 3
	var mu sync.Mutex
	calls := map[string][]int{} // attempts seen per id
	reg := w.start(cfg, func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		mu.Lock()
		calls[m.ID] = append(calls[m.ID], m.Attempt)
		mu.Unlock()
		switch {
		case m.ID == "e10":
			return errors.New("poison: cannot apply e10")
		case m.ID == "e20" && m.Attempt == 1:
			return errors.New("e20 fails once")
		}
		return apply(ctx, tx, m)
	})
	w.waitEffects(29)
	dl := w.deadLetters(1)

	got, _ := w.effectsOf()
	want := slices.DeleteFunc(ids("e", 0, 30), func(id string) bool { return id == "e10" })
	if !slices.Equal(got, want) {
		t.Errorf("effects %v, want every record but e10 once, in offset order", got)
	}
	for _, span := range [][2]int{{0, 10}, {11, 20}, {21, 30}} {
		if _, txns := w.effectsOf(ids("e", span[0], span[1])...); txns != 1 {
			t.Errorf("the effects of e%02d to e%02d were written by %d transactions, want 1 (a batch)", span[0], span[1]-1, txns)
		}
	}
	if _, txns := w.effectsOf("e20"); txns != 1 {
		t.Errorf("e20: %d transactions", txns)
	}
	var attempt int
	if err := w.db.QueryRow(w.e.ctx, "SELECT attempt FROM effects WHERE id = 'e20'").Scan(&attempt); err != nil || attempt != 2 {
		t.Errorf("e20 applied at attempt %d (%v), want 2", attempt, err)
	}
	if h, _ := header(dl[0], "id"); h != "e10" {
		t.Errorf("dead letter of %q, want e10", h)
	}
	if a, _ := header(dl[0], "inbox.attempts"); a != "3" {
		t.Errorf("e10 dead-lettered after %s attempts, want 3", a)
	}
	mu.Lock()
	if !slices.Equal(calls["e10"], []int{1, 2, 3}) || !slices.Equal(calls["e20"], []int{1, 2}) {
		t.Errorf("attempts: e10 %v, e20 %v; want 1 2 3 and 1 2", calls["e10"], calls["e20"])
	}
	mu.Unlock()
	if f, d, p := metric(reg, "inbox_handler_failures_total"), metric(reg, "inbox_dead_lettered_total"), metric(reg, "inbox_processed_total"); f != 4 || d != 1 || p != 29 {
		t.Errorf("failures %.0f, dead-lettered %.0f, processed %.0f; want 4, 1 and 29", f, d, p)
	}
	var outcome string
	if err := w.db.QueryRow(w.e.ctx, "SELECT outcome FROM inbox WHERE message_id = 'e10'").Scan(&outcome); err != nil || outcome != "dead-lettered" {
		t.Errorf("e10's inbox row: %q, %v", outcome, err)
	}
	_, txns := w.effectsOf()
	t.Logf("29 effects in %d transactions around a poison record and a record failing once; %d batches committed", txns, batches(reg))
}

// deadLetters waits for n records on the dead-letter topic.
func (w *inboxWorld) deadLetters(n int) []*kgo.Record {
	w.e.t.Helper()
	var got []*kgo.Record
	var mu sync.Mutex
	w.e.poll(func(fs kgo.Fetches) {
		mu.Lock()
		defer mu.Unlock()
		fs.EachRecord(func(r *kgo.Record) { got = append(got, r) })
	}, kgo.ConsumeTopics(w.dlq))
	w.e.waitFor(fmt.Sprintf("%d dead letters", n), time.Minute, func() (bool, error) {
		mu.Lock()
		defer mu.Unlock()
		return len(got) >= n, nil
	})
	mu.Lock()
	defer mu.Unlock()
	return slices.Clone(got)
}

// TestInboxBatchDuplicates: copies of a message in the same batch and in
// a later one (a relay's resend, two relays) are skipped: one effect and
// one handler call per id, and each copy counted as a duplicate.
func TestInboxBatchDuplicates(t *testing.T) {
	w := newInboxWorld(t, 1)
	first := []event{{id: "a"}, {id: "b"}, {id: "c"}, {id: "c"}, {id: "d"}, {id: "e"}, {id: "b"}, {id: "f"}}
	for i := range first {
		first[i].key, first[i].n = "k", i
	}
	w.produce(first...)
	var mu sync.Mutex
	calls := map[string]int{}
	reg := w.start(w.config(nil), func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		mu.Lock()
		calls[m.ID]++
		mu.Unlock()
		return apply(ctx, tx, m)
	})
	w.waitEffects(6)
	// Copies of messages handled in the batch before, and a copy within
	// this one.
	second := []event{{id: "a"}, {id: "g"}, {id: "e"}, {id: "h"}, {id: "h"}, {id: "i"}}
	for i := range second {
		second[i].key, second[i].n = "k", 10+i
	}
	w.produce(second...)
	w.waitEffects(9)

	got, _ := w.effectsOf()
	if want := []string{"a", "b", "c", "d", "e", "f", "g", "h", "i"}; !slices.Equal(got, want) {
		t.Errorf("effects %v, want %v: one per id, in offset order", got, want)
	}
	mu.Lock()
	for id, n := range calls {
		if n != 1 {
			t.Errorf("the handler of %s ran %d times, want once", id, n)
		}
	}
	mu.Unlock()
	if d, p := metric(reg, "inbox_duplicates_total"), metric(reg, "inbox_processed_total"); d != 5 || p != 9 {
		t.Errorf("duplicates %.0f, processed %.0f; want 5 (2 within the first batch, 2 across, 1 within the second) and 9", d, p)
	}
}

// TestInboxPartitionsInParallelKeepKeyOrder: 16 keys of 25 events each on
// 8 partitions. The first handler call waits until a handler of another
// partition runs beside it, which only happens if partitions are handled
// at once; each key's events are applied once each, in order.
func TestInboxPartitionsInParallelKeepKeyOrder(t *testing.T) {
	const parts, keys, each = 8, 16, 25
	w := newInboxWorld(t, parts)
	var evs []event
	for n := range each {
		for k := range keys {
			evs = append(evs, event{id: fmt.Sprintf("k%02d-%02d", k, n), key: fmt.Sprintf("k%02d", k), n: n, part: int32(k % parts)})
		}
	}
	w.produce(evs...)
	var firstPart atomic.Int32
	firstPart.Store(-1)
	other := make(chan struct{})
	var otherOnce sync.Once
	var parallel atomic.Bool
	w.start(w.config(nil), func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		p := m.Record.Partition
		if firstPart.CompareAndSwap(-1, p) {
			select {
			case <-other:
				parallel.Store(true)
			case <-time.After(10 * time.Second):
			case <-ctx.Done():
			}
		} else if p != firstPart.Load() {
			otherOnce.Do(func() { close(other) })
		}
		return apply(ctx, tx, m)
	})
	w.waitEffects(keys * each)
	if !parallel.Load() {
		t.Error("no handler of another partition ran while the first one waited 10s: partitions are handled one at a time")
	}
	rows, err := w.db.Query(w.e.ctx, "SELECT key, n FROM effects ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string][]int{}
	for rows.Next() {
		var key string
		var n int
		if err := rows.Scan(&key, &n); err != nil {
			t.Fatal(err)
		}
		seen[key] = append(seen[key], n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := make([]int, each)
	for i := range want {
		want[i] = i
	}
	for k := range keys {
		key := fmt.Sprintf("k%02d", k)
		if !slices.Equal(seen[key], want) {
			t.Errorf("key %s applied %v, want 0 to %d once each, in order", key, seen[key], each-1)
		}
	}
}

// TestInboxRebalanceMidBatch: consumer A handles a batch on each of two
// partitions, each held after five of its records, when consumer B joins
// the group. With the default cooperative balancer the partition B is to
// get is first taken from A alone, and A's revoke of it waits for its
// batch in flight: the hold ends while the group is in that state (two
// members, the partition assigned to neither). The batch commits (the
// records held are A's effects, not abandoned), A commits its offset,
// and B starts after A's effects: it meets no record A handled (no
// duplicate, no rewind), and every record has one effect.
func TestInboxRebalanceMidBatch(t *testing.T) {
	w := newInboxWorld(t, 2)
	batch := func(from, to int) []event {
		var evs []event
		for n := from; n < to; n++ {
			for p := range int32(2) {
				evs = append(evs, event{id: fmt.Sprintf("p%d-%03d", p, n), key: fmt.Sprintf("p%d", p), n: n, part: p})
			}
		}
		return evs
	}
	w.produce(batch(0, 50)...)
	group := []kgo.Opt{kgo.SessionTimeout(10 * time.Second), kgo.RebalanceTimeout(30 * time.Second), kgo.HeartbeatInterval(100 * time.Millisecond)}
	held := make(chan struct{})
	var holding atomic.Int32
	var release sync.Once
	t.Cleanup(func() { release.Do(func() { close(held) }) })
	regA := w.start(w.config(nil, group...), func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		if strings.HasSuffix(m.ID, "-005") {
			holding.Add(1)
			select {
			case <-held:
			case <-ctx.Done():
			}
		}
		return applyBy("A")(ctx, tx, m)
	})
	w.e.waitFor("A holding a batch on each partition", time.Minute, func() (bool, error) { return holding.Load() == 2, nil })
	regB := w.start(w.config(nil, group...), applyBy("B"))
	adm := kadm.NewClient(w.prod)
	assigned := func() (members, partitions int, state string, err error) {
		described, err := adm.DescribeGroups(w.e.ctx, w.group)
		if err != nil {
			return 0, 0, "", err
		}
		g := described[w.group]
		for _, m := range g.Members {
			if ca, ok := m.Assigned.AsConsumer(); ok {
				for _, tp := range ca.Topics {
					partitions += len(tp.Partitions)
				}
			}
		}
		return len(g.Members), partitions, g.State, nil
	}
	w.e.waitFor("a partition taken from A and not given to B yet", time.Minute, func() (bool, error) {
		m, p, state, err := assigned()
		return err == nil && state == "Stable" && m == 2 && p == 1, fmt.Errorf("state %s, %d members, %d partitions assigned (%v)", state, m, p, err)
	})
	release.Do(func() { close(held) })
	w.e.waitFor("B given the partition", time.Minute, func() (bool, error) {
		m, p, state, err := assigned()
		return err == nil && state == "Stable" && m == 2 && p == 2, nil
	})
	w.produce(batch(50, 70)...)
	w.waitEffects(140)
	got, _ := w.effectsOf()
	if len(got) != 140 || len(distinct(got)) != 140 {
		t.Errorf("%d effects of %d ids, want 140 of 140", len(got), len(distinct(got)))
	}
	var byA int
	if err := w.db.QueryRow(w.e.ctx, "SELECT count(*) FROM effects WHERE id LIKE '%-005' AND who = 'A'").Scan(&byA); err != nil || byA != 2 {
		t.Errorf("A applied %d of the two records it held (%v), want both: its batches in flight commit before the revoke, not abandoned", byA, err)
	}
	if d, r, p := metric(regB, "inbox_duplicates_total"), metric(regB, "inbox_rewinds_total"), metric(regB, "inbox_processed_total"); d != 0 || r != 0 || p == 0 {
		t.Errorf("B: %.0f duplicates, %.0f rewinds, %.0f processed; want no duplicate nor rewind: it starts after A's batches", d, r, p)
	}
	t.Logf("A processed %.0f, B %.0f", metric(regA, "inbox_processed_total"), metric(regB, "inbox_processed_total"))
}

func distinct(ids []string) map[string]bool {
	m := map[string]bool{}
	for _, id := range ids {
		m[id] = true
	}
	return m
}
