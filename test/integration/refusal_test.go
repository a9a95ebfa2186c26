package integration

// Tests of what bad input gets: invalid
// events go to the dead-letter topic (or fail / are skipped on request),
// bad setups refuse to start with one line naming the fix, and secrets
// (Kafka SASL and PostgreSQL passwords) never reach the output.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/slot"
)

// ---------------------------------------------------------------------------
// Helpers

// syncBuffer collects a process's output.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// proc is a running walrelay binary whose combined output is both logged
// and kept.
type proc struct {
	cmd   *exec.Cmd
	out   *syncBuffer
	start time.Time
	done  chan struct{}
	err   error
}

// startProc starts the binary with args and extra environment variables.
func startProc(t *testing.T, extraEnv []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(binPath, args...)
	cmd.Env = append(os.Environ(), extraEnv...)
	p := &proc{cmd: cmd, out: &syncBuffer{}, done: make(chan struct{})}
	w := io.MultiWriter(&testWriter{t: t, prefix: "walrelay: "}, p.out)
	cmd.Stdout, cmd.Stderr = w, w
	p.start = time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// wait waits up to limit for the process to exit and returns its exit code
// and how long it ran. If it does not exit in time, ok is false and it is
// sent SIGTERM (then, after 30s more, SIGKILL), so that what it prints
// when stopped can still be checked; code is then the code it exited with
// after the signal.
func (p *proc) wait(limit time.Duration) (code int, elapsed time.Duration, ok bool) {
	ok = true
	select {
	case <-p.done:
		elapsed = time.Since(p.start)
	case <-time.After(limit):
		ok = false
		elapsed = time.Since(p.start)
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
	if p.err == nil {
		return 0, elapsed, ok
	}
	if ee, isExit := p.err.(*exec.ExitError); isExit {
		return ee.ExitCode(), elapsed, ok
	}
	return -1, elapsed, ok
}

// runBounded runs the binary to completion. If it has not exited after
// limit, exited is false and it was stopped with SIGTERM (out then holds
// what it printed when stopped).
func runBounded(t *testing.T, limit time.Duration, extraEnv []string, args ...string) (out string, code int, elapsed time.Duration, exited bool) {
	t.Helper()
	p := startProc(t, extraEnv, args...)
	code, elapsed, exited = p.wait(limit)
	return p.out.String(), code, elapsed, exited
}

// withFlag returns args with flag set to value: replaced where args has it
// (followed by a value), appended otherwise.
func withFlag(args []string, flag, value string) []string {
	out := append([]string(nil), args...)
	for i := 0; i+1 < len(out); i++ {
		if out[i] == flag {
			out[i+1] = value
			return out
		}
	}
	return append(out, flag, value)
}

// closedPort is a TCP port on 127.0.0.1 that nothing listens on.
func closedPort(t *testing.T) int {
	t.Helper()
	p, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// waitSlotActive waits until the test's slot exists and is streamed from.
func (e *env) waitSlotActive(p *proc) {
	e.t.Helper()
	e.waitFor("slot active", 60*time.Second, func() (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("walrelay exited: %v", p.err)
		default:
		}
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
}

// waitStreaming waits until the relay binary p logs that it streams:
// past its setup and initial snapshot, which the slot showing active is
// not.
func (e *env) waitStreaming(p *proc) {
	e.t.Helper()
	e.waitFor("the relay streaming", time.Minute, func() (bool, error) {
		return strings.Contains(p.out.String(), `"msg":"streaming"`), nil
	})
}

// newClusterEnv is an env whose database lives on a PostgreSQL cluster of
// its own, started with settings (for server configurations the shared
// cluster must not have). Skipped against an external PostgreSQL.
func newClusterEnv(t *testing.T, settings map[string]string) (*env, *devcluster.Postgres) {
	t.Helper()
	if pgCluster == nil {
		t.Skip("needs a PostgreSQL cluster of its own; skipped against an external PostgreSQL")
	}
	pg, err := devcluster.StartPostgres(context.Background(), devcluster.PostgresOptions{Settings: settings})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })
	// newEnvOn's cleanups (registered later) run before the cluster closes.
	e := newEnvOn(t, pg.URL("postgres"))
	return e, pg
}

// createRole creates a cluster-wide login role (dropped at the end of the
// test) and returns the test database's URL connecting as it.
func (e *env) createRole(name, attrs, password string) string {
	e.t.Helper()
	admin, err := pgx.Connect(e.ctx, pgAdminURL)
	if err != nil {
		e.t.Fatal(err)
	}
	defer admin.Close(context.Background())
	ident := pgx.Identifier{name}.Sanitize()
	if _, err := admin.Exec(e.ctx, fmt.Sprintf("DROP ROLE IF EXISTS %s", ident)); err != nil {
		e.t.Fatal(err)
	}
	if _, err := admin.Exec(e.ctx, fmt.Sprintf("CREATE ROLE %s LOGIN %s PASSWORD '%s'", ident, attrs, password)); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		ctx := context.Background()
		if c, err := pgx.Connect(ctx, e.url); err == nil {
			_, _ = c.Exec(ctx, "DROP OWNED BY "+ident)
			c.Close(ctx)
		}
		if c, err := pgx.Connect(ctx, pgAdminURL); err == nil {
			_, _ = c.Exec(ctx, "DROP ROLE IF EXISTS "+ident)
			c.Close(ctx)
		}
	})
	u, err := url.Parse(e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	u.User = url.UserPassword(name, password)
	return u.String()
}

// ---------------------------------------------------------------------------
// Invalid events

// TestInvalidEventsDeadLettered runs the relay in-process and inserts each
// kind of invalid event between valid ones, all with the same aggregate id:
// NULL and empty aggregate_type, an aggregate type making an invalid topic
// name, NULL aggregate_id, and a record over the destination topic's own
// max.message.bytes (4096, set before the relay sees the topic), plus a
// record just under that limit. Each invalid event lands on the dead-letter
// topic with the reason, table, a parseable LSN within its transaction's
// WAL range, its id header and its payload as value; the valid events (and
// the one just under the limit) reach their topics in order; the
// dead-letter counter counts each reason; the relay keeps streaming.
func TestInvalidEventsDeadLettered(t *testing.T) {
	e := newEnv(t)
	const topicLimit = 4096
	// Pre-create the topic of aggregate type "big" with a small limit.
	admCl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer admCl.Close()
	limit := fmt.Sprint(topicLimit)
	resp, err := kadm.NewClient(admCl).CreateTopic(e.ctx, 3, 1, map[string]*string{"max.message.bytes": &limit}, e.topic("big"))
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("create topic %s: %v", e.topic("big"), err)
	}

	rr, reg := e.startRelayGathered(e.config())
	c := e.consume()
	conn := e.conn()

	// A JSON payload whose jsonb text form is exactly n bytes.
	pad := func(n int) string { return `{"pad": "` + strings.Repeat("x", n-11) + `"}` }
	// walrelay's size estimate of a record here (key "agg-1", a 36-byte id
	// header, type header "T") is 139 bytes plus the value: 3941 bytes of
	// payload come to 4080, under the limit; 5000 are well over it (and
	// well under the dead-letter topic's 1 MB).
	fits, tooBig := pad(3941), pad(5000)

	type row struct {
		name       string
		aggType    *string
		aggID      *string
		payload    string
		reason     deadletter.Reason // "" for a valid event
		topic      string            // valid events
		id         string
		from, upTo decoder.LSN
	}
	str := func(s string) *string { return &s }
	agg := str("agg-1")
	var rows []*row
	valid := func(n int) *row {
		return &row{name: fmt.Sprint("valid ", n), aggType: str("order"), aggID: agg, payload: fmt.Sprintf(`{"seq": %d}`, n), topic: e.topic("order")}
	}
	rows = append(rows,
		valid(0),
		&row{name: "NULL aggregate_type", aggType: nil, aggID: agg, payload: `{"bad": "null type"}`, reason: deadletter.ReasonNoAggregateType},
		valid(1),
		&row{name: "empty aggregate_type", aggType: str(""), aggID: agg, payload: `{"bad": "empty type"}`, reason: deadletter.ReasonNoAggregateType},
		valid(2),
		&row{name: "invalid topic name", aggType: str("bad type!"), aggID: agg, payload: `{"bad": "topic"}`, reason: deadletter.ReasonInvalidTopic},
		valid(3),
		&row{name: "NULL aggregate_id", aggType: str("order"), aggID: nil, payload: `{"bad": "null id"}`, reason: deadletter.ReasonNoAggregateID},
		valid(4),
		&row{name: "over the topic's limit", aggType: str("big"), aggID: agg, payload: tooBig, reason: deadletter.ReasonTooLarge},
		valid(5),
		&row{name: "just under the topic's limit", aggType: str("big"), aggID: agg, payload: fits, topic: e.topic("big")},
		valid(6),
	)
	for i, r := range rows {
		r.from = e.currentLSN(conn)
		if err := conn.QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
			VALUES ($1, $2, 'T', $3::jsonb, $4) RETURNING id::text`, r.aggType, r.aggID, r.payload, i).Scan(&r.id); err != nil {
			t.Fatalf("insert %s: %v", r.name, err)
		}
		r.upTo = e.currentLSN(conn)
	}

	recs := c.waitIDs(len(rows), 60*time.Second)
	byID := map[string]*kgo.Record{}
	for _, rec := range recs {
		id, _ := header(rec, "id")
		if prev, dup := byID[id]; dup {
			t.Errorf("id %s read twice: on %s and %s", id, prev.Topic, rec.Topic)
		}
		byID[id] = rec
	}
	dlq := e.topicPrefix() + "dlq"
	wantCounts := map[string]float64{}
	var wantOrder []string
	for _, r := range rows {
		rec := byID[r.id]
		if rec == nil {
			t.Errorf("%s (id %s): not read from any topic", r.name, r.id)
			continue
		}
		if string(rec.Value) != r.payload {
			t.Errorf("%s: value %.80q…, want the payload %.80q…", r.name, rec.Value, r.payload)
		}
		if r.reason == "" {
			if rec.Topic != r.topic {
				t.Errorf("%s: on topic %q, want %q", r.name, rec.Topic, r.topic)
			}
			if r.topic == e.topic("order") {
				wantOrder = append(wantOrder, r.id)
			}
			continue
		}
		wantCounts[string(r.reason)]++
		if rec.Topic != dlq {
			t.Errorf("%s: on topic %q, want the dead-letter topic %q", r.name, rec.Topic, dlq)
			continue
		}
		if got, _ := header(rec, deadletter.HeaderReason); got != string(r.reason) {
			t.Errorf("%s: %s = %q, want %q", r.name, deadletter.HeaderReason, got, r.reason)
		}
		if got, _ := header(rec, deadletter.HeaderTable); got != "public.outbox" {
			t.Errorf("%s: %s = %q, want public.outbox", r.name, deadletter.HeaderTable, got)
		}
		if d, _ := header(rec, deadletter.HeaderDetail); d == "" {
			t.Errorf("%s: no %s header", r.name, deadletter.HeaderDetail)
		}
		lsnText, _ := header(rec, deadletter.HeaderLSN)
		if lsn, err := slot.ParseLSN(lsnText); err != nil || lsn == 0 {
			t.Errorf("%s: %s = %q: %v", r.name, deadletter.HeaderLSN, lsnText, err)
		} else if lsn < r.from || lsn > r.upTo {
			t.Errorf("%s: %s = %s, outside the WAL its transaction wrote [%s, %s]", r.name, deadletter.HeaderLSN, lsn, r.from, r.upTo)
		}
		if r.aggID != nil && string(rec.Key) != *r.aggID {
			t.Errorf("%s: dead-letter key %q, want the aggregate id %q", r.name, rec.Key, *r.aggID)
		}
		if r.reason == deadletter.ReasonInvalidTopic {
			if got, _ := header(rec, deadletter.HeaderTopic); got != e.topic("bad type!") {
				t.Errorf("%s: %s = %q, want %q", r.name, deadletter.HeaderTopic, got, e.topic("bad type!"))
			}
		}
	}
	// The valid events of aggregate agg-1 on "order", in insert order.
	var gotOrder []string
	for _, rec := range recs {
		if rec.Topic == e.topic("order") {
			id, _ := header(rec, "id")
			gotOrder = append(gotOrder, id)
		}
	}
	if fmt.Sprint(gotOrder) != fmt.Sprint(wantOrder) {
		t.Errorf("valid events on %s in order %v, want %v", e.topic("order"), gotOrder, wantOrder)
	}

	got := gathered(reg, "walrelay_events_dead_lettered_total")
	for _, reason := range deadletter.Reasons() {
		if got[string(reason)] != wantCounts[string(reason)] {
			t.Errorf("walrelay_events_dead_lettered_total{reason=%q} = %v, want %v", reason, got[string(reason)], wantCounts[string(reason)])
		}
	}
	pub := gathered(reg, "walrelay_events_published_total")
	if pub[e.topic("order")] != 7 || pub[e.topic("big")] != 1 {
		t.Errorf("walrelay_events_published_total = %v, want 7 on %s and 1 on %s", pub, e.topic("order"), e.topic("big"))
	}
	if !rr.relay.Streaming() {
		t.Error("relay not streaming after the invalid events")
	}
	// And it still delivers.
	var last string
	if err := conn.QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
		VALUES ('order', 'agg-1', 'T', '{"seq": 7}') RETURNING id::text`).Scan(&last); err != nil {
		t.Fatal(err)
	}
	c.waitIDs(len(rows)+1, 30*time.Second)
	if !rr.relay.Streaming() {
		t.Error("relay not streaming at the end")
	}
}

// TestOnInvalidFailAndSkip runs the binary with --on-invalid fail and skip.
// fail: after a valid event, a NULL aggregate_id row stops it with a
// non-zero exit and a line naming the reason and the row's id; the event
// after it is not published, and a relay restarted with the default (dlq)
// dead-letters the invalid row and delivers the next: nothing was skipped.
// skip: nothing reaches the dead-letter topic, the events after it are
// delivered and the invalid one is counted.
func TestOnInvalidFailAndSkip(t *testing.T) {
	insert := func(e *env, aggID *string, n int) string {
		t.Helper()
		var id string
		if err := e.conn().QueryRow(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
			VALUES ('o', $1, 'T', jsonb_build_object('seq', $2::int), $2) RETURNING id::text`, aggID, n).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	key := "k"

	t.Run("fail", func(t *testing.T) {
		e := newEnv(t)
		p := startProc(t, nil, withFlag(e.args(), "--on-invalid", "fail")...)
		c := e.consume()
		e.waitSlotActive(p)
		insert(e, &key, 0)
		c.waitIDs(1, 30*time.Second)
		bad := insert(e, nil, 1)
		after := insert(e, &key, 2)
		code, _, exited := p.wait(15 * time.Second)
		out := p.out.String()
		if code == 0 {
			t.Errorf("exit code 0 after an invalid event with --on-invalid fail")
		}
		var line string
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, string(deadletter.ReasonNoAggregateID)) && strings.Contains(l, bad) {
				line = l
			}
		}
		if line == "" {
			t.Errorf("no output line names reason %s and id %s:\n%s", deadletter.ReasonNoAggregateID, bad, out)
		}
		e.fence("", c) // what the stopped relay published is read by now
		for _, r := range c.records() {
			if id, _ := header(r, "id"); id == after || id == bad {
				t.Errorf("id %s published on %s although the relay stopped at the invalid event before it", id, r.Topic)
			}
		}

		// Restarted with dead-lettering, the invalid row and the next
		// event come through: --on-invalid fail did not confirm past it.
		p2 := startProc(t, nil, e.args()...)
		recs := c.waitIDs(3, 60*time.Second)
		byID := map[string]*kgo.Record{}
		for _, r := range recs {
			id, _ := header(r, "id")
			byID[id] = r
		}
		if r := byID[bad]; r == nil || r.Topic != e.topicPrefix()+"dlq" {
			t.Errorf("invalid row %s after restart with dlq: %v, want on the dead-letter topic", bad, r)
		} else if reason, _ := header(r, deadletter.HeaderReason); reason != string(deadletter.ReasonNoAggregateID) {
			t.Errorf("dead-letter reason %q, want %s", reason, deadletter.ReasonNoAggregateID)
		}
		if r := byID[after]; r == nil || r.Topic != e.topic("o") {
			t.Errorf("event %s after the invalid row: %v, want on %s", after, r, e.topic("o"))
		}
		_ = p2.cmd.Process.Signal(syscall.SIGTERM)
		if code, _, ok := p2.wait(60 * time.Second); !ok || code != 0 {
			t.Errorf("SIGTERM: exit %d (exited %v), want 0", code, ok)
		}
		if !exited {
			t.Errorf("walrelay --on-invalid fail did not exit by itself within 15s of the invalid event (it was stopped with SIGTERM)")
		}
	})

	t.Run("skip", func(t *testing.T) {
		e := newEnv(t)
		port, err := devcluster.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		args := withFlag(withFlag(e.args(), "--on-invalid", "skip"), "--metrics-addr", addr)
		p := startProc(t, nil, args...)
		c := e.consume()
		e.waitSlotActive(p)
		v1 := insert(e, &key, 0)
		bad := insert(e, nil, 1)
		v2 := insert(e, &key, 2)
		v3 := insert(e, &key, 3)
		c.waitIDs(3, 30*time.Second)
		e.fence("", c) // a wrongly published record would be read by now
		recs := c.records()
		var got []string
		for _, r := range recs {
			id, _ := header(r, "id")
			if r.Topic == e.topicPrefix()+"dlq" || id == bad {
				t.Errorf("record on %s (id %s) with --on-invalid skip", r.Topic, id)
				continue
			}
			got = append(got, id)
		}
		if want := []string{v1, v2, v3}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("delivered %v, want %v", got, want)
		}
		series := fmt.Sprintf(`walrelay_events_dead_lettered_total{reason=%q}`, deadletter.ReasonNoAggregateID)
		var body string
		e.waitFor("skipped event counted", 30*time.Second, func() (bool, error) {
			resp, err := http.Get("http://" + addr + "/metrics")
			if err != nil {
				return false, err
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			body = string(b)
			return metricValue(body, series) == 1, fmt.Errorf("%s = %v", series, metricValue(body, series))
		})
		if !strings.Contains(p.out.String(), bad) {
			t.Errorf("the skipped event's id %s is not in the log", bad)
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		if code, _, ok := p.wait(60 * time.Second); !ok || code != 0 {
			t.Errorf("SIGTERM: exit %d (exited %v), want 0", code, ok)
		}
	})
}

// ---------------------------------------------------------------------------
// Refusals to start

// TestStartupRefusals runs `walrelay run` against each setup it must refuse
// and checks it exits non-zero, within a bounded time, printing the line
// that names the problem and its fix; nothing is created behind the
// refusal's back. The wal_level and lost-slot cases need clusters of their
// own (skipped against an external PostgreSQL).
func TestStartupRefusals(t *testing.T) {
	type tc struct {
		name string
		// prepare sets the case up and returns the arguments.
		prepare func(t *testing.T, e *env) []string
		want    []string // substrings of the output
		limit   time.Duration
		// own: the settings of a cluster of its own (nil: the shared one).
		own map[string]string
		// check runs after the refusal.
		check func(t *testing.T, e *env)
		// code is the exit code, when the case has one of its own (0:
		// any but 0).
		code int
	}
	run := func(e *env, more ...string) []string {
		return withFlag(append(e.args(), more...), "--startup-timeout", "5s")
	}
	noSlot := func(t *testing.T, e *env) {
		if _, err := e.slotInfoErr(); err == nil {
			t.Errorf("slot %s was created although walrelay refused to start", e.name)
		}
	}
	cases := []tc{
		{
			name: "wal_level replica",
			own:  map[string]string{"wal_level": "replica"},
			prepare: func(t *testing.T, e *env) []string {
				return run(e)
			},
			want:  []string{`wal_level is "replica"`, "wal_level = logical", "restart PostgreSQL"},
			check: noSlot,
		},
		{
			name: "role without REPLICATION",
			prepare: func(t *testing.T, e *env) []string {
				role := e.name + "_norepl"
				u := e.createRole(role, "NOREPLICATION NOSUPERUSER", "norepl-pw")
				e.exec(fmt.Sprintf("GRANT SELECT ON outbox TO %s", pgx.Identifier{role}.Sanitize()))
				return withFlag(run(e), "--pg-url", u)
			},
			want:  []string{"lacks the REPLICATION attribute", "WITH REPLICATION"},
			check: noSlot,
		},
		{
			name:    "outbox table missing",
			prepare: func(t *testing.T, e *env) []string { return run(e, "--table", "public.nope") },
			want:    []string{"nope", "does not exist", "--table"},
			check:   noSlot,
		},
		{
			name:    "mapped column missing",
			prepare: func(t *testing.T, e *env) []string { return run(e, "--column-payload", "body") },
			want:    []string{`no column "body"`, "--column-"},
			check:   noSlot,
		},
		{
			name:    "header column missing",
			prepare: func(t *testing.T, e *env) []string { return run(e, "--header-column", "trace_parent=traceparent") },
			want:    []string{`no column "trace_parent"`, "--header-column"},
			check:   noSlot,
		},
		{
			name:    "publication missing, not creatable",
			prepare: func(t *testing.T, e *env) []string { return run(e, "--no-create-publication") },
			want:    []string{"does not exist", "CREATE PUBLICATION", "--create-publication"},
			check: func(t *testing.T, e *env) {
				noSlot(t, e)
				var n int
				if err := e.conn().QueryRow(e.ctx, `SELECT count(*) FROM pg_publication WHERE pubname = $1`, e.name).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n != 0 {
					t.Error("publication created despite --no-create-publication")
				}
			},
		},
		{
			name:    "slot missing, not creatable",
			prepare: func(t *testing.T, e *env) []string { return run(e, "--no-create-slot") },
			want:    []string{"does not exist", "pg_create_logical_replication_slot", "--create-slot"},
			check:   noSlot,
		},
		{
			name: "slot of another plugin",
			prepare: func(t *testing.T, e *env) []string {
				e.exec(`SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, e.name)
				return run(e)
			},
			want: []string{`uses plugin "test_decoding"`, "not pgoutput", "--slot"},
			check: func(t *testing.T, e *env) {
				if i := e.slotInfo(); i.Plugin != "test_decoding" {
					t.Errorf("slot plugin is now %q: walrelay replaced someone else's slot", i.Plugin)
				}
			},
		},
		{
			name: "PostgreSQL unreachable",
			prepare: func(t *testing.T, e *env) []string {
				u := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable&connect_timeout=2", closedPort(t), e.name)
				return withFlag(withFlag(e.args(), "--pg-url", u), "--startup-timeout", "3s")
			},
			want: []string{"gave up", "--startup-timeout 3s", "PostgreSQL"},
			code: 4,
		},
		{
			name: "Kafka unreachable",
			prepare: func(t *testing.T, e *env) []string {
				return withFlag(withFlag(e.args(), "--brokers", fmt.Sprintf("127.0.0.1:%d", closedPort(t))), "--startup-timeout", "3s")
			},
			want:  []string{"gave up", "--startup-timeout 3s", "kafka"},
			limit: 15 * time.Second,
			code:  4,
		},
		{
			name:    "unknown flag",
			prepare: func(t *testing.T, e *env) []string { return append(e.args(), "--no-such-flag") },
			want:    []string{"--no-such-flag"},
			limit:   10 * time.Second,
			check:   noSlot,
		},
		{
			name:    "bad --on-invalid",
			prepare: func(t *testing.T, e *env) []string { return withFlag(e.args(), "--on-invalid", "bogus") },
			want:    []string{"--on-invalid", "bogus", "dlq"},
			limit:   10 * time.Second,
			check:   noSlot,
		},
		{
			name: "topic template never valid",
			prepare: func(t *testing.T, e *env) []string {
				return withFlag(e.args(), "--topic-template", "a b.{aggregate_type}")
			},
			want:  []string{"a b.{aggregate_type}", "never make a valid topic name"},
			limit: 10 * time.Second,
			check: noSlot,
		},
		{
			name:    "header column without a column",
			prepare: func(t *testing.T, e *env) []string { return append(e.args(), "--header-column", "=x") },
			want:    []string{`--header-column "=x"`, "COLUMN=HEADER"},
			limit:   10 * time.Second,
			check:   noSlot,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var e *env
			if c.own != nil {
				e, _ = newClusterEnv(t, c.own)
			} else {
				e = newEnv(t)
			}
			args := c.prepare(t, e)
			limit := c.limit
			if limit == 0 {
				limit = 45 * time.Second
			}
			out, code, elapsed, exited := runBounded(t, limit, nil, args...)
			if code == 0 {
				t.Errorf("exit code 0, want non-zero")
			}
			if c.code != 0 && code != c.code {
				t.Errorf("exit code %d, want %d", code, c.code)
			}
			// The error walrelay exits with (not its JSON log lines) names
			// the problem and the fix.
			final := finalLines(out)
			if strings.Count(final, "\n") > 0 {
				t.Errorf("the error spans several lines, want one:\n%s", final)
			}
			for _, w := range c.want {
				if !strings.Contains(strings.ToLower(final), strings.ToLower(w)) {
					t.Errorf("the error lacks %q: %q\nwhole output:\n%s", w, final, out)
				}
			}
			t.Logf("exit %d after %s: %s", code, elapsed.Round(time.Millisecond), final)
			if c.check != nil {
				c.check(t, e)
			}
			if !exited {
				t.Errorf("walrelay did not exit by itself within %s (it was stopped with SIGTERM)", limit)
			}
		})
	}

	t.Run("slot lost", func(t *testing.T) {
		e, _ := newClusterEnv(t, map[string]string{
			"max_slot_wal_keep_size": "'1MB'",
			"max_wal_size":           "'32MB'",
			"min_wal_size":           "'32MB'",
			"wal_keep_size":          "0",
			"checkpoint_timeout":     "'30min'",
		})
		if out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name); code != 0 {
			t.Fatalf("setup exit %d:\n%s", code, out)
		}
		conn := e.conn()
		walStatus := func() string {
			var s *string
			if err := conn.QueryRow(e.ctx, `SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1`, e.name).Scan(&s); err != nil {
				t.Fatalf("read wal_status: %v", err)
			}
			if s == nil {
				return "<null>"
			}
			return *s
		}
		// Write WAL past max_slot_wal_keep_size and checkpoint until the
		// slot is invalidated.
		i := 0
		for ; walStatus() != "lost"; i++ {
			if i == 40 {
				t.Fatalf("slot not invalidated after writing ~%d MB of WAL: wal_status %s", i*8, walStatus())
			}
			for _, q := range []string{
				`SELECT pg_logical_emit_message(false, 'walrelay.test', repeat('x', 8000000))`,
				`SELECT pg_switch_wal()`,
				`CHECKPOINT`,
			} {
				if _, err := conn.Exec(e.ctx, q); err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}
		}
		t.Logf("slot invalidated after %d rounds of 8 MB of WAL, a WAL switch and a checkpoint", i)
		out, code, elapsed, exited := runBounded(t, 45*time.Second, nil, withFlag(e.args(), "--startup-timeout", "5s")...)
		if !exited {
			t.Errorf("run with a lost slot did not exit by itself within 45s")
		}
		if code == 0 {
			t.Errorf("run with a lost slot: exit 0, want non-zero")
		}
		out = finalLines(out)
		for _, w := range []string{"was invalidated by PostgreSQL", "max_slot_wal_keep_size = 1MB", "walrelay never replaces what it streamed from on its own", "walrelay setup --accept-gap", "walrelay snapshot"} {
			if !strings.Contains(out, w) {
				t.Errorf("run output lacks %q:\n%s", w, out)
			}
		}
		t.Logf("run: exit %d after %s: %s", code, elapsed.Round(time.Millisecond), out)

		out, code = runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
		if code != 1 {
			t.Errorf("status of a lost slot: exit %d, want 1:\n%s", code, out)
		}
		if !strings.Contains(out, "lost") || !strings.Contains(out, "invalidated") {
			t.Errorf("status output does not say the slot is lost / invalidated:\n%s", out)
		}
		t.Logf("status: exit %d:\n%s", code, out)
		// setup must not "repair" it either.
		out, code = runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name)
		if code == 0 || !strings.Contains(out, "invalidated") {
			t.Errorf("setup with a lost slot: exit %d, want a refusal naming the invalidated slot:\n%s", code, out)
		}
		if s := walStatus(); s != "lost" {
			t.Errorf("slot wal_status is %s after run, status and setup: it was recreated or dropped, want it still lost", s)
		}
	})
}

// ---------------------------------------------------------------------------
// Secrets

// TestSASLSCRAM runs the binary against a broker requiring SASL, for each
// mechanism walrelay offers: with the right password (from
// WALRELAY_KAFKA_SASL_PASSWORD) it delivers an event read back by a SASL
// consumer and stops cleanly on SIGTERM. With a wrong one (from the flag)
// and the broker answering SASL_AUTHENTICATION_FAILED, as Apache Kafka
// does, it exits non-zero at once (within 10s, --startup-timeout 60s)
// with an error naming SASL authentication; with kfake's own answer to a
// wrong password (it drops the connection) it gives up at
// --startup-timeout. Neither password ever appears in its output, even at
// debug level.
func TestSASLSCRAM(t *testing.T) {
	if extBrokers != nil {
		t.Skip("needs the in-process kfake broker with SASL users")
	}
	const user, pass, wrong = "relay", "s3cret-Pa55", "wr0ng-Pa55-zz"
	for _, m := range []struct {
		flag, kfake string
		mech        func(user, pass string) kgo.Opt
	}{
		{"scram-sha-256", "SCRAM-SHA-256", func(u, p string) kgo.Opt { return kgo.SASL(scram.Auth{User: u, Pass: p}.AsSha256Mechanism()) }},
		{"scram-sha-512", "SCRAM-SHA-512", func(u, p string) kgo.Opt { return kgo.SASL(scram.Auth{User: u, Pass: p}.AsSha512Mechanism()) }},
		{"plain", "PLAIN", func(u, p string) kgo.Opt { return kgo.SASL(plain.Auth{User: u, Pass: p}.AsMechanism()) }},
	} {
		t.Run(m.flag, func(t *testing.T) {
			e := newEnv(t)
			k, err := devcluster.StartKafka(devcluster.KafkaOptions{Extra: []kfake.Opt{kfake.EnableSASL(), kfake.Superuser(m.kfake, user, pass)}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(k.Close)
			e.kafka, e.brokers = k, []string{k.Addr()}
			saslArgs := []string{"--kafka-sasl-mechanism", m.flag, "--kafka-sasl-user", user}
			if m.flag == "plain" {
				// kfake here has no TLS: PLAIN needs the explicit opt-in.
				saslArgs = append(saslArgs, "--kafka-sasl-allow-plaintext")
			}

			t.Run("right password", func(t *testing.T) {
				args := withFlag(append(e.args(), saslArgs...), "--log-level", "debug")
				p := startProc(t, []string{"WALRELAY_KAFKA_SASL_PASSWORD=" + pass}, args...)
				c := e.consumeWith(m.mech(user, pass))
				e.waitSlotActive(p)
				e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('s', 'k', 'T', '{"sasl": true}')`)
				recs := c.waitIDs(1, 60*time.Second)
				if recs[0].Topic != e.topic("s") || string(recs[0].Value) != `{"sasl": true}` {
					t.Errorf("read %s %q, want %s {\"sasl\": true}", recs[0].Topic, recs[0].Value, e.topic("s"))
				}
				_ = p.cmd.Process.Signal(syscall.SIGTERM)
				code, _, ok := p.wait(60 * time.Second)
				if !ok || code != 0 {
					t.Errorf("SIGTERM: exit %d (exited %v), want 0", code, ok)
				}
				out := p.out.String()
				if strings.Contains(out, pass) {
					t.Errorf("the SASL password appears in the output:\n%s", out)
				}
				if !strings.Contains(out, m.flag) {
					t.Errorf("the startup line does not name the SASL mechanism %s:\n%s", m.flag, out)
				}
			})

			// A wrong password, as Apache Kafka answers it
			// (SaslAuthenticate with SASL_AUTHENTICATION_FAILED): walrelay
			// must stop at once, naming the failure.
			t.Run("wrong password, broker answers SASL_AUTHENTICATION_FAILED", func(t *testing.T) {
				fault := k.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.SASLAuthenticate}, Err: kerr.SaslAuthenticationFailed, Count: -1})
				defer fault.Remove()
				const startup = 60 * time.Second
				args := withFlag(append(e.args(), append(saslArgs, "--kafka-sasl-password", wrong)...), "--startup-timeout", startup.String())
				args = withFlag(args, "--log-level", "debug")
				const limit = 10 * time.Second
				out, code, elapsed, exited := runBounded(t, limit, nil, args...)
				if code == 0 {
					t.Errorf("exit 0 with a wrong SASL password")
				}
				final := finalLines(out)
				if low := strings.ToLower(final); !strings.Contains(low, "sasl") && !strings.Contains(low, "authentication") {
					t.Errorf("the error walrelay exits with does not mention SASL or authentication: %q", final)
				}
				if strings.Contains(out, wrong) || strings.Contains(out, pass) {
					t.Errorf("a SASL password appears in the output:\n%s", out)
				}
				t.Logf("exit %d after %s: %s", code, elapsed.Round(time.Millisecond), final)
				if !exited {
					t.Errorf("walrelay did not exit by itself within %s of a refused SASL authentication (--startup-timeout %s; it was stopped with SIGTERM)", limit, startup)
				}
			})

			// kfake itself drops the connection on a wrong password
			// instead of answering with an error, so walrelay sees EOF,
			// cannot tell it from a network fault and retries; it must
			// still give up at --startup-timeout and never print a
			// password.
			if m.flag != "scram-sha-256" {
				return // the same for every mechanism
			}
			t.Run("wrong password, broker drops the connection", func(t *testing.T) {
				const startup = 5 * time.Second
				args := withFlag(append(e.args(), append(saslArgs, "--kafka-sasl-password", wrong)...), "--startup-timeout", startup.String())
				args = withFlag(args, "--log-level", "debug")
				const limit = startup + 10*time.Second
				out, code, elapsed, exited := runBounded(t, limit, nil, args...)
				if code == 0 {
					t.Errorf("exit 0 with a wrong SASL password")
				}
				if final := finalLines(out); !strings.Contains(final, "gave up") {
					t.Errorf("the error walrelay exits with does not say it gave up: %q", final)
				}
				if strings.Contains(out, wrong) || strings.Contains(out, pass) {
					t.Errorf("a SASL password appears in the output:\n%s", out)
				}
				t.Logf("exit %d after %s: %s", code, elapsed.Round(time.Millisecond), finalLines(out))
				if !exited {
					t.Errorf("walrelay did not exit by itself within %s with --startup-timeout %s (it was stopped with SIGTERM)", limit, startup)
				}
			})
		})
	}
}

// finalLines are the lines of the binary's output that are not JSON log
// lines: the error it exits with.
func finalLines(out string) string {
	var ls []string
	for _, l := range strings.Split(out, "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "{") {
			ls = append(ls, l)
		}
	}
	return strings.Join(ls, "\n")
}

// TestPostgresPasswordNeverLogged runs the binary at debug level with a
// PostgreSQL password in the URL (the cluster trusts 127.0.0.1, so it is
// accepted but not checked): streaming, and failing against a closed port
// with the password in the user info, in a query parameter and in a
// key=value DSN. The password never appears in the output, and the startup
// line shows the target (user@host:port/database) instead of the URL.
func TestPostgresPasswordNeverLogged(t *testing.T) {
	const secret = "pg-Secret-77"
	e := newEnv(t)
	role := e.name + "_p"
	roleURL := e.createRole(role, "REPLICATION", secret)
	e.exec(fmt.Sprintf("GRANT SELECT ON outbox TO %s", pgx.Identifier{role}.Sanitize()))
	e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE outbox WITH (publish = 'insert')`, pgx.Identifier{e.name}.Sanitize()))
	// The least privilege of docs/security.md: walrelay's record in a schema of its own.
	e.exec(fmt.Sprintf(`CREATE SCHEMA walrelay AUTHORIZATION %s`, pgx.Identifier{role}.Sanitize()))
	if !strings.Contains(roleURL, ":"+secret+"@") {
		t.Fatalf("role URL %q does not carry the password", roleURL)
	}
	noSecret := func(t *testing.T, out string) {
		t.Helper()
		if strings.Contains(out, secret) {
			t.Errorf("the PostgreSQL password appears in the output:\n%s", out)
		}
	}

	t.Run("streaming", func(t *testing.T) {
		args := withFlag(withFlag(e.args(), "--pg-url", roleURL), "--log-level", "debug")
		p := startProc(t, nil, args...)
		c := e.consume()
		e.waitSlotActive(p)
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('p', 'k', 'T', '{}')`)
		c.waitIDs(1, 60*time.Second)
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		if code, _, ok := p.wait(60 * time.Second); !ok || code != 0 {
			t.Errorf("SIGTERM: exit %d (exited %v), want 0", code, ok)
		}
		out := p.out.String()
		noSecret(t, out)
		if want := role + "@127.0.0.1:"; !strings.Contains(out, want) {
			t.Errorf("no connection target (%s) in the output:\n%s", want, out)
		}
	})

	port := closedPort(t)
	for _, v := range []struct{ name, url, redacted string }{
		{"user info", fmt.Sprintf("postgres://%s:%s@127.0.0.1:%d/%s?sslmode=disable", role, secret, port, e.name), ""},
		{"query parameter", fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable&password=%s", role, port, e.name, secret), ""},
		{"key=value", fmt.Sprintf("host=127.0.0.1 port=%d user=%s password=%s dbname=%s sslmode=disable", port, role, secret, e.name), ""},
	} {
		// Printed is the target rebuilt from the parsed URL, never the URL.
		v.redacted = fmt.Sprintf("%s@127.0.0.1:%d/%s", role, port, e.name)
		t.Run("unreachable, "+v.name, func(t *testing.T) {
			args := withFlag(withFlag(withFlag(e.args(), "--pg-url", v.url), "--log-level", "debug"), "--startup-timeout", "2s")
			out, code, elapsed, exited := runBounded(t, 45*time.Second, nil, args...)
			if !exited {
				t.Errorf("did not exit by itself within 45s with --startup-timeout 2s")
			}
			if code == 0 {
				t.Errorf("exit 0 against a closed port")
			}
			noSecret(t, out)
			if !strings.Contains(out, v.redacted) {
				t.Errorf("no connection target (%s) in the output:\n%s", v.redacted, out)
			}
			if !strings.Contains(out, "gave up") {
				t.Errorf("the output does not say it gave up:\n%s", out)
			}
			t.Logf("exit %d after %s", code, elapsed.Round(time.Millisecond))
		})
	}
}
