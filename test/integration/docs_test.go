package integration

// docs_test.go runs the shell blocks of README.md and docs/ that are marked
// <!-- exercised: TestName --> for the tests here, as a user pastes them:
// with bash, the walrelay binary first on PATH, against the test's
// PostgreSQL and broker. Where a block holds values that are the user's
// (an `export NAME=value` line, or a variable such as "$PG_URL"), the test
// gives its own and fails on a name it does not know, so a page cannot
// grow a step the test skips. test/docblocks fails on a shell block no
// test runs.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/test/docblocks"
)

// docBlocks returns the blocks marked as exercised by the running test
// (the top-level one, for subtests), page by page; it fails the test when
// there are none.
func docBlocks(t *testing.T) map[string][]docblocks.Block {
	t.Helper()
	name := strings.SplitN(t.Name(), "/", 2)[0]
	pages, err := docblocks.Exercised("../..", name)
	if err != nil {
		t.Fatal(err)
	}
	if len(pages) == 0 {
		t.Fatalf("no shell block of README.md or docs/ is marked <!-- exercised: %s -->", name)
	}
	return pages
}

// sortedPages are the keys of pages, sorted.
func sortedPages(pages map[string][]docblocks.Block) []string {
	var names []string
	for p := range pages {
		names = append(names, p)
	}
	sort.Strings(names)
	return names
}

// shell runs the pasted blocks of one page: in a directory of its own,
// with the environment a user's shell would have (the tests' WALRELAY_*
// and PG* variables removed, the walrelay binary first on PATH) plus what
// the blocks export.
type shell struct {
	e   *env
	dir string
	env []string
}

func newShell(e *env) *shell {
	sh := &shell{e: e, dir: e.t.TempDir()}
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "WALRELAY_") || strings.HasPrefix(kv, "PG") {
			continue
		}
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			kv = "PATH=" + filepath.Dir(binPath) + string(os.PathListSeparator) + v
		}
		sh.env = append(sh.env, kv)
	}
	return sh
}

func (sh *shell) setenv(name, value string) { sh.env = append(sh.env, name+"="+value) }

// run runs block b with bash -euo pipefail and fails the test unless it
// exits 0.
func (sh *shell) run(b docblocks.Block) string {
	t := sh.e.t
	t.Helper()
	ctx, cancel := context.WithTimeout(sh.e.ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", b.Text)
	cmd.Dir, cmd.Env = sh.dir, sh.env
	out, err := cmd.CombinedOutput()
	t.Logf("%s:%d:\n%s-- output:\n%s", b.File, b.Line, b.Text, out)
	if err != nil {
		t.Fatalf("%s:%d: the block failed: %v", b.File, b.Line, err)
	}
	return string(out)
}

// start runs block b, one command, in the background as the user's
// terminal would (exec, so that a signal reaches walrelay itself).
func (sh *shell) start(b docblocks.Block) *background {
	t := sh.e.t
	t.Helper()
	cmds := docblocks.Commands(b.Text)
	if len(cmds) != 1 {
		t.Fatalf("%s:%d: a block that starts the relay must hold one command, found %q", b.File, b.Line, cmds)
	}
	t.Logf("%s:%d: starting %s", b.File, b.Line, cmds[0])
	cmd := exec.Command("bash", "-c", "exec "+cmds[0])
	cmd.Dir, cmd.Env = sh.dir, sh.env
	w := &testWriter{t: t, prefix: "walrelay: "}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	bg := &background{cmd: cmd, done: make(chan struct{})}
	go func() { bg.err = cmd.Wait(); close(bg.done) }()
	t.Cleanup(func() {
		select {
		case <-bg.done:
		default:
			_ = cmd.Process.Kill()
			<-bg.done
		}
	})
	return bg
}

// background is a command a block started.
type background struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// waitReady waits until the relay's /readyz on addr answers 200, failing
// the test if the relay exits first.
func (bg *background) waitReady(e *env, addr string) {
	e.t.Helper()
	e.waitFor("/readyz on "+addr, 2*time.Minute, func() (bool, error) {
		select {
		case <-bg.done:
			e.t.Fatalf("walrelay exited before it was ready: %v", bg.err)
		default:
		}
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, fmt.Errorf("status %s", resp.Status)
	})
}

// stop sends SIGTERM, as Ctrl-C or a supervisor does, and fails the test
// unless walrelay exits 0 within a minute.
func (bg *background) stop(e *env) {
	e.t.Helper()
	if err := bg.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		e.t.Fatal(err)
	}
	select {
	case <-bg.done:
	case <-time.After(time.Minute):
		e.t.Fatal("walrelay did not exit within a minute of SIGTERM")
	}
	if bg.err != nil {
		e.t.Fatalf("walrelay exited after SIGTERM with %v, want 0", bg.err)
	}
}

// ownBroker gives e a kfake broker of its own when it shares one (Apache
// Kafka, an external broker): the pages name their topics
// (outbox.event.order), which tests sharing a broker would share too.
func ownBroker(e *env) {
	if e.kafka != nil {
		return
	}
	k, err := devcluster.StartKafka(devcluster.KafkaOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(k.Close)
	e.kafka, e.brokers = k, []string{k.Addr()}
}

// freeAddr is a loopback address with a port nothing listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// exportLine is one line of a block of `export NAME=value  # comment`.
var exportLine = regexp.MustCompile(`^export ([A-Z_][A-Z0-9_]*)=\S+$`)

// exports reads a block of export lines and returns the names it sets, or
// nil when the block is something else.
func exports(b docblocks.Block) []string {
	var names []string
	for _, c := range docblocks.Commands(b.Text) {
		m := exportLine.FindStringSubmatch(c)
		if m == nil {
			return nil
		}
		names = append(names, m[1])
	}
	return names
}

// records collects what a consumer read from topic.
func (e *env) topicRecords(topic string) func() []*kgo.Record {
	var mu sync.Mutex
	var recs []*kgo.Record
	e.poll(func(fs kgo.Fetches) {
		mu.Lock()
		defer mu.Unlock()
		recs = append(recs, fs.Records()...)
	}, kgo.ConsumeTopics("^"+regexp.QuoteMeta(topic)+"$"))
	return func() []*kgo.Record {
		mu.Lock()
		defer mu.Unlock()
		return append([]*kgo.Record(nil), recs...)
	}
}

// TestGettingStarted runs the five steps of the README and of
// docs/getting-started.md, each page on a database of its own: the
// variables, the outbox table, the role and the publication (as the
// superuser), `walrelay run` as that role, what to watch (an insert,
// status, /readyz, /metrics), the stop by SIGTERM, and `walrelay drop`.
// The record the step inserts must arrive, the stop must exit 0 and the
// drop must leave no slot.
func TestGettingStarted(t *testing.T) {
	if pgCluster == nil {
		t.Skip("creates the cluster-wide role walrelay: needs the package's throwaway cluster, not WALRELAY_TEST_PG_URL")
	}
	for _, tool := range []string{"bash", "psql", "curl"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("the getting-started steps call %s, which is not on PATH: run make deps", tool)
		}
	}
	pages := docBlocks(t)
	for _, page := range sortedPages(pages) {
		t.Run(filepath.Base(page), func(t *testing.T) { gettingStarted(t, pages[page]) })
	}
}

func gettingStarted(t *testing.T, blocks []docblocks.Block) {
	e := newEnv(t)
	ownBroker(e)
	e.exec("DROP TABLE outbox") // the page creates its own
	u, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User("walrelay")
	passfile := filepath.Join(t.TempDir(), "pgpass")
	if err := os.WriteFile(passfile, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	metricsAddr := freeAddr(t)
	values := map[string]string{
		"ADMIN_URL":             e.url,
		"WALRELAY_PG_URL":       u.String(),
		"PGPASSFILE":            passfile, // the cluster trusts local connections: an empty passfile
		"WALRELAY_BROKERS":      strings.Join(e.brokers, ","),
		"WALRELAY_METRICS_ADDR": metricsAddr,
	}
	// The role is the cluster's: drop it after the test (once the relay is
	// stopped and its slot dropped), so the next page creates it again.
	e.dropRoleAtEnd("walrelay")
	t.Cleanup(func() {
		ctx := context.Background()
		if c, err := pgx.Connect(ctx, e.url); err == nil {
			_, _ = c.Exec(ctx, "SELECT pg_drop_replication_slot('walrelay') FROM pg_replication_slots WHERE slot_name = 'walrelay' AND NOT active")
			c.Close(ctx)
		}
	})
	records := e.topicRecords("outbox.event.order")
	sh := newShell(e)
	var relay *background
	var seen []string
	for _, b := range blocks {
		switch names := exports(b); {
		case names != nil:
			set := map[string]bool{}
			for _, n := range names {
				v, ok := values[n]
				if !ok {
					t.Fatalf("%s:%d: exports %s, which the test has no value for: give it one here", b.File, b.Line, n)
				}
				sh.setenv(n, v)
				set[n] = true
			}
			for n := range values {
				if !set[n] {
					t.Fatalf("%s:%d: does not export %s, which the test provides: take it out of the test", b.File, b.Line, n)
				}
			}
			seen = append(seen, "variables")
		case strings.HasPrefix(strings.Join(docblocks.Commands(b.Text), "\n"), "walrelay run"):
			relay = sh.start(b)
			relay.waitReady(e, metricsAddr)
			seen = append(seen, "run")
		case strings.Contains(b.Text, "walrelay drop"):
			if relay == nil {
				t.Fatalf("%s:%d: drops the slot before any block started the relay", b.File, b.Line)
			}
			// The page says: Ctrl-C or SIGTERM, then drop.
			relay.stop(e)
			sh.run(b)
			seen = append(seen, "stop and drop")
		default:
			out := sh.run(b)
			if strings.Contains(b.Text, "INSERT INTO outbox") {
				if !strings.Contains(out, "walrelay_events_published_total") && !strings.Contains(out, "walrelay_slot_lag_bytes") {
					t.Errorf("%s:%d: the metrics the block greps for are not in its output", b.File, b.Line)
				}
				seen = append(seen, "watch")
				// The page says the event arrives; the next step stops the
				// relay, which confirms what Kafka acknowledged and reads no
				// further. Stopping before the relay has read the row leaves
				// it in the slot, and the page's drop then refuses, rightly
				// (seen on a loaded CI machine: SIGTERM 300 ms after the
				// INSERT, before the walsender's message was read).
				waitForOrderEvent(e, records)
			} else {
				seen = append(seen, "sql")
			}
		}
	}
	if want := "variables sql sql run watch stop and drop"; strings.Join(seen, " ") != want {
		t.Errorf("the page's steps ran as %q, want %q", strings.Join(seen, " "), want)
	}
	if n := len(records()); n != 1 {
		t.Errorf("%d records on outbox.event.order, want the one inserted", n)
	}
	var slots int
	if err := e.conn().QueryRow(e.ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'walrelay'").Scan(&slots); err != nil {
		t.Fatal(err)
	}
	if slots != 0 {
		t.Errorf("slot walrelay still exists after the page's walrelay drop")
	}
}

// waitForOrderEvent waits for the getting-started page's one event, and
// checks its key, id header and value.
func waitForOrderEvent(e *env, records func() []*kgo.Record) {
	e.waitFor("the inserted event on outbox.event.order", 30*time.Second, func() (bool, error) {
		for _, r := range records() {
			if string(r.Key) == "order-1" {
				if id, ok := header(r, "id"); !ok || id == "" {
					return false, errors.New("no id header")
				}
				if !bytes.Equal(r.Value, []byte(`{"total": 42}`)) {
					return false, fmt.Errorf("value %q", r.Value)
				}
				return true, nil
			}
		}
		return false, fmt.Errorf("%d records, none with key order-1", len(records()))
	})
}

// TestDebeziumTakeover runs step 4 of docs/debezium.md's "Moving from
// Debezium" on what a stopped Debezium connector leaves with its defaults:
// the slot debezium, the publication dbz_publication FOR ALL TABLES, and
// rows committed after the slot's confirmed position while nothing read
// it. walrelay must deliver those rows and the later ones as the Event
// Router would (key aggregateid, header id, no type header, the payload),
// create no slot of its own, and leave the slot in place, confirmed, on
// SIGTERM. TestDebeziumMoveInPlace does the same move with Debezium itself
// on Apache Kafka.
func TestDebeziumTakeover(t *testing.T) {
	pages := docBlocks(t)
	e := newEnv(t)
	ownBroker(e)
	e.exec("DROP TABLE outbox")
	e.debeziumOutbox("public.outbox", "jsonb")
	e.exec("CREATE PUBLICATION dbz_publication FOR ALL TABLES")
	e.exec("SELECT pg_create_logical_replication_slot('debezium', 'pgoutput')")
	// insert commits a row and returns a WAL position inside its
	// transaction: the slot is confirmed past it once the row is in Kafka.
	insert := func(agg, id string) string {
		var lsn string
		if err := e.conn().QueryRow(e.ctx, "INSERT INTO public.outbox (aggregatetype, aggregateid, type, payload) VALUES ($1, $2, 'OrderCreated', jsonb_build_object('order', $3::text)) RETURNING pg_current_wal_insert_lsn()::text", agg, id, id).Scan(&lsn); err != nil {
			t.Fatal(err)
		}
		return lsn
	}
	for i := 1; i <= 3; i++ { // while neither Debezium nor walrelay runs
		insert("order", fmt.Sprintf("o-%d", i))
	}
	records := e.topicRecords("outbox.event.order")
	metricsAddr := freeAddr(t)
	for _, page := range sortedPages(pages) {
		var runs []docblocks.Block
		for _, b := range pages[page] {
			if strings.HasPrefix(strings.Join(docblocks.Commands(b.Text), " "), "walrelay run") {
				runs = append(runs, b)
			}
		}
		if len(runs) != 1 || len(pages[page]) != 1 {
			t.Fatalf("%s: %d blocks marked for this test, %d of them walrelay run: want the one that starts walrelay", page, len(pages[page]), len(runs))
		}
		b := runs[0]
		for _, v := range regexp.MustCompile(`\$\{?([A-Z_]+)`).FindAllStringSubmatch(b.Text, -1) {
			if v[1] != "PG_URL" && v[1] != "BROKERS" {
				t.Fatalf("%s:%d: uses $%s, which the test has no value for", b.File, b.Line, v[1])
			}
		}
		sh := newShell(e)
		sh.setenv("PG_URL", e.url)
		sh.setenv("BROKERS", strings.Join(e.brokers, ","))
		// Not in the block: the default :9187 may be taken on a shared machine.
		sh.setenv("WALRELAY_METRICS_ADDR", metricsAddr)
		relay := sh.start(b)
		relay.waitReady(e, metricsAddr)
		last := insert("order", "o-4") // while walrelay streams
		e.waitFor("the four rows on outbox.event.order", 30*time.Second, func() (bool, error) {
			keys := map[string]bool{}
			for _, r := range records() {
				keys[string(r.Key)] = true
			}
			return len(keys) == 4, fmt.Errorf("keys read: %v", keys)
		})
		for _, r := range records() {
			id, ok := header(r, "id")
			if _, typed := header(r, "type"); !ok || id == "" || typed || len(r.Headers) != 1 {
				t.Errorf("record %s has headers %v, want the id alone (the Event Router's defaults)", r.Key, r.Headers)
			}
			if want := fmt.Sprintf(`{"order": "%s"}`, r.Key); string(r.Value) != want {
				t.Errorf("record %s has value %q, want the payload %q", r.Key, r.Value, want)
			}
		}
		if n := e.slotCount(); n != 1 {
			t.Errorf("%d slots in the database, want Debezium's alone (the step must create none)", n)
		}
		relay.stop(e)
		var confirmed string
		var passed bool
		if err := e.conn().QueryRow(e.ctx, "SELECT confirmed_flush_lsn::text, confirmed_flush_lsn > $1::pg_lsn FROM pg_replication_slots WHERE slot_name = 'debezium'", last).Scan(&confirmed, &passed); err != nil {
			t.Fatalf("the slot debezium after the stop: %v", err)
		}
		if !passed {
			t.Errorf("slot debezium confirmed to %s after the stop, not past the last row's transaction (%s in it)", confirmed, last)
		}
	}
}
