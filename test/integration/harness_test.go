// Package integration runs walrelay end to end against a real PostgreSQL
// and a Kafka-protocol broker, and asserts on what a Kafka consumer reads
// back and on pg_replication_slots.
//
// By default the tests start what they need: one throwaway PostgreSQL
// cluster for the package (initdb into a temporary directory, as the
// postgres user when run as root) and one in-process kfake broker per test.
// WALRELAY_TEST_KAFKA selects the broker: kfake (the default) or apache,
// one Apache Kafka node (test/kafkacluster) started for the package
// and shared by every test (`make test-kafka`). To run them against real
// services instead (docker-compose.yml):
//
//	WALRELAY_TEST_PG_URL=postgres://postgres:postgres@localhost:5432/postgres?sslmode=disable
//	WALRELAY_TEST_BROKERS=localhost:9092
//
// The PostgreSQL role must be able to create databases; each test works in
// a database and on topics of its own.
//
// WALRELAY_TEST_PG picks the server of the throwaway clusters: local (the
// default: the server devcluster.BinDir finds, Debian's) or a major version
// of the matrix, 14 to 18, installed by `make deps-pg-versions` (`make
// test-pg` runs the suite on each). Its bin directory goes first on PATH,
// so every cluster a test starts, and `walrelay dev` run by one, uses it. Tests that inject broker faults need
// kfake and are skipped on any other broker; the tests of apache_test.go
// need Apache Kafka and are skipped on any other.
package integration

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/test/kafkacluster"
)

var (
	pgAdminURL string // superuser URL of the cluster the tests use
	pgCluster  *devcluster.Postgres
	pgVersion  int      // its server_version_num
	extBrokers []string // set when running against an external Kafka
	// apache is the package's Apache Kafka node (WALRELAY_TEST_KAFKA=apache).
	apache  *kafkacluster.Cluster
	binPath string // the walrelay binary, built once
	verbose = flag.Bool("relay-log", false, "show the relay's debug log")
)

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(run(m))
}

func run(m *testing.M) (code int) {
	if f := flag.Lookup("test.list"); f != nil && f.Value.String() != "" {
		// Listing the tests (scripts/test-integration does, to split
		// them) needs no server.
		return m.Run()
	}
	ctx := context.Background()
	defer func() { closeRegistry(code != 0) }() // (registry_test.go) started by the first test needing it
	pgBin, err := devcluster.TestBinDir()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if u := os.Getenv("WALRELAY_TEST_PG_URL"); u != "" {
		if pgBin != "" {
			fmt.Fprintf(os.Stderr, "WALRELAY_TEST_PG_URL and %s=%s both pick a server: unset one\n", devcluster.TestPGEnv, os.Getenv(devcluster.TestPGEnv))
			return 1
		}
		pgAdminURL = u
	} else {
		if pgBin != "" {
			os.Setenv("PATH", pgBin+string(os.PathListSeparator)+os.Getenv("PATH"))
		}
		pg, err := devcluster.StartPostgres(ctx, devcluster.PostgresOptions{BinDir: pgBin, Settings: map[string]string{
			// Short, so tests of backpressure see a relay that stopped
			// answering get disconnected.
			"wal_sender_timeout": "'10s'",
		}})
		if err != nil {
			fmt.Fprintln(os.Stderr, "start PostgreSQL:", err)
			return 1
		}
		defer pg.Close()
		pgCluster = pg
		pgAdminURL = pg.URL("postgres")
	}
	if pgVersion, err = serverVersion(ctx, pgAdminURL); err != nil {
		fmt.Fprintln(os.Stderr, "read PostgreSQL's version:", err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "PostgreSQL %d.%d", pgVersion/10000, pgVersion%10000)
	if pgCluster != nil {
		fmt.Fprintf(os.Stderr, " from %s", pgCluster.BinDir())
	}
	fmt.Fprintln(os.Stderr)
	if b := os.Getenv("WALRELAY_TEST_BROKERS"); b != "" {
		extBrokers = strings.Split(b, ",")
	}
	switch k := os.Getenv("WALRELAY_TEST_KAFKA"); {
	case k == "apache" && extBrokers == nil:
		start := time.Now()
		c, err := kafkacluster.Start(ctx, apacheOptions())
		if err != nil {
			fmt.Fprintln(os.Stderr, "start Apache Kafka:", err)
			return 1
		}
		fmt.Fprintf(os.Stderr, "Apache Kafka answering at %s after %s (logs: %s)\n", c.Addrs()[0], time.Since(start).Round(time.Millisecond), c.Dir)
		apache = c
		defer func() {
			if code != 0 {
				// Keep the broker's log of a failed run.
				fmt.Fprintln(os.Stderr, "tests failed: Apache Kafka's logs kept in", c.Dir)
				_ = c.Stop(1)
				return
			}
			c.Close()
		}()
	case k == "" || k == "kfake" || k == "apache":
	default:
		fmt.Fprintf(os.Stderr, "WALRELAY_TEST_KAFKA=%q: use kfake (the default) or apache\n", k)
		return 1
	}
	dir, err := os.MkdirTemp("", "walrelay-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	binPath = filepath.Join(dir, "walrelay")
	build := exec.Command("go", "build", "-o", binPath, "github.com/walrelay/walrelay/cmd/walrelay")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build walrelay:", err)
		return 1
	}
	return m.Run()
}

// env is one test's world: its own database, outbox table, slot,
// publication, topic prefix and (unless external) broker.
type env struct {
	t       *testing.T
	name    string // unique, lower case: database, slot and topic prefix
	url     string // the test database
	brokers []string
	kafka   *devcluster.Kafka // nil against an external broker
	ctx     context.Context
	// logCore, when set (see observeLogs), also receives what relays
	// started in-process log.
	logCore zapcore.Core
}

// newEnv creates the test's database with an outbox table.
func newEnv(t *testing.T) *env { return newEnvOn(t, pgAdminURL) }

// newEnvOn is newEnv on the PostgreSQL server of adminURL instead of the
// package's cluster: the test's database with its outbox table, and a
// broker of its own (unless external).
func newEnvOn(t *testing.T, adminURL string) *env {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	name, url := testDatabase(t, ctx, adminURL)
	e := &env{t: t, name: name, url: url, ctx: ctx}
	e.exec(`CREATE TABLE outbox (
		id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
		aggregate_type text,
		aggregate_id text,
		type text,
		payload jsonb,
		seq bigint
	)`)
	if extBrokers != nil {
		e.brokers = extBrokers
	} else if apache != nil {
		e.brokers = apache.Addrs()
	} else {
		k, err := devcluster.StartKafka(devcluster.KafkaOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(k.Close)
		e.kafka = k
		e.brokers = []string{k.Addr()}
	}
	return e
}

// serverVersion is the server_version_num of the server of url.
func serverVersion(ctx context.Context, url string) (int, error) {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer c.Close(context.Background())
	var v int
	err = c.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&v)
	return v, err
}

// needPG skips tests of what PostgreSQL older than major lacks.
func needPG(t *testing.T, major int) {
	t.Helper()
	if pgVersion < major*10000 {
		t.Skipf("needs PostgreSQL %d or later; this server is %d (run with %s=%d or later)", major, pgVersion/10000, devcluster.TestPGEnv, major)
	}
}

// needKfake skips tests that inject broker faults.
func (e *env) needKfake() {
	if e.kafka == nil {
		e.t.Skip("needs the in-process kfake broker for fault injection")
	}
}

// conn opens a connection to the test database.
func (e *env) conn() *pgx.Conn {
	e.t.Helper()
	c, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	c, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	defer c.Close(context.Background())
	if _, err := c.Exec(e.ctx, sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

// topicPrefix keeps topics of tests sharing an external broker apart.
func (e *env) topicPrefix() string { return e.name + "." }

// topic is the topic events of aggregate type agg go to.
func (e *env) topic(agg string) string { return e.topicPrefix() + agg }

// config is the relay configuration the tests start from: the defaults,
// with this test's names, a faster pace (status updates, reconnects,
// linger), three partitions per topic, and neither the initial snapshot
// nor the heartbeat: tests of those turn them on, the others count every
// record and every WAL message they cause.
func (e *env) config() relay.Config {
	cfg := relay.DefaultConfig()
	cfg.PGURL = e.url
	cfg.Slot, cfg.Publication = e.name, e.name
	cfg.Router.TopicTemplate = e.topicPrefix() + "{aggregate_type}"
	cfg.Router.DeadLetterTopic = e.topicPrefix() + "dlq"
	cfg.Router.TopicPartitions = 3
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(e.brokers...)}
	cfg.Linger = time.Millisecond
	cfg.StatusInterval = time.Second
	cfg.ReceiveTimeout = 10 * time.Second
	cfg.BackoffMin, cfg.BackoffMax = 100*time.Millisecond, time.Second
	cfg.InitialSnapshot = false
	cfg.HeartbeatInterval = 0
	return cfg
}

// args are the binary's flags equivalent to config().
// dropRoleAtEnd drops role, a cluster-wide object a test created, with
// what it owns in the env's database, when the test ends (after the
// relays it started, whose cleanups run first).
func (e *env) dropRoleAtEnd(role string) {
	e.t.Cleanup(func() {
		ctx := context.Background()
		c, err := pgx.Connect(ctx, e.url)
		if err != nil {
			e.t.Errorf("drop role %s: %v", role, err)
			return
		}
		defer c.Close(ctx)
		ident := pgx.Identifier{role}.Sanitize()
		for _, q := range []string{"DROP OWNED BY " + ident, "DROP ROLE " + ident} {
			if _, err := c.Exec(ctx, q); err != nil {
				e.t.Errorf("%s: %v", q, err)
			}
		}
	})
}

func (e *env) args() []string {
	return []string{
		"run", "--pg-url", e.url, "--brokers", strings.Join(e.brokers, ","),
		"--slot", e.name, "--publication", e.name,
		"--topic-template", e.topicPrefix() + "{aggregate_type}", "--dead-letter-topic", e.topicPrefix() + "dlq",
		"--topic-partitions", "3", "--status-interval", "1s", "--receive-timeout", "10s", "--backoff-max", "1s", "--linger", "1ms",
		"--metrics-addr", "", "--log-level", "info",
	}
}

// running is an in-process relay.
type running struct {
	relay  *relay.Relay
	cancel context.CancelFunc
	done   chan error
}

// startRelay runs a relay in-process until the test ends (or stop).
func (e *env) startRelay(cfg relay.Config) *running {
	e.t.Helper()
	rr, _ := e.startRelayGathered(cfg)
	return rr
}

// startRelayGathered is startRelay with the relay's metrics on a registry
// the test reads (see gathered).
func (e *env) startRelayGathered(cfg relay.Config) (*running, *prometheus.Registry) {
	e.t.Helper()
	rr, reg := e.launchRelay(cfg)
	e.waitFor("relay streaming", 60*time.Second, func() (bool, error) {
		if ok, err := rr.returned(); ok {
			return false, fmt.Errorf("relay stopped: %v", err)
		}
		return rr.relay.Streaming(), nil
	})
	return rr, reg
}

// launchRelay runs a relay in-process until the test ends (or stop),
// without waiting for it to stream.
func (e *env) launchRelay(cfg relay.Config) (*running, *prometheus.Registry) {
	e.t.Helper()
	var log *zap.Logger
	if *verbose {
		log = zaptest.NewLogger(e.t)
	} else {
		log = zaptest.NewLogger(e.t, zaptest.Level(zap.WarnLevel))
	}
	if e.logCore != nil {
		log = zap.New(zapcore.NewTee(log.Core(), e.logCore))
	}
	reg := prometheus.NewRegistry()
	r, err := relay.New(cfg, log, metrics.New(reg))
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	rr := &running{relay: r, cancel: cancel, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(ctx) }()
	e.t.Cleanup(func() { _ = rr.stop(e.t) })
	return rr, reg
}

// returned reports whether Run returned, and its error.
func (rr *running) returned() (bool, error) {
	select {
	case err := <-rr.done:
		rr.done <- err
		return true, err
	default:
		return false, nil
	}
}

// gathered returns the values of metric name by label values.
func gathered(reg *prometheus.Registry, name string) map[string]float64 {
	out := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		return out
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetValue())
			}
			if v := m.GetCounter().GetValue() + m.GetGauge().GetValue(); v != 0 {
				out[strings.Join(labels, ",")] = v
			}
		}
	}
	return out
}

// stop cancels the relay and waits for Run to return; it returns Run's
// error.
func (rr *running) stop(t *testing.T) error {
	rr.cancel()
	select {
	case err := <-rr.done:
		rr.done <- err
		return err
	case <-time.After(60 * time.Second):
		t.Fatal("relay did not stop within 60s")
		return nil
	}
}

// waitFor polls cond until it holds or fails the test after timeout.
func (e *env) waitFor(what string, timeout time.Duration, cond func() (bool, error)) {
	e.t.Helper()
	if err := devcluster.WaitFor(timeout, 20*time.Millisecond, cond); err != nil {
		e.t.Fatalf("waiting for %s: %v", what, err)
	}
}

// slotInfo reads the test slot's row of pg_replication_slots.
func (e *env) slotInfo() slot.Info {
	e.t.Helper()
	c, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	defer c.Close(context.Background())
	i, err := slot.ReadInfo(e.ctx, c, e.name)
	if err != nil {
		e.t.Fatal(err)
	}
	return i
}

// currentLSN is the server's WAL insert position.
func (e *env) currentLSN(c *pgx.Conn) decoder.LSN {
	e.t.Helper()
	var l decoder.LSN
	if err := c.QueryRow(e.ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&l); err != nil {
		e.t.Fatal(err)
	}
	return l
}

// writeNoiseFor writes to the table noise (which the test created) for d:
// the walsender decodes it, finds nothing to send and reports its position
// in keepalives. It returns the highest confirmed_flush_lsn seen meanwhile.
func (e *env) writeNoiseFor(conn *pgx.Conn, d time.Duration) decoder.LSN {
	e.t.Helper()
	var maxConfirmed decoder.LSN
	for deadline := time.Now().Add(d); time.Now().Before(deadline); {
		if _, err := conn.Exec(e.ctx, `INSERT INTO noise (v) SELECT repeat('x', 200) FROM generate_series(1, 200)`); err != nil {
			e.t.Fatal(err)
		}
		maxConfirmed = max(maxConfirmed, e.slotInfo().ConfirmedLSN)
		time.Sleep(50 * time.Millisecond) // paces the load
	}
	return maxConfirmed
}

// consumer collects what a Kafka consumer of the test's topics read.
type consumer struct {
	e      *env
	client *kgo.Client
	mu     sync.Mutex
	recs   []*kgo.Record
	fenced *fenceSeen
}

// consume reads every topic of the test from the start.
func (e *env) consume() *consumer { return e.consumeWith() }

// consumeWith is consume with extra client options (SASL, isolation).
func (e *env) consumeWith(extra ...kgo.Opt) *consumer {
	e.t.Helper()
	topics := "^" + regexp.QuoteMeta(e.topicPrefix()) + ".*"
	c := &consumer{e: e, fenced: newFenceSeen(topics)}
	c.client = e.poll(func(fs kgo.Fetches) {
		c.mu.Lock()
		defer c.mu.Unlock()
		fs.EachRecord(func(r *kgo.Record) {
			if !c.fenced.take(r) {
				c.recs = append(c.recs, r)
			}
		})
	}, append([]kgo.Opt{kgo.ConsumeTopics(topics)}, extra...)...)
	return c
}

// poll starts a client reading the topics opts name (regular expressions)
// from the start, and hands every fetch to handle until the test ends.
func (e *env) poll(handle func(kgo.Fetches), opts ...kgo.Opt) *kgo.Client {
	e.t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{
		kgo.SeedBrokers(e.brokers...),
		kgo.ConsumeRegex(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.MetadataMinAge(50 * time.Millisecond),
		kgo.MetadataMaxAge(200 * time.Millisecond),
		kgo.FetchMaxWait(100 * time.Millisecond),
	}, opts...)...)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			handle(cl.PollFetches(ctx))
		}
	}()
	e.t.Cleanup(func() {
		cancel()
		<-done
		cl.Close()
	})
	return cl
}

// records returns a copy of what was read so far.
func (c *consumer) records() []*kgo.Record {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*kgo.Record(nil), c.recs...)
}

// waitIDs waits until records with n distinct id headers were read, and
// returns everything read.
func (c *consumer) waitIDs(n int, timeout time.Duration) []*kgo.Record {
	c.e.t.Helper()
	var recs []*kgo.Record
	waitDistinctIDs(c.e.t, c.idsRead(&recs), n, timeout)
	return recs
}

// waitAll waits until every id of want was read, and returns everything
// read.
func (c *consumer) waitAll(want []string, timeout time.Duration) []*kgo.Record {
	c.e.t.Helper()
	var recs []*kgo.Record
	waitEveryID(c.e.t, c.idsRead(&recs), want, timeout)
	return recs
}

// waitAllIDs is c.waitAll for want by key (key → ids).
func waitAllIDs(c *consumer, want map[string][]string, timeout time.Duration) []*kgo.Record {
	c.e.t.Helper()
	return c.waitAll(flatIDs(want), timeout)
}

// idsRead is what c read, for the waits: each id with its number of
// copies; *recs is left holding the records it counted.
func (c *consumer) idsRead(recs *[]*kgo.Record) func() map[string]int {
	return func() map[string]int {
		*recs = c.records()
		return distinctIDs(*recs)
	}
}

// waitDistinctIDs waits until read (the ids read so far, each with its
// number of copies) holds n distinct ids, failing the test after timeout.
// Both kinds of consumer wait through it.
func waitDistinctIDs(t *testing.T, read func() map[string]int, n int, timeout time.Duration) {
	t.Helper()
	err := devcluster.WaitFor(timeout, pollEvery(n), func() (bool, error) {
		got := len(read())
		return got >= n, fmt.Errorf("%d distinct ids read", got)
	})
	if err != nil {
		t.Fatalf("waiting for %d distinct ids: %v", n, err)
	}
}

// waitEveryID waits until read holds every id of want, failing the test
// after timeout naming one missing.
func waitEveryID(t *testing.T, read func() map[string]int, want []string, timeout time.Duration) {
	t.Helper()
	err := devcluster.WaitFor(timeout, pollEvery(len(want)), func() (bool, error) {
		got := read()
		missing, example := 0, ""
		for _, id := range want {
			if got[id] == 0 {
				missing++
				example = id
			}
		}
		return missing == 0, fmt.Errorf("%d of %d ids not read (e.g. %s)", missing, len(want), example)
	})
	if err != nil {
		t.Fatalf("waiting for every id: %v", err)
	}
}

// pollEvery is how often a wait for n ids looks: gently once the lists
// get long, as each look copies and counts what was read.
func pollEvery(n int) time.Duration {
	if n > 1000 {
		return 250 * time.Millisecond
	}
	return 20 * time.Millisecond
}

// flatIDs is every id of want (key → ids).
func flatIDs(want map[string][]string) []string {
	var ids []string
	for _, k := range want {
		ids = append(ids, k...)
	}
	return ids
}

func header(r *kgo.Record, key string) (string, bool) {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}

func distinctIDs(recs []*kgo.Record) map[string]int {
	ids := make(map[string]int)
	for _, r := range recs {
		if id, ok := header(r, "id"); ok {
			ids[id]++
		}
	}
	return ids
}

// runBinary starts the walrelay binary with args; its output goes to the
// test log.
func (e *env) runBinary(args ...string) *exec.Cmd {
	e.t.Helper()
	cmd := exec.Command(binPath, args...)
	w := &testWriter{t: e.t, prefix: "walrelay: "}
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

// testWriter forwards a process's output to the test log, line by line.
type testWriter struct {
	t      *testing.T
	prefix string
	mu     sync.Mutex
	buf    []byte
	done   atomic.Bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := strings.IndexByte(string(w.buf), '\n')
		if i < 0 {
			break
		}
		if !w.done.Load() {
			w.t.Log(w.prefix + string(w.buf[:i]))
		}
		w.buf = w.buf[i+1:]
	}
	return len(p), nil
}
