package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/slot"
)

// quietSeconds is how long the quiet-outbox tests load the database
// (WALRELAY_TEST_QUIET_SECONDS, default 35): more than two of the 15 s
// between PostgreSQL's running-transactions records, at which alone
// restart_lsn can advance, so the slot is seen to let WAL go more than
// once; the test runs on four servers in CI, where each second counts.
func quietSeconds() time.Duration {
	if s, err := strconv.Atoi(os.Getenv("WALRELAY_TEST_QUIET_SECONDS")); err == nil && s > 0 {
		return time.Duration(s) * time.Second
	}
	return 35 * time.Second
}

// noise writes to a table of its own in database url until ctx ends: the
// steady load of a busy database whose outbox is quiet.
func noise(ctx context.Context, t *testing.T, url string) *sync.WaitGroup {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS noise (id bigserial PRIMARY KEY, v text)`); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		defer conn.Close(context.Background())
		for ctx.Err() == nil {
			_, _ = conn.Exec(ctx, `INSERT INTO noise (v) SELECT repeat('x', 200) FROM generate_series(1, 100)`)
			_, _ = conn.Exec(ctx, `DELETE FROM noise WHERE id < (SELECT max(id) - 1000 FROM noise)`)
			time.Sleep(20 * time.Millisecond) // paces the load
		}
	})
	return &wg
}

// slotTrace samples a slot's confirmed_flush_lsn while ctx lasts and
// records the times it moved.
type slotTrace struct {
	mu      sync.Mutex
	moves   []time.Time
	last    decoder.LSN
	samples int

	stopOnce sync.Once
	cancel   context.CancelFunc
	done     chan struct{}
	stopped  func() // checks, once the sampler has returned
}

// traceSlot starts sampling the test's slot every 200ms until ctx ends or
// stop is called; the test's cleanup stops it too and waits for it. A
// trace that cannot connect, or never reads the slot, fails the test: its
// "no moves" would otherwise pass for a standing slot.
func (e *env) traceSlot(ctx context.Context) *slotTrace {
	t := e.t
	ctx, cancel := context.WithCancel(ctx)
	tr := &slotTrace{cancel: cancel, done: make(chan struct{})}
	t.Cleanup(tr.stop)
	go func() {
		defer close(tr.done)
		conn, err := pgx.Connect(ctx, e.url)
		if err != nil {
			if ctx.Err() == nil {
				t.Errorf("slot trace: connect: %v", err)
			}
			return
		}
		defer conn.Close(context.Background())
		tick := time.NewTicker(200 * time.Millisecond) // the sampling rate, not a wait for anything
		defer tick.Stop()
		first := true
		for {
			i, err := slot.ReadInfo(ctx, conn, e.name)
			switch {
			case ctx.Err() != nil:
				return
			case err != nil:
				t.Logf("slot trace: read slot: %v", err)
			default:
				tr.mu.Lock()
				tr.samples++
				if first {
					tr.last, first = i.ConfirmedLSN, false
				} else if i.ConfirmedLSN > tr.last {
					tr.moves = append(tr.moves, time.Now())
					tr.last = i.ConfirmedLSN
				}
				tr.mu.Unlock()
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	tr.stopped = func() {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		if tr.samples < 2 {
			t.Errorf("slot trace read the slot %d times: nothing it says about moves holds", tr.samples)
		}
	}
	return tr
}

// stop ends the sampling and waits for the sampler to return. Call it
// before reading the trace; it is safe to call more than once.
func (tr *slotTrace) stop() {
	tr.stopOnce.Do(func() {
		tr.cancel()
		<-tr.done
		tr.stopped()
	})
}

// maxGap is the longest time between moves (or from start/to end).
func (tr *slotTrace) maxGap(start, end time.Time) (time.Duration, int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	prev, gap := start, time.Duration(0)
	for _, m := range tr.moves {
		gap = max(gap, m.Sub(prev))
		prev = m
	}
	return max(gap, end.Sub(prev)), len(tr.moves)
}

// TestQuietOutboxBusyDatabase: another table of the same database takes a
// steady write load while the outbox gets nothing. With idle advance and
// heartbeats the slot's confirmed_flush_lsn moves at least once per status
// interval and, at the end, the slot retains under 10% of the WAL written.
// The control run, with both disabled, shows the retained WAL growing with
// everything written: the measurement can fail.
func TestQuietOutboxBusyDatabase(t *testing.T) {
	for _, tc := range []struct {
		name    string
		advance bool
	}{{"idle advance and heartbeats", true}, {"control: both disabled", false}} {
		t.Run(tc.name, func(t *testing.T) {
			if !tc.advance {
				// 14's pgoutput streams every transaction of the database,
				// the noise table's as an empty BEGIN and COMMIT, and the
				// relay confirms each: the slot moves without idle advance.
				// 15 skips empty transactions.
				needPG(t, 15)
			}
			t.Parallel()
			e := newEnv(t)
			cfg := e.config()
			cfg.StatusInterval = 2 * time.Second
			if tc.advance {
				cfg.HeartbeatInterval = 5 * time.Second
			} else {
				cfg.NoIdleAdvance = true
				cfg.HeartbeatInterval = 0
			}
			e.startRelay(cfg)
			conn := e.conn()
			startLSN := e.currentLSN(conn)
			startRestart := e.slotInfo().RestartLSN

			ctx, cancel := context.WithTimeout(e.ctx, quietSeconds())
			defer cancel()
			start := time.Now()
			trace := e.traceSlot(ctx)
			noise(ctx, t, e.url).Wait()
			trace.stop()
			end := time.Now()
			endLSN := e.currentLSN(conn)
			written := int64(endLSN - startLSN)
			atEnd := e.slotInfo()
			t.Logf("wrote %d bytes of WAL in %s; at the end the slot retained %d bytes (%.1f%%), confirmed lag %d",
				written, end.Sub(start).Round(time.Second), atEnd.RetainedWALBytes, pct(atEnd.RetainedWALBytes, written), atEnd.LagBytes)
			gap, moves := trace.maxGap(start, end)

			if !tc.advance {
				if moves > 0 {
					t.Errorf("confirmed_flush_lsn moved %d times with idle advance and heartbeats off", moves)
				}
				// restart_lsn may still settle once after the relay's first
				// status update (which may land after startRestart was
				// read), but never past the WAL written under the test.
				if atEnd.RestartLSN > max(startRestart, startLSN) || atEnd.RetainedWALBytes < written*9/10 {
					t.Errorf("control run: retained %d bytes of %d written; want the slot to hold it all", atEnd.RetainedWALBytes, written)
				}
				return
			}
			if gap > cfg.StatusInterval+time.Second {
				t.Errorf("confirmed_flush_lsn stood still for %s (%d moves in %s); want a move at least every status interval (%s)",
					gap.Round(time.Millisecond), moves, end.Sub(start).Round(time.Second), cfg.StatusInterval)
			}
			// restart_lsn advances only at the running-transactions records
			// PostgreSQL logs every 15 s, once the confirmed position passes
			// one: allow the next one to come.
			var retained int64
			e.waitFor("retained WAL under 10% of the WAL written", 30*time.Second, func() (bool, error) {
				retained = e.slotInfo().RetainedWALBytes
				return retained < written/10, fmt.Errorf("retained %d of %d bytes written", retained, written)
			})
			t.Logf("retained after the load: %d bytes (%.1f%% of written); confirmed moved %d times, longest pause %s",
				retained, pct(retained, written), moves, gap.Round(time.Millisecond))
		})
	}
}

func pct(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return 100 * float64(a) / float64(b)
}

// TestIdleDatabaseBusyOtherDatabase: the relay's database is idle while
// another database of the same cluster writes. Keepalive positions are
// not used (idle advance off), so only the heartbeat's WAL nudge can move
// the slot; without heartbeats it stands still.
func TestIdleDatabaseBusyOtherDatabase(t *testing.T) {
	for _, tc := range []struct {
		name      string
		heartbeat time.Duration
	}{{"heartbeat nudges", time.Second}, {"control: no heartbeat", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			otherURL, err := devcluster.CreateDatabase(e.ctx, pgAdminURL, e.name+"_other")
			if err != nil {
				t.Fatal(err)
			}
			cfg := e.config()
			cfg.NoIdleAdvance = true
			cfg.HeartbeatInterval = tc.heartbeat
			// Polls every half second: a relay that wrote its record
			// (walrelay.slots) at each move of the slot would, on
			// PostgreSQL 14 whose pgoutput streams that write as an empty
			// transaction the relay confirms, move the slot at each poll.
			cfg.SlotPollInterval = 500 * time.Millisecond
			e.startRelay(cfg)
			before := e.slotInfo().ConfirmedLSN

			ctx, cancel := context.WithTimeout(e.ctx, 15*time.Second)
			defer cancel()
			start := time.Now()
			trace := e.traceSlot(ctx)
			noise(ctx, t, otherURL).Wait()
			trace.stop()
			_, moves := trace.maxGap(start, time.Now())
			after := e.slotInfo().ConfirmedLSN
			t.Logf("confirmed_flush_lsn %s → %s, %d moves", before, after, moves)
			if tc.heartbeat > 0 && moves < 5 {
				t.Errorf("slot moved %d times in 15s with a 1s heartbeat; want the nudges to move it", moves)
			}
			// The relay's own writes at start may still come under the
			// test, and on 14 each moves the slot: setup's record write,
			// then, when its confirmation came before the first poll, that
			// poll's record of the confirmed position (whose own
			// confirmation the poller knows not to record again). A relay
			// feeding on its own writes would move it at each poll, ~30
			// times here.
			ownWrites := 0
			if pgVersion < 150000 {
				ownWrites = 2
			}
			if tc.heartbeat == 0 && moves > ownWrites {
				t.Errorf("slot moved %d times (%s to %s) with no heartbeat and no idle advance; want at most %d (the relay's own writes at start)", moves, before, after, ownWrites)
			}
		})
	}
}

// TestKeepalivesWhileInFlightThenKill: the broker refuses produce requests
// while a busy table makes the walsender send keepalives; the confirmed
// position never passes the last acknowledged transaction. The relay is
// then killed with SIGKILL and restarted: nothing is lost.
func TestKeepalivesWhileInFlightThenKill(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	cmd := e.runBinary(e.args()...)
	c := e.consume()
	e.waitFor("slot active", 30*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	conn := e.conn()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', '{"n": 0}', 0)`)
	c.waitIDs(1, 30*time.Second)

	fault := e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	defer fault.Remove()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', '{"n": 1}', 1)`)
	firstUnacked := e.currentLSN(conn)
	for i := 2; i <= 20; i++ {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', jsonb_build_object('n', $1::int), $1)`, i)
	}
	ctx, cancel := context.WithTimeout(e.ctx, 6*time.Second)
	trace := e.traceSlot(ctx)
	noise(ctx, t, e.url).Wait()
	cancel()
	trace.stop()
	trace.mu.Lock()
	last := trace.last
	trace.mu.Unlock()
	if info := e.slotInfo(); info.ConfirmedLSN >= firstUnacked || last >= firstUnacked {
		t.Fatalf("confirmed %s (max seen %s) passed the first unacknowledged transaction (ends before %s)", info.ConfirmedLSN, last, firstUnacked)
	}

	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	hits := fault.Hits()
	e.runBinary(e.args()...)
	// The restarted relay resends the unacknowledged rows into the same
	// refusal before the broker recovers.
	e.waitFor("the restarted relay's produce requests refused", 60*time.Second, func() (bool, error) {
		return fault.Hits() > hits, fmt.Errorf("%d refusals, %d before the restart", fault.Hits(), hits)
	})
	fault.Remove()
	recs := c.waitIDs(21, 60*time.Second)
	checkPerKeyOrder(t, recs)
}

// TestStatusCommand checks walrelay status's text and JSON output and its
// exit codes: 0 healthy, 1 over --max-lag-bytes, 2 when the slot cannot be
// read.
func TestStatusCommand(t *testing.T) {
	e := newEnv(t)
	rr := e.startRelay(e.config())
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', '{}')`)
	conn := e.conn()
	target := e.currentLSN(conn)
	e.waitFor("confirmed", 30*time.Second, func() (bool, error) { return e.slotInfo().ConfirmedLSN >= target, nil })

	out, code := runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
	if code != 0 {
		t.Fatalf("status exit %d, want 0:\n%s", code, out)
	}
	for _, want := range []string{"slot ", e.name, "plugin", "pgoutput", "active", "yes (pid", "restart_lsn", "confirmed_flush_lsn", "current_lsn", "retained_wal", "confirmed_lag", "wal_status", "reserved", "safe_wal_size", "health", "ok"} {
		if !strings.Contains(out, want) {
			t.Errorf("status output lacks %q:\n%s", want, out)
		}
	}

	out, code = runOutput(t, "status", "--pg-url", e.url, "--slot", e.name, "--json")
	if code != 0 {
		t.Fatalf("status --json exit %d:\n%s", code, out)
	}
	var st struct {
		Slot              string `json:"slot"`
		Plugin            string `json:"plugin"`
		WALStatus         string `json:"wal_status"`
		ConfirmedFlushLSN string `json:"confirmed_flush_lsn"`
		CurrentLSN        string `json:"current_lsn"`
		RestartLSN        string `json:"restart_lsn"`
		Active            bool   `json:"active"`
		ActivePID         *int32 `json:"active_pid"`
		RetainedWALBytes  int64  `json:"retained_wal_bytes"`
		ConfirmedLagBytes int64  `json:"confirmed_lag_bytes"`
		Healthy           bool   `json:"healthy"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	confirmed, _ := slot.ParseLSN(st.ConfirmedFlushLSN)
	current, _ := slot.ParseLSN(st.CurrentLSN)
	restart, _ := slot.ParseLSN(st.RestartLSN)
	if st.Slot != e.name || st.Plugin != "pgoutput" || st.WALStatus != "reserved" || !st.Active || st.ActivePID == nil || !st.Healthy ||
		confirmed < target || st.RetainedWALBytes != int64(current-restart) || st.ConfirmedLagBytes != int64(current-confirmed) {
		t.Errorf("status --json = %+v (confirmed %s, target %s)", st, confirmed, target)
	}

	// WAL no relay can confirm: with the relay stopped, the lag is certain.
	if err := rr.stop(t); err != nil {
		t.Fatalf("relay stopped with %v", err)
	}
	// Transactional: its commit flushes the WAL, so pg_current_wal_lsn (the
	// position written, which status reads) is past it before status runs;
	// a non-transactional message sits in the WAL buffers until the WAL
	// writer's next round.
	e.exec(`SELECT pg_logical_emit_message(true, 'test', repeat('x', 10000))`)
	out, code = runOutput(t, "status", "--pg-url", e.url, "--slot", e.name, "--max-lag-bytes", "1")
	if code != 1 || !strings.Contains(out, "exceeds --max-lag-bytes") {
		t.Errorf("status with lag over --max-lag-bytes 1: exit %d, want 1:\n%s", code, out)
	}
	if _, code = runOutput(t, "status", "--pg-url", e.url, "--slot", "no_such_slot"); code != 2 {
		t.Errorf("status of a missing slot: exit %d, want 2", code)
	}
}

// TestSetupAndDrop: setup prints the DDL, creates the table, publication and
// slot; drop refuses an active slot, drops an idle one and the publication.
func TestSetupAndDrop(t *testing.T) {
	e := newEnv(t)
	e.exec(`DROP TABLE outbox`)
	out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--table", "app.events", "--create-table")
	if code != 0 {
		t.Fatalf("setup exit %d:\n%s", code, out)
	}
	if !strings.Contains(out, `CREATE TABLE "app"."events"`) || !strings.Contains(out, "ready:") {
		t.Errorf("setup output:\n%s", out)
	}
	conn := e.conn()
	var pubTables []string
	rows, _ := conn.Query(e.ctx, `SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1`, e.name)
	pubTables, _ = pgx.CollectRows(rows, pgx.RowTo[string])
	if fmt.Sprint(pubTables) != "[app.events]" {
		t.Errorf("publication tables %v, want [app.events]", pubTables)
	}
	info := e.slotInfo()
	if info.Plugin != "pgoutput" {
		t.Errorf("slot plugin %q", info.Plugin)
	}
	// Running setup again is harmless.
	if out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--table", "app.events"); code != 0 {
		t.Fatalf("second setup exit %d:\n%s", code, out)
	}

	// An active slot is not dropped.
	holder, err := slot.Start(e.ctx, e.url, 0, slot.StreamOptions{Slot: e.name, Publication: e.name})
	if err != nil {
		t.Fatal(err)
	}
	out, code = runOutput(t, "drop", "--pg-url", e.url, "--slot", e.name)
	if code == 0 || !strings.Contains(out, "in use") {
		t.Errorf("drop of an active slot: exit %d:\n%s", code, out)
	}
	holder.Close(context.Background())
	e.waitFor("slot released", 10*time.Second, func() (bool, error) { return !e.slotInfo().Active, nil })
	out, code = runOutput(t, "drop", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--drop-publication")
	if code != 0 {
		t.Fatalf("drop exit %d:\n%s", code, out)
	}
	if _, err := e.slotInfoErr(); err == nil {
		t.Error("slot still exists after drop")
	}
	var n int
	if err := conn.QueryRow(e.ctx, `SELECT count(*) FROM pg_publication WHERE pubname = $1`, e.name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Error("publication still exists after drop --drop-publication")
	}
}

// TestMetricsHealthAndHeartbeatTopic scrapes a running binary: every public
// metric name is exported, counters move with events, /healthz and /readyz
// answer, and heartbeat records reach the heartbeat topic.
func TestMetricsHealthAndHeartbeatTopic(t *testing.T) {
	e := newEnv(t)
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	args := append(e.args(), "--metrics-addr", addr, "--heartbeat-interval", "500ms",
		"--heartbeat-topic", e.topicPrefix()+"heartbeat", "--slot-poll-interval", "500ms")
	cmd := e.runBinary(args...)
	c := e.consume()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	e.waitFor("/readyz 200", 30*time.Second, func() (bool, error) {
		code, body := get("/readyz")
		return code == 200, fmt.Errorf("%d %s", code, body)
	})
	if code, _ := get("/healthz"); code != 200 {
		t.Errorf("/healthz %d", code)
	}
	for i := range 3 {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('m', 'k', 'T', '{}')`)
		_ = i
	}
	c.waitIDs(3, 30*time.Second)
	var body string
	e.waitFor("metrics reflect the events and the slot", 30*time.Second, func() (bool, error) {
		_, body = get("/metrics")
		return strings.Contains(body, `walrelay_events_published_total{topic="`+e.topic("m")+`"} 3`) &&
			strings.Contains(body, `walrelay_heartbeats_total{kind="kafka"}`) &&
			strings.Contains(body, `walrelay_slot_wal_status{status="reserved"} 1`), nil
	})
	for _, name := range []string{
		"walrelay_events_published_total", "walrelay_events_dead_lettered_total", "walrelay_transactions_total",
		"walrelay_produce_errors_total", "walrelay_received_lsn", "walrelay_confirmed_lsn", "walrelay_server_wal_end_lsn",
		"walrelay_slot_retained_wal_bytes", "walrelay_slot_lag_bytes", "walrelay_replication_lag_seconds",
		"walrelay_commit_to_ack_seconds_bucket", "walrelay_inflight_events", "walrelay_heartbeats_total",
		"walrelay_ready 1", "walrelay_streaming 1", "go_goroutines", "process_resident_memory_bytes",
	} {
		if !strings.Contains(body, "\n"+name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	if v := metricValue(body, "walrelay_confirmed_lsn"); v <= 0 {
		t.Errorf("walrelay_confirmed_lsn = %v", v)
	}
	// Heartbeat records: key = slot, value = JSON status.
	e.waitFor("heartbeat records", 30*time.Second, func() (bool, error) {
		for _, r := range c.records() {
			if r.Topic == e.topicPrefix()+"heartbeat" {
				var hb struct {
					Slot         string `json:"slot"`
					Streaming    bool   `json:"streaming"`
					ConfirmedLSN string `json:"confirmed_lsn"`
				}
				if err := json.Unmarshal(r.Value, &hb); err != nil {
					return false, err
				}
				return string(r.Key) == e.name && hb.Slot == e.name && hb.ConfirmedLSN != "", fmt.Errorf("%s %s", r.Key, r.Value)
			}
		}
		return false, nil
	})
	_ = cmd.Process.Signal(syscall.SIGTERM)
	waitExit(t, cmd, 0)
}

func metricValue(body, name string) float64 {
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, name+" ") {
			v, _ := strconv.ParseFloat(strings.TrimPrefix(line, name+" "), 64)
			return v
		}
	}
	return -1
}

// runOutput runs the binary to completion and returns its combined output
// and exit code.
func runOutput(t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(binPath, args...)
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok {
		return string(out), ee.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(out), 0
}
