package integration

// The whole chain: an order service writing with the outbox package,
// walrelay, and a ledger consumer using the inbox package (all from
// examples/orders), under a failure of each part. Every test ends with the
// ledger compared with the orders table: one ledger row per committed
// order event, per order in version order (shop.Check).

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/examples/orders/shop"
	"github.com/walrelay/walrelay/inbox"
	"github.com/walrelay/walrelay/outbox"
)

// chain is one test's order service, topics and consumer group.
type chain struct {
	e     *env
	db    *pgxpool.Pool
	svc   *shop.Service
	topic string // the order events
	dlq   string // the ledger consumer's dead letters
	group string
	// transactional: the event topic is written in Kafka transactions
	// (exactly-once delivery): groupLag allows each partition the commit
	// marker after its last record, which no consumer commits past.
	transactional bool
}

func newChain(t *testing.T) *chain { return newChainOn(newEnv(t)) }

func newChainOn(e *env) *chain {
	e.t.Helper()
	e.exec("DROP TABLE outbox")
	e.exec(shop.Schema())
	db, err := pgxpool.New(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(db.Close)
	return &chain{e: e, db: db, svc: shop.NewService(db), topic: e.topic("order"), dlq: e.topicPrefix() + "ledger.dlq", group: e.name + "_ledger"}
}

// createTopics creates the event and dead-letter topics, so consumers
// can start before the relay's first event.
func (ch *chain) createTopics() {
	ch.e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(ch.e.brokers...))
	if err != nil {
		ch.e.t.Fatal(err)
	}
	defer cl.Close()
	res, err := kadm.NewClient(cl).CreateTopics(ch.e.ctx, 3, -1, nil, ch.topic, ch.dlq)
	if err == nil {
		err = res.Error()
	}
	if err != nil && !strings.Contains(err.Error(), "TOPIC_ALREADY_EXISTS") {
		ch.e.t.Fatal(err)
	}
}

// ledgerConsumer is an in-process inbox.Consumer.
type ledgerConsumer struct {
	reg    *prometheus.Registry
	cancel context.CancelFunc
	done   chan error
}

func (ch *chain) consumerConfig(reg prometheus.Registerer, extra ...kgo.Opt) inbox.Config {
	lvl := zap.WarnLevel
	if *verbose {
		lvl = zap.DebugLevel
	}
	return inbox.Config{
		Group:           ch.group,
		Topics:          []string{ch.topic},
		KafkaOptions:    append([]kgo.Opt{kgo.SeedBrokers(ch.e.brokers...), kgo.FetchMaxWait(100 * time.Millisecond)}, extra...),
		DB:              ch.db,
		Table:           shop.InboxTable,
		DeadLetterTopic: ch.dlq,
		RetryBackoff:    10 * time.Millisecond,
		MaxRetryBackoff: 200 * time.Millisecond,
		Logger:          zaptest.NewLogger(ch.e.t, zaptest.Level(lvl)).Named("inbox"),
		Registerer:      reg,
	}
}

// startConsumer runs a ledger consumer until the test ends (or stop).
func (ch *chain) startConsumer(cfg inbox.Config, h inbox.Handler) *ledgerConsumer {
	ch.e.t.Helper()
	if h == nil {
		h = shop.ApplyToLedger
	}
	c, err := inbox.New(cfg, h)
	if err != nil {
		ch.e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ch.e.ctx)
	lc := &ledgerConsumer{cancel: cancel, done: make(chan error, 1)}
	lc.reg, _ = cfg.Registerer.(*prometheus.Registry)
	go func() { lc.done <- c.Run(ctx) }()
	ch.e.t.Cleanup(lc.stop)
	return lc
}

func (ch *chain) startLedger() *ledgerConsumer {
	reg := prometheus.NewRegistry()
	return ch.startConsumer(ch.consumerConfig(reg), nil)
}

func (lc *ledgerConsumer) stop() {
	lc.cancel()
	err := <-lc.done
	lc.done <- err
}

func (lc *ledgerConsumer) running() bool {
	select {
	case err := <-lc.done:
		lc.done <- err
		return false
	default:
		return true
	}
}

func (lc *ledgerConsumer) metric(name string) float64 { return sumValues(gathered(lc.reg, name)) }

// writeOrders places n orders and moves each to paid and shipped (three
// events per order).
func (ch *chain) writeOrders(n int) {
	ch.e.t.Helper()
	for range n {
		id, err := ch.svc.Place(ch.e.ctx, "alice", 1250)
		if err != nil {
			ch.e.t.Fatal(err)
		}
		for range 2 {
			if _, err := ch.svc.Advance(ch.e.ctx, id); err != nil {
				ch.e.t.Fatal(err)
			}
		}
	}
}

// publishOrders starts a relay and writes n orders (three events each),
// and returns once all their records are on the event topic: what a
// consumer test starts from.
func (ch *chain) publishOrders(n int) {
	ch.e.t.Helper()
	ch.createTopics()
	ch.e.startRelay(ch.e.config())
	raw := ch.e.consume()
	ch.writeOrders(n)
	raw.waitIDs(3*n, time.Minute)
}

// events is the number of order events committed: the sum of the orders'
// versions.
func (ch *chain) events() int {
	ch.e.t.Helper()
	var n int
	if err := ch.db.QueryRow(ch.e.ctx, "SELECT coalesce(sum(version), 0) FROM orders").Scan(&n); err != nil {
		ch.e.t.Fatal(err)
	}
	return n
}

func (ch *chain) ledgerRows() int {
	ch.e.t.Helper()
	var n int
	if err := ch.db.QueryRow(ch.e.ctx, "SELECT count(*) FROM ledger").Scan(&n); err != nil {
		ch.e.t.Fatal(err)
	}
	return n
}

// waitLedger waits until the consumer group has consumed the whole event
// topic (committed offsets at the end offsets) and the ledger matches the
// orders, and returns the number of ledger rows. Checking after the
// group drained catches a duplicate effect that would come late.
func (ch *chain) waitLedger(timeout time.Duration) int {
	ch.e.t.Helper()
	want := ch.events()
	if want == 0 {
		ch.e.t.Fatal("no order events were committed: the test wrote nothing")
	}
	var rows int
	var problems []string
	ch.e.waitFor("the ledger to match the orders with the group drained", timeout, func() (bool, error) {
		lag, err := ch.groupLag()
		if err != nil {
			return false, err
		}
		rows, problems, err = shop.Check(ch.e.ctx, ch.db)
		if err != nil {
			return false, err
		}
		return lag == 0 && len(problems) == 0, fmt.Errorf("group lag %d, %d ledger rows for %d events, %d differences: %.400s", lag, rows, want, len(problems), strings.Join(problems, "; "))
	})
	if rows != want {
		ch.e.t.Fatalf("%d ledger rows for %d events", rows, want)
	}
	return rows
}

// groupLag is the number of records of the event topic after the group's
// committed offsets.
func (ch *chain) groupLag() (int64, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(ch.e.brokers...))
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(ch.e.ctx, 5*time.Second)
	defer cancel()
	ends, err := adm.ListEndOffsets(ctx, ch.topic)
	if err != nil {
		return 0, err
	}
	committed, err := adm.FetchOffsets(ctx, ch.group)
	if err != nil {
		return 0, err
	}
	var lag int64
	ends.Each(func(o kadm.ListedOffset) {
		at := int64(0)
		if c, ok := committed.Lookup(o.Topic, o.Partition); ok {
			at = c.At
		}
		if ch.transactional && o.Offset-at == 1 {
			return // the commit marker after the partition's last record
		}
		lag += o.Offset - at
	})
	return lag, nil
}

// committedOffsets is the sum of the group's committed offsets.
func (ch *chain) committedOffsets() int64 {
	ch.e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(ch.e.brokers...))
	if err != nil {
		ch.e.t.Fatal(err)
	}
	defer cl.Close()
	committed, err := kadm.NewClient(cl).FetchOffsets(ch.e.ctx, ch.group)
	if err != nil {
		ch.e.t.Fatal(err)
	}
	var n int64
	committed.Each(func(o kadm.OffsetResponse) { n += o.At })
	return n
}

var (
	exampleOnce sync.Once
	examplePath string
	exampleErr  error
)

// exampleBinary is the path of the examples/orders binary, built once
// beside the walrelay binary.
func exampleBinary() (string, error) {
	exampleOnce.Do(func() {
		examplePath = filepath.Join(filepath.Dir(binPath), "orders")
		out, err := exec.Command("go", "build", "-o", examplePath, "github.com/walrelay/walrelay/examples/orders").CombinedOutput()
		if err != nil {
			exampleErr = fmt.Errorf("build examples/orders: %v\n%s", err, out)
		}
	})
	return examplePath, exampleErr
}

// runExample starts the examples/orders binary (built once) with args;
// its output goes to the test log.
func (e *env) runExample(args ...string) *exec.Cmd {
	e.t.Helper()
	path, err := exampleBinary()
	if err != nil {
		e.t.Fatal(err)
	}
	cmd := exec.Command(path, args...)
	w := &testWriter{t: e.t, prefix: "orders " + args[0] + ": "}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd
}

// consumeArgs are the example's consume flags for this chain.
func (ch *chain) consumeArgs(extra ...string) []string {
	return append([]string{"consume", "-pg-url", ch.e.url, "-brokers", strings.Join(ch.e.brokers, ","), "-topic", ch.topic,
		"-group", ch.group, "-dead-letter-topic", ch.dlq, "-session-timeout", "6s"}, extra...)
}

// watched is a process the soak watches: it notices one that exits by
// itself.
type watched struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the process exited
	err  error         // Wait's result, set before done closes
}

// watch waits for cmd in the background. Its cleanup (which runs before
// the one of runBinary or runExample, registered earlier) kills the
// process and waits for it, so that the harness finds it reaped.
func watch(t *testing.T, cmd *exec.Cmd) *watched {
	p := &watched{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(p.kill)
	return p
}

func (p *watched) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

func (p *watched) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

func kill(cmd *exec.Cmd) {
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
}

// TestChainOrderCommitFails: an order whose COMMIT fails (a deferred
// foreign key checked at commit) after its outbox row was written leaves
// no event: the topic only ever holds the good order's events, and the
// ledger only that order.
func TestChainOrderCommitFails(t *testing.T) {
	ch := newChain(t)
	ch.e.exec(`CREATE TABLE customers (name text PRIMARY KEY); INSERT INTO customers VALUES ('alice');
		ALTER TABLE orders ADD CONSTRAINT orders_customer_fk FOREIGN KEY (customer) REFERENCES customers DEFERRABLE INITIALLY DEFERRED`)
	ch.createTopics()
	ch.e.startRelay(ch.e.config())
	ch.startLedger()
	raw := ch.e.consume()

	if _, err := ch.svc.Place(ch.e.ctx, "mallory", 500); err == nil || !strings.Contains(err.Error(), "orders_customer_fk") {
		t.Fatalf("placing an order for an unknown customer: %v, want the commit to fail on orders_customer_fk", err)
	}
	ch.writeOrders(1)
	rows := ch.waitLedger(time.Minute)
	var id int64
	if err := ch.db.QueryRow(ch.e.ctx, "SELECT id FROM orders").Scan(&id); err != nil {
		t.Fatal(err)
	}
	recs := raw.waitIDs(3, time.Minute)
	for _, r := range recs {
		if string(r.Key) != fmt.Sprint(id) || r.Topic != ch.topic {
			t.Errorf("record on %s with key %s: only the events of order %d were committed", r.Topic, r.Key, id)
		}
	}
	if n := len(distinctIDs(recs)); n != 3 {
		t.Errorf("%d distinct event ids on the topics, want the good order's 3", n)
	}
	t.Logf("the failed commit left no event; order %d: %d ledger rows, %d records", id, rows, len(recs))
}

// TestChainWriterKilledAfterCommit kills the order service (the example's
// writer process, SIGKILL) in the middle of its writes: every event it
// committed before dying reaches the ledger, once.
func TestChainWriterKilledAfterCommit(t *testing.T) {
	ch := newChain(t)
	ch.createTopics()
	ch.e.startRelay(ch.e.config())
	ch.startLedger()
	w := ch.e.runExample("write", "-pg-url", ch.e.url, "-pause", "2ms")
	ch.e.waitFor("the writer to commit 30 events", time.Minute, func() (bool, error) {
		return ch.events() >= 30, nil
	})
	kill(w)
	events := ch.events()
	rows := ch.waitLedger(time.Minute)
	var unfinished int
	_ = ch.db.QueryRow(ch.e.ctx, "SELECT count(*) FROM orders WHERE status <> 'shipped'").Scan(&unfinished)
	t.Logf("writer killed after %d committed events (%d orders not shipped yet); ledger %d rows", events, unfinished, rows)
}

// TestChainBrokerDown stops the broker for 3 seconds while orders go on
// being written: their events are late, not lost; relay and consumer
// (neither restarted) deliver and apply them once the broker is back.
func TestChainBrokerDown(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	b := startKafkaAt(t)
	e.brokers = []string{b.addr()}
	ch := newChainOn(e)
	ch.createTopics()
	rr := e.startRelay(e.config())
	lc := ch.startLedger()
	ch.writeOrders(5)
	ch.waitLedger(time.Minute)

	b.stop()
	ch.writeOrders(5)
	time.Sleep(3 * time.Second) // the outage
	behind := ch.events() - ch.ledgerRows()
	b.start()
	rows := ch.waitLedger(2 * time.Minute)
	if behind == 0 {
		t.Error("the ledger caught up while the broker was down: the outage was not in the path")
	}
	if ok, err := rr.returned(); ok {
		t.Errorf("the relay stopped: %v", err)
	}
	if !lc.running() {
		t.Error("the consumer stopped")
	}
	t.Logf("%d events behind during the 3s outage; drained after restart, ledger %d rows", behind, rows)
}

// TestChainRelayKilledBeforeConfirm kills the walrelay binary (SIGKILL)
// after it published events and before it confirmed them to PostgreSQL
// (checked on the slot after the kill); the restarted relay publishes them
// again and the inbox applies each once.
func TestChainRelayKilledBeforeConfirm(t *testing.T) {
	ch := newChain(t)
	ch.createTopics()
	// Confirm rarely, so that a kill right after publishing falls before
	// the confirmation (the server still asks for a reply every 5s).
	args := replaceFlag(ch.e.args(), "--status-interval", "8s")
	slow := slices.Concat(args, []string{"--confirm-delay", "8s"})
	cmd := ch.e.runBinary(slow...)
	ch.e.waitFor("slot active", 60*time.Second, func() (bool, error) {
		i, err := ch.e.slotInfoErr()
		return err == nil && i.Active, err
	})
	lc := ch.startLedger()
	raw := ch.e.consume()
	conn := ch.e.conn()
	caught := false
	for try := 0; try < 5 && !caught; try++ {
		ch.writeOrders(3)
		end := ch.e.currentLSN(conn)
		raw.waitIDs(ch.events(), time.Minute)
		kill(cmd)
		if got := ch.e.slotInfo().ConfirmedLSN; got < end {
			caught = true
			t.Logf("try %d: relay killed with %d events published, slot confirmed %s < %s", try+1, ch.events(), got, end)
			break
		}
		cmd = ch.e.runBinary(slow...)
	}
	if !caught {
		t.Fatal("in 5 tries the relay had always confirmed before the kill")
	}
	ch.e.runBinary(args...)
	ch.e.waitFor("a duplicate delivery", time.Minute, func() (bool, error) {
		for _, n := range distinctIDs(raw.records()) {
			if n > 1 {
				return true, nil
			}
		}
		return false, nil
	})
	rows := ch.waitLedger(time.Minute)
	dups := lc.metric("inbox_duplicates_total")
	if dups == 0 {
		t.Error("inbox_duplicates_total is 0 although copies were delivered")
	}
	t.Logf("%d records for %d events, inbox skipped %.0f duplicates, ledger %d rows", len(raw.records()), ch.events(), dups, rows)
}

// replaceFlag sets flag's value in args.
func replaceFlag(args []string, flag, value string) []string {
	out := append([]string(nil), args...)
	for i := range out {
		if out[i] == flag && i+1 < len(out) {
			out[i+1] = value
		}
	}
	return out
}

// TestChainConsumerKilledBeforeOffsetCommit kills a consumer process (the
// example's, SIGKILL) in the middle of a batch: its effects are
// committed, the batch's Kafka offsets are not (checked after the kill).
// A new consumer of the group starts from the position in the database,
// which moved with the effects: it does not even see those records again.
func TestChainConsumerKilledBeforeOffsetCommit(t *testing.T) {
	ch := newChain(t)
	ch.publishOrders(30)
	p := ch.e.runExample(ch.consumeArgs("-handler-delay", "20ms")...)
	ch.e.waitFor("20 ledger rows", time.Minute, func() (bool, error) { return ch.ledgerRows() >= 20, nil })
	kill(p)
	effects := ch.ledgerRows()
	committed := ch.committedOffsets()
	if committed >= int64(effects) {
		t.Fatalf("at the kill %d offsets were committed for %d effects: the kill did not fall between an effect and its offset commit", committed, effects)
	}
	lc := ch.startLedger()
	rows := ch.waitLedger(time.Minute)
	dups := lc.metric("inbox_duplicates_total")
	if dups != 0 {
		t.Errorf("inbox_duplicates_total %.0f, want 0: the next consumer should start after the %d records applied, not at the %d committed offsets", dups, effects, committed)
	}
	t.Logf("killed with %d effects and %d committed offsets; the next consumer started after the effects (%.0f duplicates); ledger %d rows", effects, committed, dups, rows)
}

// TestChainConcurrentCopiesDuringRebalance: consumer A holds a record's
// transaction open (its handler blocks) when consumer B joins the group;
// the rebalance (eager: every partition revoked, as the range and
// round-robin balancers do) waits for A's batch in flight, so A cannot
// take part in it in time, the group gives B the partition and B handles
// the same record at the same time, its inbox INSERT waiting on A's (seen
// in pg_locks). When A commits, B's copy is a duplicate: one effect.
// (With the default cooperative balancer A keeps the partitions B does
// not take, and answers the rebalance unless B takes the held one.)
func TestChainConcurrentCopiesDuringRebalance(t *testing.T) {
	ch := newChain(t)
	ch.createTopics()
	ch.e.startRelay(ch.e.config())
	group := []kgo.Opt{kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(2 * time.Second), kgo.HeartbeatInterval(200 * time.Millisecond),
		kgo.Balancers(kgo.RoundRobinBalancer())}
	entered, release := make(chan string, 1), make(chan struct{})
	var once sync.Once
	a := ch.startConsumer(ch.consumerConfig(prometheus.NewRegistry(), group...), func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		first := false
		once.Do(func() { first = true })
		if first {
			entered <- m.ID
			select {
			case <-release:
			case <-ctx.Done(): // the test failed and stops A
			}
		}
		return shop.ApplyToLedger(ctx, tx, m)
	})
	ch.writeOrders(1)
	var held string
	select {
	case held = <-entered:
	case <-time.After(time.Minute):
		t.Fatal("consumer A did not get a record")
	}
	b := ch.startConsumer(ch.consumerConfig(prometheus.NewRegistry(), group...), nil)
	ch.e.waitFor("B's inbox INSERT of the same record waiting on A's transaction", time.Minute, func() (bool, error) {
		var waiting int
		err := ch.db.QueryRow(ch.e.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO "inbox"%'`).Scan(&waiting)
		return waiting > 0, err
	})
	close(release)
	rows := ch.waitLedger(time.Minute)
	if d := b.metric("inbox_duplicates_total"); d < 1 {
		t.Errorf("B counted %.0f duplicates, want its copy of %s skipped", d, held)
	}
	t.Logf("A held %s while B took over; A processed %.0f, B processed %.0f and skipped %.0f; ledger %d rows",
		held, a.metric("inbox_processed_total"), b.metric("inbox_processed_total"), b.metric("inbox_duplicates_total"), rows)
}

// TestChainPoisonRecord: an event the handler cannot apply is tried
// MaxAttempts times, then goes to the dead-letter topic with the reason,
// the error and the attempt count; the events after it on the same
// partition (the same order) are applied.
func TestChainPoisonRecord(t *testing.T) {
	ch := newChain(t)
	ch.createTopics()
	ch.e.startRelay(ch.e.config())
	cfg := ch.consumerConfig(prometheus.NewRegistry())
	cfg.MaxAttempts = 3
	lc := ch.startConsumer(cfg, nil)
	dlq := ch.e.consume()

	// The poison event sits between the order's first and second events,
	// on the same key and so the same partition.
	order, err := ch.svc.Place(ch.e.ctx, "alice", 1250)
	if err != nil {
		t.Fatal(err)
	}
	var poison outbox.ID
	err = pgx.BeginFunc(ch.e.ctx, ch.db, func(tx pgx.Tx) error {
		var err error
		poison, err = ch.svc.Outbox.Write(ch.e.ctx, tx, outbox.Event{AggregateType: "order", AggregateID: fmt.Sprint(order), Type: "OrderPaid", Payload: []byte(`"not an order event"`)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := ch.svc.Advance(ch.e.ctx, order); err != nil {
			t.Fatal(err)
		}
	}
	rows := ch.waitLedger(time.Minute)
	var dl *kgo.Record
	ch.e.waitFor("the poison record on the dead-letter topic", time.Minute, func() (bool, error) {
		for _, r := range dlq.records() {
			if r.Topic == ch.dlq {
				dl = r
			}
		}
		return dl != nil, nil
	})
	want := map[string]string{"id": poison.String(), "inbox.reason": "handler-failed", "inbox.attempts": "3", "inbox.topic": ch.topic}
	for k, v := range want {
		if got, _ := header(dl, k); got != v {
			t.Errorf("dead letter header %s = %q, want %q", k, got, v)
		}
	}
	if why, _ := header(dl, "inbox.error"); !strings.Contains(why, "not an order event") {
		t.Errorf("inbox.error %q does not say why", why)
	}
	var outcome string
	if err := ch.db.QueryRow(ch.e.ctx, "SELECT outcome FROM inbox WHERE message_id = $1", poison.String()).Scan(&outcome); err != nil || outcome != "dead-lettered" {
		t.Errorf("inbox row of the poison record: %q, %v", outcome, err)
	}
	if f, d := lc.metric("inbox_handler_failures_total"), lc.metric("inbox_dead_lettered_total"); f != 3 || d != 1 {
		t.Errorf("failures %.0f, dead-lettered %.0f; want 3 and 1", f, d)
	}
	t.Logf("poison %s dead-lettered after 3 attempts (%s); ledger %d rows", poison, dl.Headers, rows)
}

// TestChainTwoRelays runs two relays on two slots of the same database (a
// blue/green switch, a misconfiguration): every event is published twice,
// and applied once.
func TestChainTwoRelays(t *testing.T) {
	ch := newChain(t)
	ch.createTopics()
	ch.e.startRelay(ch.e.config())
	second := ch.e.config()
	second.Slot = ch.e.name + "_b"
	ch.e.startRelay(second)
	t.Cleanup(func() {
		ch.e.exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", second.Slot)
	})
	lc := ch.startLedger()
	raw := ch.e.consume()
	ch.writeOrders(10)
	ch.e.waitFor("every event twice on the topic", time.Minute, func() (bool, error) {
		ids := distinctIDs(raw.records())
		twice := 0
		for _, n := range ids {
			if n >= 2 {
				twice++
			}
		}
		return twice == 30, fmt.Errorf("%d of %d ids read twice", twice, len(ids))
	})
	rows := ch.waitLedger(time.Minute)
	if d := lc.metric("inbox_duplicates_total"); d != 30 {
		t.Errorf("inbox_duplicates_total %.0f, want 30 (one copy of each event)", d)
	}
	t.Logf("two relays: %d records for 30 events; ledger %d rows", len(raw.records()), rows)
}

// TestChainRetention prunes inbox rows older than the retention and keeps
// the others.
func TestChainRetention(t *testing.T) {
	ch := newChain(t)
	ch.e.exec(`INSERT INTO inbox (consumer, message_id, processed_at) VALUES ('ledger', 'old', now() - interval '15 days'),
		('ledger', 'new', now() - interval '13 days'), ('other', 'old', now() - interval '30 days')`)
	c, err := inbox.New(inbox.Config{Group: "ledger", Topics: []string{"t"}, DB: ch.db}, shop.ApplyToLedger)
	if err != nil {
		t.Fatal(err)
	}
	n, err := c.Prune(ch.e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	rows, _ := ch.db.Query(ch.e.ctx, "SELECT consumer || '/' || message_id FROM inbox ORDER BY 1")
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 || strings.Join(left, ",") != "ledger/new,other/old" {
		t.Errorf("pruned %d, left %v; want 1 pruned (ledger/old, past the 14-day default) and the others kept", n, left)
	}
}

// TestChainSoak runs two writer processes, the walrelay binary and a
// consumer process (the example's) for WALRELAY_TEST_CHAIN_SOAK_SECONDS
// (default 20) while one of them is killed with SIGKILL every 1 to 4
// seconds and started again (each in turn, in a random order each round), and the broker (kfake with a data
// directory) is stopped for 2 to 4 seconds twice. At the end, with
// everything running again, the ledger equals the orders exactly: one
// effect per committed order event, per order in version order, and
// nothing was dead-lettered.
func TestChainSoak(t *testing.T) {
	if testing.Short() {
		t.Skip("soak test")
	}
	duration := 20 * time.Second
	if s, err := time.ParseDuration(os.Getenv("WALRELAY_TEST_CHAIN_SOAK_SECONDS") + "s"); err == nil && s > 0 {
		duration = s
	}
	e := newEnv(t)
	e.needKfake()
	b := startKafkaAt(t)
	e.brokers = []string{b.addr()}
	ch := newChainOn(e)
	ch.createTopics()
	relayArgs := e.args()
	writeArgs := []string{"write", "-pg-url", e.url, "-pause", "2ms"}
	consumeArgs := ch.consumeArgs()
	start := func(name string) *watched {
		switch name {
		case "relay":
			return watch(t, e.runBinary(relayArgs...))
		case "consumer":
			return watch(t, e.runExample(consumeArgs...))
		}
		return watch(t, e.runExample(writeArgs...))
	}
	procs := map[string]*watched{"relay": start("relay"), "consumer": start("consumer")}
	e.waitFor("slot active", 60*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	procs["writer1"], procs["writer2"] = start("writer1"), start("writer2")
	names := []string{"relay", "writer1", "writer2", "consumer"}

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 16))
	kills := map[string]int{}
	brokerRestarts := 0
	begin := time.Now()
	deadline := begin.Add(duration)
	bounces := []time.Time{begin.Add(duration / 4), begin.Add(duration * 3 / 4)}
	var brokerUp time.Time
	var turns []string
	for time.Now().Before(deadline) {
		time.Sleep(time.Duration(1000+rng.IntN(3000)) * time.Millisecond) // time between faults
		now := time.Now()
		if !brokerUp.IsZero() && now.After(brokerUp) {
			b.start()
			brokerRestarts++
			brokerUp = time.Time{}
		} else if brokerUp.IsZero() && len(bounces) > 0 && now.After(bounces[0]) {
			b.stop()
			bounces = bounces[1:]
			brokerUp = now.Add(time.Duration(2000+rng.IntN(2000)) * time.Millisecond)
		}
		// Each part in turn, in a random order each round.
		if len(turns) == 0 {
			for _, i := range rng.Perm(len(names)) {
				turns = append(turns, names[i])
			}
		}
		name := turns[0]
		turns = turns[1:]
		for n, p := range procs {
			if exited, err := p.exited(); exited {
				t.Fatalf("the %s exited by itself: %v", n, err)
			}
		}
		procs[name].kill()
		kills[name]++
		procs[name] = start(name)
	}
	if !brokerUp.IsZero() {
		b.start()
		brokerRestarts++
	}
	// The writers stop the way they were stopped all along (a writer
	// just restarted may not have its signal handler yet).
	procs["writer1"].kill()
	procs["writer2"].kill()
	events := ch.events()
	var orders, shipped int
	_ = ch.db.QueryRow(e.ctx, "SELECT count(*), count(*) FILTER (WHERE status = 'shipped') FROM orders").Scan(&orders, &shipped)
	raw := e.consume()
	ch.e.waitFor("the ledger to catch up, with the relay and the consumer running", 3*time.Minute, func() (bool, error) {
		for _, name := range []string{"relay", "consumer"} {
			if exited, err := procs[name].exited(); exited {
				return false, fmt.Errorf("the last %s exited: %v", name, err)
			}
		}
		n := ch.ledgerRows()
		return n >= events, fmt.Errorf("%d ledger rows for %d events", n, events)
	})
	rows := ch.waitLedger(time.Minute)
	recs := raw.waitIDs(events, time.Minute)
	topicRecs, dead := 0, 0
	for _, r := range recs {
		switch r.Topic {
		case ch.topic:
			topicRecs++
		case ch.dlq, e.topicPrefix() + "dlq":
			dead++
		}
	}
	if dead > 0 {
		t.Errorf("%d records were dead-lettered", dead)
	}
	for _, name := range []string{"relay", "consumer"} {
		if exited, err := procs[name].exited(); exited {
			t.Errorf("the last %s exited: %v", name, err)
		}
	}
	t.Logf("chain soak %s: %d orders (%d shipped), %d events; kills %v, %d broker restarts; %d records on the event topic "+
		"(%d duplicates delivered), ledger %d rows = events, per order in version order; elapsed %s",
		duration, orders, shipped, events, kills, brokerRestarts, topicRecs, topicRecs-events, rows, time.Since(begin).Round(time.Second))
}

// TestChainConsumerSIGTERM stops a consumer process (the example's) with
// SIGTERM in the middle of a batch: it exits 0 with the offsets of every
// record it applied committed and the one in flight abandoned, so the
// next consumer of the group starts exactly after its last effect and
// sees no duplicate.
func TestChainConsumerSIGTERM(t *testing.T) {
	ch := newChain(t)
	ch.publishOrders(30)
	p := ch.e.runExample(ch.consumeArgs("-handler-delay", "20ms")...)
	ch.e.waitFor("20 ledger rows", time.Minute, func() (bool, error) { return ch.ledgerRows() >= 20, nil })
	_ = p.Process.Signal(syscall.SIGTERM)
	if err := p.Wait(); err != nil {
		t.Fatalf("the consumer did not exit cleanly on SIGTERM: %v", err)
	}
	effects, committed := ch.ledgerRows(), ch.committedOffsets()
	if committed != int64(effects) {
		t.Fatalf("after SIGTERM %d offsets committed for %d effects: they must be equal", committed, effects)
	}
	rows := ch.resumeWithoutDuplicates()
	t.Logf("SIGTERM with %d effects, %d offsets committed; ledger %d rows", effects, committed, rows)
}

// resumeWithoutDuplicates runs the next ledger consumer of the group after
// a clean stop until the ledger matches the orders, fails the test if it
// met a record already applied (the stop left an offset behind its
// effect), and returns the ledger's rows.
func (ch *chain) resumeWithoutDuplicates() int {
	ch.e.t.Helper()
	lc := ch.startLedger()
	rows := ch.waitLedger(time.Minute)
	if d := lc.metric("inbox_duplicates_total"); d != 0 {
		ch.e.t.Errorf("the next consumer skipped %.0f duplicates, want none after a clean stop", d)
	}
	return rows
}

// TestChainStopAsTheHandlerReturns stops an in-process consumer at the
// worst moment for its bookkeeping: the 20th handler call cancels Run's
// context just before it returns nil. The handler finished before the
// stop, so its batch commits with it and the records before it, and their
// offsets are committed: the 20th event's effect is there, every effect's
// offset is committed (the partitions' other batches, handled at the
// same time, commit what their handlers finished or roll back whole), and
// the next consumer of the group sees no duplicate. (A commit on the
// cancelled context used to roll the 20th back; a stop landing just after
// a commit used to leave its offset uncommitted, which
// TestChainConsumerSIGTERM caught once: 21 effects, 20 offsets.)
func TestChainStopAsTheHandlerReturns(t *testing.T) {
	ch := newChain(t)
	ch.publishOrders(30)

	ctx, cancel := context.WithCancel(ch.e.ctx)
	defer cancel()
	var calls atomic.Int32
	var twentieth atomic.Value
	h := func(hctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		if err := shop.ApplyToLedger(hctx, tx, m); err != nil {
			return err
		}
		if calls.Add(1) == 20 {
			twentieth.Store(m.ID)
			cancel() // the stop lands as the handler returns
		}
		return nil
	}
	c, err := inbox.New(ch.consumerConfig(prometheus.NewRegistry()), h)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		t.Fatalf("Run after the stop: %v", err)
	}
	effects, committed := ch.ledgerRows(), ch.committedOffsets()
	var applied bool
	if err := ch.db.QueryRow(ch.e.ctx, "SELECT count(*) = 1 FROM ledger WHERE event_id = $1", twentieth.Load()).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if !applied || committed != int64(effects) {
		t.Fatalf("stopped as the 20th handler returned: its effect applied %v; %d effects and %d offsets committed, want them equal", applied, effects, committed)
	}
	rows := ch.resumeWithoutDuplicates()
	t.Logf("stopped as the 20th handler returned: %d effects, %d offsets committed; ledger %d rows", effects, committed, rows)
}

// TestChainSerializationFailuresAreNotPoison: a handler that hits
// serialization failures (SQLSTATE 40001) more often than MaxAttempts is
// retried without counting attempts, not dead-lettered: the database's
// trouble is not the record's fault.
func TestChainSerializationFailuresAreNotPoison(t *testing.T) {
	ch := newChain(t)
	ch.createTopics()
	ch.e.startRelay(ch.e.config())
	cfg := ch.consumerConfig(prometheus.NewRegistry())
	cfg.MaxAttempts = 2
	var mu sync.Mutex
	conflicts := 5
	lc := ch.startConsumer(cfg, func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		mu.Lock()
		fail := conflicts > 0
		conflicts--
		mu.Unlock()
		if fail {
			_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$`)
			return err
		}
		return shop.ApplyToLedger(ctx, tx, m)
	})
	ch.writeOrders(1)
	rows := ch.waitLedger(time.Minute)
	if d, f := lc.metric("inbox_dead_lettered_total"), lc.metric("inbox_handler_failures_total"); d != 0 || f != 0 {
		t.Errorf("dead-lettered %.0f, handler failures %.0f: serialization failures must not count", d, f)
	}
	if n := lc.metric("inbox_database_errors_total"); n != 5 {
		t.Errorf("inbox_database_errors_total %.0f, want the 5 conflicts", n)
	}
	t.Logf("5 serialization failures retried without counting; ledger %d rows", rows)
}

// TestChainDatabaseFailoverLosesTheLedgersNewest: the consumer's database
// fails over to a standby that had not received its newest transactions
// (asynchronous replication lagging: the standby's WAL receiver is cut
// before the consumer handles the events). The promoted database holds no
// ledger rows, no inbox rows and no consumed position for them, while
// Kafka holds the group's offsets past them. The consumer keeps running
// through the failover and must find the database's position behind its
// own and handle the lost events again: when the next record comes
// (copies of one record per partition, as a relay's resend would bring;
// the periodic check off), and with no record coming, by its periodic
// check of the positions.
func TestChainDatabaseFailoverLosesTheLedgersNewest(t *testing.T) {
	t.Run("next record", func(t *testing.T) { failoverLosingTheLedger(t, -1, true) })
	t.Run("position check", func(t *testing.T) { failoverLosingTheLedger(t, 200*time.Millisecond, false) })
}

func failoverLosingTheLedger(t *testing.T, check time.Duration, copies bool) {
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	ch := newChainOn(e)
	ch.createTopics()
	rr := e.startRelay(e.config())
	raw := e.consume()
	ch.writeOrders(10)
	raw.waitIDs(30, time.Minute)
	if err := rr.stop(t); err != nil {
		t.Fatal(err)
	}
	rs.waitReplayed()

	standby, err := pgx.Connect(e.ctx, rs.standby.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer standby.Close(context.Background())
	for _, q := range []string{`ALTER SYSTEM SET primary_conninfo = ''`, `SELECT pg_reload_conf()`} {
		if _, err := standby.Exec(e.ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	e.waitFor("the standby's WAL receiver gone", time.Minute, func() (bool, error) {
		var n int
		err := standby.QueryRow(e.ctx, "SELECT count(*) FROM pg_stat_wal_receiver").Scan(&n)
		return n == 0, err
	})

	cfg := ch.consumerConfig(prometheus.NewRegistry())
	cfg.PositionCheckInterval = check
	lc := ch.startConsumer(cfg, nil)
	ch.e.waitFor("30 ledger rows and the group's offsets committed", time.Minute, func() (bool, error) {
		rows, lag := ch.ledgerRows(), int64(-1)
		if l, err := ch.groupLag(); err == nil {
			lag = l
		}
		return rows == 30 && lag == 0, fmt.Errorf("%d ledger rows, group lag %d", rows, lag)
	})
	rs.failover(func() {
		// The promoted server's configuration is copied to its new
		// standby, which must stream.
		for _, q := range []string{`ALTER SYSTEM RESET primary_conninfo`, `SELECT pg_reload_conf()`} {
			if _, err := standby.Exec(e.ctx, q); err != nil {
				t.Fatal(err)
			}
		}
	})
	var after int
	e.waitFor("the promoted database answering", time.Minute, func() (bool, error) {
		err := ch.db.QueryRow(e.ctx, "SELECT count(*) FROM ledger").Scan(&after)
		return err == nil, err
	})
	// With the check on, the consumer may have rewound already.
	if after != 0 && (copies || lc.metric("inbox_rewinds_total") == 0) {
		t.Fatalf("after the failover the ledger holds %d rows, want none: the standby had them, so this tests nothing", after)
	}

	sent := 0
	if copies {
		// One copy of the last record of each partition, as a relay
		// resending after a restart would produce.
		cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.ConsumeTopics(ch.topic),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.RecordPartitioner(kgo.ManualPartitioner()))
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		last := map[int32]*kgo.Record{}
		for seen := 0; seen < 30; {
			fs := cl.PollFetches(e.ctx)
			if err := fs.Err0(); err != nil {
				t.Fatal(err)
			}
			fs.EachRecord(func(r *kgo.Record) {
				seen++
				last[r.Partition] = r
			})
		}
		for _, r := range last {
			c := &kgo.Record{Topic: r.Topic, Partition: r.Partition, Key: r.Key, Value: r.Value, Headers: r.Headers}
			if err := cl.ProduceSync(e.ctx, c).FirstErr(); err != nil {
				t.Fatal(err)
			}
			sent++
		}
	}
	rows := ch.waitLedger(2 * time.Minute)
	if n := lc.metric("inbox_rewinds_total"); n < 1 {
		t.Errorf("inbox_rewinds_total %.0f, want at least 1", n)
	}
	t.Logf("the failover lost the ledger's 30 rows; after %d copies the consumer rewound %.0f times; ledger %d rows",
		sent, lc.metric("inbox_rewinds_total"), rows)
}

// TestChainInboxTablesOfAnOlderDDL: an inbox made by a DDL from before the
// offsets table (an upgrade that did not run inbox.DDL again) is refused
// at once, with the fix, before the consumer joins its group.
func TestChainInboxTablesOfAnOlderDDL(t *testing.T) {
	ch := newChain(t)
	ch.e.exec("DROP TABLE " + shop.InboxTable + "_offsets")
	c, err := inbox.New(ch.consumerConfig(prometheus.NewRegistry()), shop.ApplyToLedger)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ch.e.ctx, 30*time.Second)
	defer cancel()
	err = c.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), `run inbox.DDL("inbox") again`) || ctx.Err() != nil {
		t.Fatalf("Run = %v (context: %v), want at once an error naming inbox.DDL", err, ctx.Err())
	}
	t.Logf("refused: %v", err)
}
