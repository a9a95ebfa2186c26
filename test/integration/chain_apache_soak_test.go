package integration

// TestChainApacheSoak: the chain soak (TestChainSoak's writers, relay and
// ledger consumer killed with SIGKILL in turn) where a team runs it: on a
// three-node Apache Kafka cluster whose nodes are killed and restarted
// (leaders elected, the group's and the transactions' coordinators
// moving, a node catching up: what kfake's stop cannot show), with the
// relay's database switched over on PostgreSQL 17's failover slots, and
// the ledger's own database failed over to an asynchronous standby that
// lost its newest transactions, which is where an inbox loses its
// position in practice.
//
// The ledger consumer runs in a process of its own: this test binary,
// started again with soakConsumerEnv set (init below runs the consumer
// and exits before TestMain), so that the race detector of CI's build
// watches the inbox under the kills too, and the process reports its
// inbox_* counters on its standard output for the test to add up across
// the processes it kills.

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
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

	"github.com/walrelay/walrelay/examples/orders/shop"
	"github.com/walrelay/walrelay/inbox"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/test/kafkacluster"
)

// soakConsumerEnv, set to a soakConsumerOptions in JSON, makes this test
// binary a ledger consumer process instead of running tests.
const soakConsumerEnv = "WALRELAY_TEST_SOAK_CONSUMER"

// soakSecondsEnv sets the soak's duration, in seconds.
const soakSecondsEnv = "WALRELAY_TEST_CHAIN_APACHE_SOAK_SECONDS"

func init() {
	if o := os.Getenv(soakConsumerEnv); o != "" {
		os.Exit(soakConsumerMain(o))
	}
}

// soakConsumerOptions is what a ledger consumer process is told.
type soakConsumerOptions struct {
	PGURL           string
	Brokers         []string
	Topic, Group    string
	DeadLetterTopic string
	// ReadCommitted: behind an exactly-once relay.
	ReadCommitted bool
}

// newSoakConsumer is the ledger consumer the soak runs, the one place its
// inbox.Config is made (written against the consumer's configuration of
// today; a knob of the inbox's goes here).
func newSoakConsumer(o soakConsumerOptions, db *pgxpool.Pool, log *zap.Logger, reg prometheus.Registerer) (*inbox.Consumer, error) {
	opts := []kgo.Opt{kgo.SeedBrokers(o.Brokers...), kgo.FetchMaxWait(100 * time.Millisecond),
		// A killed member's partitions move after 6s, as with the
		// example's -session-timeout 6s in the other soaks.
		kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(6 * time.Second)}
	if o.ReadCommitted {
		opts = append(opts, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	}
	return inbox.New(inbox.Config{
		Group:           o.Group,
		Topics:          []string{o.Topic},
		KafkaOptions:    opts,
		DB:              db,
		Table:           shop.InboxTable,
		DeadLetterTopic: o.DeadLetterTopic,
		RetryBackoff:    10 * time.Millisecond,
		MaxRetryBackoff: 200 * time.Millisecond,
		Logger:          log,
		Registerer:      reg,
	}, shop.ApplyToLedger)
}

// inboxCounts are a consumer's inbox_* counters.
type inboxCounts struct {
	Processed, Duplicates, Rewinds, DeadLettered, DatabaseErrors, HandlerFailures float64
}

func (a inboxCounts) add(b inboxCounts) inboxCounts {
	return inboxCounts{a.Processed + b.Processed, a.Duplicates + b.Duplicates, a.Rewinds + b.Rewinds,
		a.DeadLettered + b.DeadLettered, a.DatabaseErrors + b.DatabaseErrors, a.HandlerFailures + b.HandlerFailures}
}

func readInboxCounts(reg *prometheus.Registry) inboxCounts {
	v := func(name string) float64 { return sumValues(gathered(reg, name)) }
	return inboxCounts{v("inbox_processed_total"), v("inbox_duplicates_total"), v("inbox_rewinds_total"),
		v("inbox_dead_lettered_total"), v("inbox_database_errors_total"), v("inbox_handler_failures_total")}
}

// countsPrefix starts a consumer process's report line on its standard
// output.
const countsPrefix = "soak-counts "

// soakConsumerMain runs a ledger consumer process until SIGTERM (or the
// SIGKILL the soak sends), reporting its counters whenever they changed,
// every 10ms: a kill loses at most that much of its count, never an
// effect.
func soakConsumerMain(arg string) int {
	var o soakConsumerOptions
	if err := json.Unmarshal([]byte(arg), &o); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", soakConsumerEnv, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	db, err := pgxpool.New(ctx, o.PGURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak consumer:", err)
		return 1
	}
	defer db.Close()
	lc := zap.NewDevelopmentConfig()
	lc.Level = zap.NewAtomicLevelAt(zap.InfoLevel)
	lc.DisableStacktrace = true
	log, err := lc.Build()
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak consumer:", err)
		return 1
	}
	reg := prometheus.NewRegistry()
	c, err := newSoakConsumer(o, db, log, reg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak consumer:", err)
		return 1
	}
	var last inboxCounts
	report := func() {
		if now := readInboxCounts(reg); now != last {
			b, _ := json.Marshal(now)
			fmt.Fprintf(os.Stdout, "%s%s\n", countsPrefix, b)
			last = now
		}
	}
	done, reported := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(reported)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				report()
				return
			case <-tick.C:
				report()
			}
		}
	}()
	err = c.Run(ctx)
	close(done)
	<-reported
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak consumer:", err)
		return 1
	}
	return 0
}

// lineWriter hands each complete line written to it to line.
type lineWriter struct {
	mu   sync.Mutex
	buf  []byte
	line func(string)
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := strings.IndexByte(string(w.buf), '\n')
		if i < 0 {
			return len(p), nil
		}
		w.line(string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
}

// soakProc is a process of the soak. The kill loop's goroutine starts and
// kills them, so starting one needs no *testing.T but the log it writes
// to; the soak kills and reaps every one before the test ends.
type soakProc struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once the process was reaped
	err  error         // Wait's, set before done closes
	// counts is a consumer process's last report.
	counts atomic.Pointer[inboxCounts]
	// raced: the race detector reported a data race in the process.
	raced atomic.Bool
}

// startSoakProc starts path with args (and env added to the test's);
// its output goes to the test log, prefixed, but for a consumer's reports.
func startSoakProc(t *testing.T, prefix string, env []string, path string, args ...string) (*soakProc, error) {
	p := &soakProc{cmd: exec.Command(path, args...), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // a crashed test leaves none behind
	p.counts.Store(&inboxCounts{})
	out := &lineWriter{line: func(l string) {
		if r, ok := strings.CutPrefix(l, countsPrefix); ok {
			var c inboxCounts
			if json.Unmarshal([]byte(r), &c) == nil {
				p.counts.Store(&c)
			}
			return
		}
		if strings.Contains(l, "WARNING: DATA RACE") {
			p.raced.Store(true)
		}
		t.Log(prefix + l)
	}}
	p.cmd.Stdout, p.cmd.Stderr = out, out
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", prefix, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

func (p *soakProc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

func (p *soakProc) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// soakParts are the soak's processes by name (relay, writer1, writer2,
// consumer) and what their kills add up to. Its loop kills one every 1 to
// 4 seconds, each in turn, unless a fault holds it.
type soakParts struct {
	start func(name string) (*soakProc, error)

	mu     sync.Mutex
	procs  map[string]*soakProc
	held   map[string]int
	kills  map[string]int
	counts inboxCounts // the killed consumer processes' last reports
	raced  []string
}

func newSoakParts(start func(string) (*soakProc, error)) *soakParts {
	return &soakParts{start: start, procs: map[string]*soakProc{}, held: map[string]int{}, kills: map[string]int{}}
}

// run starts part name.
func (s *soakParts) run(name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, err := s.start(name)
	if err == nil {
		s.procs[name] = p
	}
	return err
}

// hold keeps the loop from killing the parts names until release is
// called: a kill under way finishes first.
func (s *soakParts) hold(names ...string) (release func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range names {
		s.held[n]++
	}
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, n := range names {
			s.held[n]--
		}
	}
}

// stop kills part name for good, adding up what it reported.
func (s *soakParts) stop(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopLocked(name)
}

func (s *soakParts) stopLocked(name string) {
	p := s.procs[name]
	if p == nil {
		return
	}
	p.kill()
	s.counts = s.counts.add(*p.counts.Load())
	if p.raced.Load() {
		s.raced = append(s.raced, name)
	}
	delete(s.procs, name)
}

// stopAll kills every part.
func (s *soakParts) stopAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for name := range s.procs {
		s.stopLocked(name)
	}
}

// replace kills part name (unless it is held) and starts it again.
func (s *soakParts) replace(name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held[name] > 0 {
		return nil
	}
	s.stopLocked(name)
	s.kills[name]++
	p, err := s.start(name)
	if err != nil {
		return err
	}
	s.procs[name] = p
	return nil
}

// exitedByItself names a part that exited though nobody killed it.
func (s *soakParts) exitedByItself() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, p := range s.procs {
		if exited, err := p.exited(); exited {
			return fmt.Errorf("the %s exited by itself: %v", name, err)
		}
	}
	return nil
}

// current is the running process of part name.
func (s *soakParts) current(name string) *soakProc {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.procs[name]
}

// consumerCounts adds the running consumer's counters to the killed ones'.
func (s *soakParts) consumerCounts() inboxCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.counts
	if p := s.procs["consumer"]; p != nil {
		c = c.add(*p.counts.Load())
	}
	return c
}

// loop kills a part every 1 to 4 seconds, each in turn in a random order
// each round, and starts it again, until ctx ends; it returns the first
// part that exited by itself or could not start.
func (s *soakParts) loop(ctx context.Context, rng *rand.Rand, names []string) error {
	var turns []string
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Duration(1000+rng.IntN(3000)) * time.Millisecond): // time between kills
		}
		if err := s.exitedByItself(); err != nil {
			return err
		}
		if len(turns) == 0 {
			for _, i := range rng.Perm(len(names)) {
				turns = append(turns, names[i])
			}
		}
		if err := s.replace(turns[0]); err != nil {
			return err
		}
		turns = turns[1:]
	}
}

// idCounter counts what a Kafka consumer of the test's topics read:
// copies per id on the event topic, records on the dead-letter topics.
type idCounter struct {
	topic  string
	dlqs   []string
	mu     sync.Mutex
	ids    map[string]int
	dead   int
	fenced *fenceSeen
}

func (c *idCounter) fences() *fenceSeen { return c.fenced }

// countIDs reads the test's topics from the start until the test ends.
func (e *env) countIDs(topic string, readCommitted bool, dlqs ...string) *idCounter {
	e.t.Helper()
	topics := "^" + regexp.QuoteMeta(e.topicPrefix()) + ".*"
	c := &idCounter{topic: topic, dlqs: dlqs, ids: map[string]int{}, fenced: newFenceSeen(topics)}
	opts := []kgo.Opt{kgo.ConsumeTopics(topics)}
	if readCommitted {
		opts = append(opts, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	}
	e.poll(func(fs kgo.Fetches) {
		c.mu.Lock()
		defer c.mu.Unlock()
		fs.EachRecord(func(r *kgo.Record) {
			switch {
			case c.fenced.take(r):
			case r.Topic == c.topic:
				if id, ok := header(r, "id"); ok {
					c.ids[id]++
				}
			case slices.Contains(c.dlqs, r.Topic):
				c.dead++
			}
		})
	}, opts...)
	return c
}

// counts returns the records of the event topic, its distinct ids, and
// the records of the dead-letter topics.
func (c *idCounter) counts() (records, distinct, dead int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range c.ids {
		records += n
	}
	return records, len(c.ids), c.dead
}

// queryCount runs a count query on url.
func queryCount(ctx context.Context, url, query string, args ...any) (int, error) {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer c.Close(context.Background())
	var n int
	err = c.QueryRow(ctx, query, args...).Scan(&n)
	return n, err
}

// groupCoordinator is the node coordinating consumer group group.
func (e *env) groupCoordinator(adm *kadm.Client, group string) int {
	e.t.Helper()
	c, ok := adm.FindGroupCoordinators(e.ctx, group)[group]
	if !ok || c.Err != nil {
		e.t.Fatalf("find the coordinator of group %s: %+v", group, c)
	}
	return int(c.NodeID)
}

// TestChainApacheSoak runs the chain (two writer processes of the
// example, the walrelay binary, a ledger consumer process) on a
// three-node Apache Kafka cluster (replication factor 3,
// min.insync.replicas 2), in both delivery modes side by side, for
// WALRELAY_TEST_CHAIN_APACHE_SOAK_SECONDS (default 20, and at least one
// round of the faults below). Throughout, one of the four processes is
// killed with SIGKILL every 1 to 4 seconds and started again. In rounds,
// with a moment of load before each: a node is killed with SIGKILL and
// restarted, one at a time for both modes (in turn the leader of a
// partition of the event topic, the consumer group's coordinator, and
// with exactly-once the relay's transaction coordinator; each kill waits
// until every partition is fully in sync again); the relay's database
// (PostgreSQL 17+, failover slots) is switched over, the old primary
// rejoining as the standby the documented way; and the ledger's database
// fails over to its asynchronous standby, cut off while the consumer went
// on committing: the promoted database has lost ledger rows, inbox rows
// and positions, and the running consumer must find its position gone
// and rewind (counted). At the end, with the relay and a consumer
// running, the ledger equals the orders exactly: one effect per committed
// order event, per order in version order; nothing was dead-lettered, and
// exactly-once delivered no duplicate to its read_committed consumers.
func TestChainApacheSoak(t *testing.T) {
	needApache(t)
	needPG(t, 17)
	if testing.Short() {
		t.Skip("soak test")
	}
	duration := 20 * time.Second
	if s, err := time.ParseDuration(os.Getenv(soakSecondsEnv) + "s"); err == nil && s > 0 {
		duration = s
	}
	k := startApache(t, kafkacluster.Options{Nodes: 3, HeapMB: 384, Settings: map[string]string{"min.insync.replicas": "2"}})
	var oneNodeDown sync.Mutex
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			// The two modes side by side on the one cluster: each node
			// kill hits both, and the soak takes one mode's time.
			t.Parallel()
			chainApacheSoak(t, k, &oneNodeDown, mode == "exactly-once", duration)
		})
	}
}

// chainApacheSoak is one delivery mode's soak on cluster k, whose nodes
// it kills one at a time, holding oneNodeDown, so that two replicas hold
// every acknowledged record of either mode.
func chainApacheSoak(t *testing.T, k *kafkacluster.Cluster, oneNodeDown *sync.Mutex, eos bool, duration time.Duration) {
	begin := time.Now()
	// The relay's database, with a standby synchronizing its failover
	// slot; the ledger's, streaming asynchronously to a standby of its
	// own, as a consumer's database is another service's.
	shopRS := startReplicaSet(t, replicaSetOptions{FailoverSlots: true, SynchronizedStandbySlots: true})
	ledgerRS := startReplicaSet(t, replicaSetOptions{})
	e := newEnvOn(t, shopRS.adminURL())
	e.brokers = k.Addrs()
	ch := newChainOn(e)
	ch.transactional = eos
	ch.createTopics()
	relayDLQ := e.topicPrefix() + "dlq"
	le := newEnvOn(t, ledgerRS.adminURL())
	le.exec(shop.Schema())
	ledger, err := pgxpool.New(e.ctx, le.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ledger.Close)
	ledgerRows := func(url string) (int, error) { return queryCount(e.ctx, url, "SELECT count(*) FROM ledger") }
	adm, err := k.Admin()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(adm.Close)

	example, err := exampleBinary()
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	relayArgs := append(e.args(), "--topic-replication-factor", "3")
	if eos {
		relayArgs = append(relayArgs, "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic())
	}
	writeArgs := []string{"write", "-pg-url", e.url, "-pause", "5ms"}
	consumer, err := json.Marshal(soakConsumerOptions{PGURL: le.url, Brokers: e.brokers, Topic: ch.topic, Group: ch.group,
		DeadLetterTopic: ch.dlq, ReadCommitted: eos})
	if err != nil {
		t.Fatal(err)
	}
	parts := newSoakParts(func(name string) (*soakProc, error) {
		switch name {
		case "relay":
			return startSoakProc(t, "walrelay: ", nil, binPath, relayArgs...)
		case "consumer":
			return startSoakProc(t, "consumer: ", []string{soakConsumerEnv + "=" + string(consumer)}, self)
		}
		return startSoakProc(t, "orders "+name+": ", nil, example, writeArgs...)
	})
	// Every process killed and reaped before the test ends (this cleanup
	// runs before those of the servers, registered earlier).
	loopCtx, stopLoop := context.WithCancel(e.ctx)
	loopDone := make(chan error, 1)
	looping := false
	t.Cleanup(func() {
		stopLoop()
		if looping {
			if err := <-loopDone; err != nil {
				t.Logf("the kill loop: %v", err)
			}
		}
		parts.stopAll()
	})
	for _, name := range []string{"relay", "consumer"} {
		if err := parts.run(name); err != nil {
			t.Fatal(err)
		}
	}
	e.waitFor("slot active", time.Minute, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	for _, name := range []string{"writer1", "writer2"} {
		if err := parts.run(name); err != nil {
			t.Fatal(err)
		}
	}
	// Everything flowing (the group and, with exactly-once, the
	// transaction state exist) before the first fault.
	e.waitFor("100 ledger rows", 2*time.Minute, func() (bool, error) {
		if err := parts.exitedByItself(); err != nil {
			return false, err
		}
		n, err := ledgerRows(le.url)
		return n >= 100, fmt.Errorf("%d ledger rows (%v)", n, err)
	})
	setup := time.Since(begin)

	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 48))
	killRNG := rand.New(rand.NewPCG(seed, 49))
	looping = true
	go func() { loopDone <- parts.loop(loopCtx, killRNG, []string{"relay", "writer1", "writer2", "consumer"}) }()

	faults := map[string]int{}
	var nodeKills []string
	lost, rewinds := 0, 0
	killNode := func() {
		oneNodeDown.Lock()
		defer oneNodeDown.Unlock()
		topics, err := adm.ListTopicsWithInternal(e.ctx)
		if err != nil {
			t.Fatal(err)
		}
		e.waitInSync(adm, 3, topics.Names()...)
		n := faults["node kill"]
		victim, why := e.leaderOf(adm, ch.topic, int32(n%3)), fmt.Sprintf("leader of %s/%d", ch.topic, n%3)
		switch {
		case n%3 == 1:
			victim, why = e.groupCoordinator(adm, ch.group), "coordinator of the consumer group"
		case n%3 == 2 && eos:
			victim, why = e.txnCoordinator(adm, e.transactionalID()), "the relay's transaction coordinator"
		}
		k.Kill(victim)
		if err := k.Restart(e.ctx, victim); err != nil {
			t.Fatal(err)
		}
		faults["node kill"]++
		nodeKills = append(nodeKills, fmt.Sprintf("node %d (%s)", victim, why))
	}
	switchRelayDB := func() {
		shopRS.waitSynced(e.name)
		shopRS.switchover(e.name)
		faults["relay database switchover"]++
	}
	failLedgerDB := func() {
		// The consumer that committed what the failover loses must be
		// the one that finds it lost.
		release := parts.hold("consumer")
		defer release()
		standby, err := pgx.Connect(e.ctx, ledgerRS.standby.URL("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer standby.Close(context.Background())
		for _, q := range []string{`ALTER SYSTEM SET primary_conninfo = ''`, `SELECT pg_reload_conf()`} {
			if _, err := standby.Exec(e.ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		e.waitFor("the ledger standby's WAL receiver gone", time.Minute, func() (bool, error) {
			var n int
			err := standby.QueryRow(e.ctx, "SELECT count(*) FROM pg_stat_wal_receiver").Scan(&n)
			return n == 0, err
		})
		// The standby receives nothing more: what commits after this
		// count is the primary's alone, whatever the standby has still
		// to replay of what it received.
		effects := func(url string, before time.Time) (int, error) {
			return queryCount(e.ctx, url, "SELECT count(*) FROM inbox WHERE processed_at < $1", before)
		}
		cut, err := effects(le.url, time.Now().Add(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		e.waitFor("30 effects committed that the ledger's standby cannot have", 2*time.Minute, func() (bool, error) {
			n, err := effects(le.url, time.Now().Add(time.Hour))
			return n >= cut+30, fmt.Errorf("%d effects, %d at the cut (%v)", n, cut, err)
		})
		cp := parts.current("consumer")
		before := cp.counts.Load().Rewinds
		had, err := effects(le.url, time.Now().Add(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		// The promoted server holds the old history's effects, all of
		// them begun before the kill, and then its own, all begun after.
		killed := time.Now()
		ledgerRS.failover(func() {
			// The promoted server's configuration is copied to its new
			// standby, which must stream.
			for _, q := range []string{`ALTER SYSTEM RESET primary_conninfo`, `SELECT pg_reload_conf()`} {
				if _, err := standby.Exec(e.ctx, q); err != nil {
					t.Fatal(err)
				}
			}
		})
		kept, err := effects(le.url, killed)
		if err != nil {
			t.Fatal(err)
		}
		if kept >= had {
			t.Fatalf("the ledger's failover lost nothing (%d effects before, %d after): this tests nothing", had, kept)
		}
		lost += had - kept
		e.waitFor("the running consumer to rewind", 2*time.Minute, func() (bool, error) {
			if ok, err := cp.exited(); ok {
				return false, fmt.Errorf("the consumer exited: %v", err)
			}
			n := cp.counts.Load().Rewinds
			return n > before, fmt.Errorf("inbox_rewinds_total %.0f, %.0f before the failover", n, before)
		})
		rewinds += int(cp.counts.Load().Rewinds - before)
		faults["ledger database failover"]++
	}

	steps := []func(){killNode, switchRelayDB, failLedgerDB}
	faultsBegin := time.Now()
	deadline := faultsBegin.Add(duration)
	for i := 0; i < len(steps) || time.Now().Before(deadline); i++ {
		select {
		case err := <-loopDone:
			looping = false
			t.Fatal(err)
		case <-time.After(time.Duration(1000+rng.IntN(2000)) * time.Millisecond): // load between faults
		}
		steps[i%len(steps)]()
	}
	stopLoop()
	looping = false
	if err := <-loopDone; err != nil {
		t.Fatal(err)
	}
	faulting := time.Since(faultsBegin)

	// The writers stop as they were stopped all along.
	parts.stop("writer1")
	parts.stop("writer2")
	drainBegin := time.Now()
	events := ch.events()
	var orders int
	if err := ch.db.QueryRow(e.ctx, "SELECT count(*) FROM orders").Scan(&orders); err != nil {
		t.Fatal(err)
	}
	// shop.Check compares the ledger with the orders in one database:
	// the orders, final now, go beside the ledger.
	rows, err := ch.db.Query(e.ctx, "SELECT id, version FROM orders")
	if err != nil {
		t.Fatal(err)
	}
	type order struct {
		ID      int64
		Version int32
	}
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[order])
	if err != nil {
		t.Fatal(err)
	}
	ids, versions := make([]int64, len(all)), make([]int32, len(all))
	for i, o := range all {
		ids[i], versions[i] = o.ID, o.Version
	}
	if _, err := ledger.Exec(e.ctx, `INSERT INTO orders (id, customer, total_cents, status, version)
		SELECT id, '', 0, '', v FROM unnest($1::bigint[], $2::int[]) AS u(id, v)`, ids, versions); err != nil {
		t.Fatal(err)
	}
	// A deadlock guard: the backlog of a long run takes a while.
	err = devcluster.WaitFor(max(3*time.Minute, duration), 200*time.Millisecond, func() (bool, error) {
		if err := parts.exitedByItself(); err != nil {
			return false, err
		}
		n, err := ledgerRows(le.url)
		if err != nil {
			return false, err
		}
		lag, err := ch.groupLag()
		return err == nil && n >= events && lag == 0, fmt.Errorf("%d ledger rows for %d events, group lag %d (%v)", n, events, lag, err)
	})
	if err != nil {
		t.Fatalf("waiting for the ledger to catch up with the relay and a consumer running: %v", err)
	}
	n, problems, err := shop.Check(e.ctx, ledger)
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) > 0 || n != events {
		t.Fatalf("%d ledger rows for %d events, %d differences: %.1000s", n, events, len(problems), strings.Join(problems, "; "))
	}
	drain := time.Since(drainBegin)
	// The consumer stops before the fence, whose markers carry no id.
	parts.stop("consumer")
	counts := parts.consumerCounts()
	reads := e.countIDs(ch.topic, eos, ch.dlq, relayDLQ)
	e.fence("", reads)
	records, distinct, dead := reads.counts()
	if distinct != events {
		t.Errorf("%d distinct ids on the event topic for %d events", distinct, events)
	}
	if dead > 0 || counts.DeadLettered > 0 {
		t.Errorf("dead-lettered: %d records on the dead-letter topics, inbox_dead_lettered_total %.0f", dead, counts.DeadLettered)
	}
	if eos && records != distinct {
		t.Errorf("%d duplicates on the event topic under exactly-once, read_committed", records-distinct)
	}
	if counts.Rewinds < float64(faults["ledger database failover"]) {
		t.Errorf("inbox_rewinds_total %.0f after %d failovers of the ledger's database that lost rows", counts.Rewinds, faults["ledger database failover"])
	}
	if len(parts.raced) > 0 {
		t.Errorf("the race detector reported data races in the processes %v (above in the log)", parts.raced)
	}
	parts.mu.Lock()
	kills := fmt.Sprint(parts.kills)
	parts.mu.Unlock()
	mode := map[bool]string{false: "at-least-once", true: "exactly-once"}[eos]
	t.Logf("chain soak on Apache Kafka, %s, %s of faults: %d orders, %d events; process kills %s; %v: %s; "+
		"the ledger's failovers lost %d rows, rewinds %d (inbox_rewinds_total %.0f); %d records on the event topic (%d duplicates delivered), "+
		"duplicates absorbed %.0f, effects %.0f, database errors retried %.0f; ledger %d rows = events, per order in version order, nothing dead-lettered; "+
		"setup %s, faults %s, drain %s",
		mode, faulting.Round(time.Second), orders, events, kills, faults, strings.Join(nodeKills, ", "),
		lost, rewinds, counts.Rewinds, records, records-distinct, counts.Duplicates, counts.Processed, counts.DatabaseErrors, n,
		setup.Round(time.Second), faulting.Round(time.Second), drain.Round(time.Second))
}
