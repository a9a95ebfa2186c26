package integration

import (
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/relay"
)

// TestBrokerDownTenSeconds stops the broker (a kfake cluster persisting to
// a data directory on a fixed port) for ten seconds in the middle of a run
// of 8 writers, while they keep writing, and starts it again on the same
// port with the same data: the in-process relay rides it out without its
// Run returning, every event arrives with per-key order intact, the slot's
// confirmed_flush_lsn stands still during the outage and stays below a
// transaction committed after the broker went down, and it moves past the
// end of the writes afterwards.
func TestBrokerDownTenSeconds(t *testing.T) {
	e := newEnv(t)
	e.needKfake()
	b := startKafkaAt(t)
	e.brokers = []string{b.addr()} // the relay's config and the consumer use this broker
	rr, reg := e.startRelayGathered(e.config())
	c := e.consume()
	conn := e.conn()

	const writers, perWriter = 8, 500
	wr := e.startWriters(writers, 0, perWriter, 100*time.Millisecond)
	c.waitIDs(writers*perWriter/4, 2*time.Minute)

	b.stop()
	stopped := time.Now()
	rowsAtStop := countRows(t, e, conn)
	readAtStop := len(distinctIDs(c.records()))
	// A transaction committed once the broker is gone cannot have been
	// acknowledged: the slot must never be confirmed up to its end.
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'probe', 'T', '{"seq": 0}', 0)`)
	probeBound := e.currentLSN(conn) // at or after the probe's end LSN
	// Acks that were on the wire when the broker stopped are confirmed by
	// the status updates that follow: wait for two sent after the probe,
	// the second carrying everything the first's acks left pending.
	after := e.serverNow()
	for i := range 2 {
		e.waitFor(fmt.Sprintf("status update %d after the broker stopped", i+1), 30*time.Second, func() (bool, error) {
			at, _, ok := e.replyTime()
			if ok && at.After(after) {
				after = at
				return true, nil
			}
			return false, fmt.Errorf("last status update at %s (walsender serving: %v)", at.Format(time.RFC3339Nano), ok)
		})
	}
	c0 := e.slotInfo().ConfirmedLSN
	if c0 >= probeBound {
		t.Errorf("confirmed_flush_lsn %s reached the probe transaction (ends at or before %s) committed after the broker stopped", c0, probeBound)
	}
	samples := 0
	for time.Since(stopped) < 10*time.Second {
		ci := e.slotInfo().ConfirmedLSN
		samples++
		if ci != c0 {
			t.Errorf("confirmed_flush_lsn moved from %s to %s %s into the outage, with nothing acknowledged", c0, ci, time.Since(stopped).Round(time.Millisecond))
		}
		if ok, err := rr.returned(); ok {
			t.Fatalf("relay Run returned during the broker outage: %v", err)
		}
		time.Sleep(250 * time.Millisecond) // the sampling rate over the timed outage
	}
	rowsAtEnd := countRows(t, e, conn)
	readDuring := len(distinctIDs(c.records())) - readAtStop
	cEnd := e.slotInfo().ConfirmedLSN
	if cEnd != c0 || cEnd >= probeBound {
		t.Errorf("at the end of the outage confirmed_flush_lsn is %s; want %s as 2s after the stop, below %s", cEnd, c0, probeBound)
	}
	if rowsAtEnd <= rowsAtStop+writers {
		t.Fatalf("writers committed %d rows during the outage: the test did not exercise writes against a dead broker", rowsAtEnd-rowsAtStop)
	}
	b.start()
	restarted := time.Now()

	wr.wait(t)
	end := e.currentLSN(conn)
	recs := c.waitIDs(writers*perWriter+1, 2*time.Minute)
	caughtUp := time.Since(restarted)
	dups := checkPerKeyOrder(t, recs)
	e.waitFor("slot confirmed past the end of the writes", 60*time.Second, func() (bool, error) {
		got := e.slotInfo().ConfirmedLSN
		return got >= end, fmt.Errorf("confirmed %s, want >= %s", got, end)
	})
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay Run returned: %v", err)
	}
	if !rr.relay.Streaming() {
		t.Error("relay not streaming after the broker came back")
	}
	t.Logf("outage 10s: %d rows committed meanwhile, %d ids read meanwhile, confirmed held at %s over %d samples; "+
		"all %d events read %s after the restart (%d records, %d duplicates); stream restarts %v, produce errors %v",
		rowsAtEnd-rowsAtStop, readDuring, c0, samples, writers*perWriter+1, caughtUp.Round(time.Millisecond), len(recs), dups,
		gathered(reg, "walrelay_stream_restarts_total"), gathered(reg, "walrelay_produce_errors_total"))
}

// TestPostgresRestart restarts PostgreSQL (pg_ctl restart -m fast, every
// connection cut) in the middle of a run of 8 writers that reconnect and
// retry: the in-process relay reconnects by itself (its Run never returns,
// a new walsender serves the slot), every committed row (exactly the rows
// in the table at the end: the writers never delete) is published, no
// other id is, and per key the first arrivals follow commit order.
func TestPostgresRestart(t *testing.T) {
	if pgCluster == nil {
		t.Skip("restarts a PostgreSQL cluster of its own; skipped with WALRELAY_TEST_PG_URL")
	}
	pg, err := devcluster.StartPostgres(context.Background(), devcluster.PostgresOptions{Settings: map[string]string{
		"wal_sender_timeout": "'10s'",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })
	e := newEnvOn(t, pg.URL("postgres"))
	rr, reg := e.startRelayGathered(e.config())
	c := e.consume()
	pidBefore := e.slotInfo().ActivePID

	const writers = 8
	stop := make(chan struct{})
	var committed atomic.Int64
	stats := make([]retryStats, writers)
	errs := make([]error, writers)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() { stats[w], errs[w] = writeRetrying(e, w, 20*time.Millisecond, stop, &committed) })
	}
	c.waitIDs(500, 2*time.Minute)
	began := time.Now()
	if err := pg.Restart(e.ctx); err != nil {
		close(stop)
		wg.Wait()
		t.Fatal(err)
	}
	restartTook := time.Since(began)
	atRestart := committed.Load()
	err = devcluster.WaitFor(90*time.Second, 100*time.Millisecond, func() (bool, error) {
		n := committed.Load() - atRestart
		return n >= writers*25, fmt.Errorf("%d transactions committed since the restart", n)
	})
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("writers did not resume after the restart: %v", err)
	}
	var rows, retries, ambiguous int
	for w := range writers {
		if errs[w] != nil {
			t.Fatalf("writer %d: %v", w, errs[w])
		}
		rows += stats[w].rows
		retries += stats[w].retries
		ambiguous += stats[w].ambiguous
	}

	conn := e.conn()
	want, n := committedRows(t, e, conn)
	if n != rows {
		t.Errorf("the table holds %d rows, the writers counted %d committed", n, rows)
	}
	end := e.currentLSN(conn)
	recs := waitAllIDs(c, want, 2*time.Minute)
	dups := checkDelivered(t, recs, want, nil)
	checkPerKeyOrder(t, recs)

	if ok, err := rr.returned(); ok {
		t.Fatalf("relay Run returned: %v", err)
	}
	e.waitFor("slot confirmed past the end of the writes", 60*time.Second, func() (bool, error) {
		got := e.slotInfo().ConfirmedLSN
		return got >= end, fmt.Errorf("confirmed %s, want >= %s", got, end)
	})
	info := e.slotInfo()
	if !info.Active || info.ActivePID == nil || (pidBefore != nil && *info.ActivePID == *pidBefore) {
		t.Errorf("slot active %v pid %v after the restart (before: %v): want a new walsender", info.Active, deref(info.ActivePID), deref(pidBefore))
	}
	restarts := gathered(reg, "walrelay_stream_restarts_total")
	if sumValues(restarts) < 1 {
		t.Errorf("no stream restart counted after a PostgreSQL restart: %v", restarts)
	}
	t.Logf("restart took %s; %d rows committed (%d transaction retries, %d commits found applied on retry); %d records read, %d duplicates; stream restarts %v",
		restartTook.Round(time.Millisecond), n, retries, ambiguous, len(recs), dups, restarts)
}

// TestReplicationConnectionCut puts a TCP proxy between the relay and
// PostgreSQL and resets every connection through it twice in the middle of
// a run of 8 writers (which connect directly): each time a new walsender
// takes over the slot without the relay's Run returning, and in the end
// every event is delivered with per-key order intact.
func TestReplicationConnectionCut(t *testing.T) {
	e := newEnv(t)
	cfg, p := e.configThroughProxy()
	rr, reg := e.startRelayGathered(cfg)
	c := e.consume()

	const writers, perWriter = 8, 500
	errs := make(chan error, writers)
	var wg sync.WaitGroup
	var done atomic.Int32
	for w := range writers {
		wg.Go(func() {
			errs <- writePaced(e, w, perWriter, 50*time.Millisecond)
			done.Add(1)
		})
	}
	var cutConns []int
	for _, frac := range []int{4, 2} { // after a quarter, then half of the events
		c.waitIDs(writers*perWriter/frac, 2*time.Minute)
		pid := e.slotInfo().ActivePID
		if pid == nil {
			t.Fatal("slot not active before the cut")
		}
		cutConns = append(cutConns, p.cut())
		if done.Load() == writers {
			t.Log("warning: the writers had finished before the cut")
		}
		e.waitFor("a new walsender streaming the slot", 60*time.Second, func() (bool, error) {
			i, err := e.slotInfoErr()
			if err != nil {
				return false, err
			}
			return i.Active && i.ActivePID != nil && *i.ActivePID != *pid && rr.relay.Streaming(),
				fmt.Errorf("active %v pid %v (was %d), relay streaming %v", i.Active, deref(i.ActivePID), *pid, rr.relay.Streaming())
		})
		if ok, err := rr.returned(); ok {
			t.Fatalf("relay Run returned after a connection cut: %v", err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	recs := c.waitIDs(writers*perWriter, 2*time.Minute)
	dups := checkPerKeyOrder(t, recs)
	restarts := gathered(reg, "walrelay_stream_restarts_total")
	if sumValues(restarts) < 2 {
		t.Errorf("%v stream restarts counted after two cuts of the replication connection", restarts)
	}
	t.Logf("cut %v connections; %d records read for %d events (%d duplicates); stream restarts %v",
		cutConns, len(recs), writers*perWriter, dups, restarts)
}

// TestReplicationConnectionSilentlyLost freezes every connection between
// the relay and PostgreSQL (nothing is forwarded any more, nothing is
// closed: a network partition, a failover that moved the address, a
// firewall dropping the connection's state). The walsender gives up on its
// side after wal_sender_timeout (10s in the test cluster) and frees the
// slot; the relay must notice the silent connection and reconnect by
// itself: events written after the freeze arrive within 60s.
func TestReplicationConnectionSilentlyLost(t *testing.T) {
	e := newEnv(t)
	cfg, p := e.configThroughProxy()
	rr, reg := e.startRelayGathered(cfg)
	c := e.consume()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'k', 'T', '{"seq": 0}', 0)`)
	c.waitIDs(1, 30*time.Second)
	pid := e.slotInfo().ActivePID

	frozen := p.freeze()
	at := time.Now()
	for i := 1; i <= 20; i++ {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('w', 'k', 'T', jsonb_build_object('seq', $1::int), $1)`, i)
	}
	var released time.Duration
	readyWhileStuck := 0
	err := devcluster.WaitFor(60*time.Second, 250*time.Millisecond, func() (bool, error) {
		info, err := e.slotInfoErr()
		if err == nil && released == 0 && (!info.Active || (info.ActivePID != nil && pid != nil && *info.ActivePID != *pid)) {
			released = time.Since(at)
		}
		n := len(distinctIDs(c.records()))
		if n < 21 && rr.relay.Ready() == nil {
			readyWhileStuck++
		}
		return n >= 21, fmt.Errorf("%d of 21 events read; relay streaming %v, ready %v; slot active %v pid %v",
			n, rr.relay.Streaming(), rr.relay.Ready() == nil, info.Active, deref(info.ActivePID))
	})
	if err != nil {
		t.Fatalf("froze %d connections %s ago: the walsender let go of the slot after %s, yet the relay did not reconnect "+
			"(it reported ready in %d of its polls; stream restarts %v): %v",
			frozen, time.Since(at).Round(time.Second), released.Round(time.Millisecond), readyWhileStuck,
			gathered(reg, "walrelay_stream_restarts_total"), err)
	}
	checkPerKeyOrder(t, c.records())
	t.Logf("froze %d connections; the slot was released after %s; all events read %s after the freeze; stream restarts %v",
		frozen, released.Round(time.Millisecond), time.Since(at).Round(time.Millisecond), gathered(reg, "walrelay_stream_restarts_total"))
}

// TestTwoRelaysOneSlot starts two relay binaries on the same slot at once:
// exactly one streams (/readyz 200, the other 503, and it stays so) while
// the other waits as a standby. SIGKILL of the active one mid-run hands
// the slot to the survivor (a new walsender, /readyz 200) within 15s with
// --backoff-max 2s, and every event arrives, per key in commit order.
func TestTwoRelaysOneSlot(t *testing.T) {
	e := newEnv(t)
	var addrs [2]string
	var cmds [2]*exec.Cmd
	for i := range cmds {
		port, err := devcluster.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		addrs[i] = fmt.Sprintf("127.0.0.1:%d", port)
	}
	for i := range cmds {
		cmds[i] = e.runBinary(append(e.args(), "--metrics-addr", addrs[i], "--backoff-max", "2s")...)
	}
	c := e.consume()

	active := -1
	roles := func() (int, error) { return activeOf(addrs) }
	e.waitFor("one relay ready, the other a standby", 60*time.Second, func() (bool, error) {
		i, err := roles()
		active = i
		return i >= 0, err
	})
	info := e.slotInfo()
	if !info.Active || info.ActivePID == nil {
		t.Fatalf("slot not active with a ready relay: %+v", info)
	}
	activePID := *info.ActivePID
	var backend string
	if err := e.conn().QueryRow(e.ctx, `SELECT backend_type FROM pg_stat_activity WHERE pid = $1`, activePID).Scan(&backend); err != nil || backend != "walsender" {
		t.Fatalf("the slot's active_pid %d is a %q backend (%v), want a walsender", activePID, backend, err)
	}
	for range 20 { // the roles must hold over a 2s window: an observation, not a wait
		time.Sleep(100 * time.Millisecond)
		if i, err := roles(); i != active {
			t.Fatalf("roles changed: active was relay %d, now %d (%v)", active, i, err)
		}
		if i := e.slotInfo(); i.ActivePID == nil || *i.ActivePID != activePID {
			t.Fatalf("slot's active_pid changed from %d to %v while both relays ran", activePID, deref(i.ActivePID))
		}
	}

	const writers, perWriter = 8, 500
	wr := e.startWriters(writers, 0, perWriter, 40*time.Millisecond)
	c.waitIDs(writers*perWriter/4, 2*time.Minute)
	survivor := 1 - active
	_ = cmds[active].Process.Kill()
	_ = cmds[active].Wait()
	killed := time.Now()
	e.waitFor("the survivor ready", 15*time.Second, func() (bool, error) {
		code := readyz(addrs[survivor])
		return code == 200, fmt.Errorf("survivor /readyz %d", code)
	})
	takeover := time.Since(killed)
	if i := e.slotInfo(); !i.Active || i.ActivePID == nil || *i.ActivePID == activePID {
		t.Errorf("after the takeover the slot is active %v with pid %v; the killed relay's walsender was %d", i.Active, deref(i.ActivePID), activePID)
	}
	if code := readyz(addrs[active]); code != 0 {
		t.Errorf("the killed relay still answers /readyz: %d", code)
	}
	wr.wait(t)
	recs := c.waitIDs(writers*perWriter, 2*time.Minute)
	dups := checkPerKeyOrder(t, recs)
	if cmds[survivor].ProcessState != nil {
		t.Errorf("the survivor exited: %v", cmds[survivor].ProcessState)
	}
	t.Logf("relay %d was active; the survivor was ready %s after SIGKILL; %d records read for %d events (%d duplicates)",
		active, takeover.Round(time.Millisecond), len(recs), writers*perWriter, dups)
}

// TestSoakKillsAndBrokerRestarts runs 8 writers (transactions of 1 to 5
// rows, about half of them deleted in the same transaction, one
// transaction in twenty rolled back) for WALRELAY_TEST_SOAK_SECONDS
// (default 120) while the relay binary is killed with SIGKILL every 3 to
// 10 seconds and restarted, and the broker (kfake with a data directory on
// a fixed port) is stopped for 2 to 5 seconds a few times, with at least
// one of the kills inside every outage (records in flight, unacknowledged,
// when the relay dies). In the end every
// committed event was delivered, no rolled-back one was, per key the first
// arrivals follow commit order, duplicates are identical copies, and the
// slot is confirmed past the end of the writes.
func TestSoakKillsAndBrokerRestarts(t *testing.T) {
	if testing.Short() {
		t.Skip("soak test")
	}
	e := newEnv(t)
	e.needKfake()
	duration := 120 * time.Second
	if s, err := strconv.Atoi(os.Getenv("WALRELAY_TEST_SOAK_SECONDS")); err == nil && s > 0 {
		duration = time.Duration(s) * time.Second
	}
	b := startKafkaAt(t)
	e.brokers = []string{b.addr()}
	args := e.args()
	cmd := e.runBinary(args...)
	c := e.consume()
	e.waitFor("slot active", 60*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})

	const writers = 8
	stop := make(chan struct{})
	ws := make([]*soakWriter, writers)
	var wg sync.WaitGroup
	for w := range writers {
		ws[w] = &soakWriter{}
		wg.Go(func() { ws[w].run(e, w, stop) })
	}

	start := time.Now()
	deadline := start.Add(duration)
	rng := rand.New(rand.NewPCG(uint64(start.UnixNano()), 3))
	nextKill := start.Add(time.Duration(3000+rng.IntN(7000)) * time.Millisecond)
	bounces := max(1, int(duration/(30*time.Second)))
	var bounceAt []time.Time
	for i := range bounces {
		bounceAt = append(bounceAt, start.Add(duration*time.Duration(2*i+1)/time.Duration(2*bounces)))
	}
	var brokerUpAt time.Time // zero while the broker is up
	kills, brokerRestarts := 0, 0
	for {
		next := deadline
		if nextKill.Before(next) {
			next = nextKill
		}
		if !brokerUpAt.IsZero() && brokerUpAt.Before(next) {
			next = brokerUpAt
		}
		if brokerUpAt.IsZero() && len(bounceAt) > 0 && bounceAt[0].Before(next) {
			next = bounceAt[0]
		}
		time.Sleep(time.Until(next)) // the schedule's next fault: chaos, not a wait
		now := time.Now()
		if !now.Before(deadline) {
			break
		}
		switch {
		case !now.Before(nextKill):
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			kills++
			cmd = e.runBinary(args...)
			nextKill = time.Now().Add(time.Duration(3000+rng.IntN(7000)) * time.Millisecond)
		case !brokerUpAt.IsZero() && !now.Before(brokerUpAt):
			b.start()
			brokerRestarts++
			brokerUpAt = time.Time{}
		case brokerUpAt.IsZero() && len(bounceAt) > 0 && !now.Before(bounceAt[0]):
			b.stop()
			bounceAt = bounceAt[1:]
			down := time.Duration(2000+rng.IntN(3000)) * time.Millisecond
			brokerUpAt = time.Now().Add(down)
			// Make sure one kill falls in the outage, while records wait
			// for acks that cannot come.
			if during := time.Now().Add(down / 4).Add(time.Duration(rng.Int64N(int64(down / 2)))); during.Before(nextKill) {
				nextKill = during
			}
		}
	}
	close(stop)
	wg.Wait()
	if !brokerUpAt.IsZero() {
		b.start()
		brokerRestarts++
	}
	writing := time.Since(start)

	want := map[string][]string{}
	forbidden := map[string]bool{}
	events, deleted, rolledBack, txns := 0, 0, 0, 0
	for w, sw := range ws {
		if sw.err != nil {
			t.Fatalf("writer %d: %v", w, sw.err)
		}
		for _, r := range sw.rows {
			want[r.key] = append(want[r.key], r.id)
		}
		for _, id := range sw.rolled {
			forbidden[id] = true
		}
		events += len(sw.rows)
		deleted += sw.deleted
		rolledBack += sw.rolledTxns
		txns += sw.txns
	}
	conn := e.conn()
	end := e.currentLSN(conn)
	recs := waitAllIDs(c, want, 3*time.Minute)
	dups := checkDelivered(t, recs, want, forbidden)
	checkPerKeyOrder(t, recs)
	e.waitFor("slot confirmed past the end of the writes", 60*time.Second, func() (bool, error) {
		got := e.slotInfo().ConfirmedLSN
		return got >= end, fmt.Errorf("confirmed %s, want >= %s", got, end)
	})
	if cmd.ProcessState != nil {
		t.Errorf("the last relay exited: %v", cmd.ProcessState)
	}
	t.Logf("soak: %d events in %d transactions (%d rows deleted in their transaction, %d transactions rolled back), "+
		"%d kills, %d broker restarts, %d records read, %d duplicates, writes %s, elapsed %s",
		events, txns, deleted, rolledBack, kills, brokerRestarts, len(recs), dups,
		writing.Round(time.Second), time.Since(start).Round(time.Second))
}

// ---- helpers ----

func sumValues(m map[string]float64) float64 {
	var s float64
	for _, v := range m {
		s += v
	}
	return s
}

// kafkaAt is a kfake broker on a fixed port persisting to a data
// directory, which can be stopped and started again with the same data.
type kafkaAt struct {
	t    *testing.T
	port int
	dir  string
	mu   sync.Mutex
	k    *devcluster.Kafka
}

func startKafkaAt(t *testing.T) *kafkaAt {
	t.Helper()
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	b := &kafkaAt{t: t, port: port, dir: t.TempDir()}
	b.start()
	t.Cleanup(b.stop)
	return b
}

func (b *kafkaAt) addr() string { return fmt.Sprintf("127.0.0.1:%d", b.port) }

// start starts the broker (again), retrying while the port is not free.
func (b *kafkaAt) start() {
	b.t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.k != nil {
		return
	}
	err := devcluster.WaitFor(30*time.Second, 100*time.Millisecond, func() (bool, error) {
		k, err := devcluster.StartKafka(devcluster.KafkaOptions{Port: b.port, DataDir: b.dir})
		b.k = k
		return err == nil, err
	})
	if err != nil {
		b.t.Fatalf("restart kfake on port %d: %v", b.port, err)
	}
}

// stop closes the broker; its log is saved to the data directory.
func (b *kafkaAt) stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.k != nil {
		b.k.Close()
		b.k = nil
	}
}

// tcpProxy forwards connections to target and can reset or freeze all of
// them.
type tcpProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  map[*proxied]struct{}
	wg     sync.WaitGroup
	// refusing resets new connections at once; hanging forwards nothing
	// on them (see refuse and hang).
	refusing, hanging atomic.Bool
}

// configThroughProxy is e.config() with PostgreSQL reached through a TCP
// proxy the test controls (the writers and the harness connect directly).
func (e *env) configThroughProxy() (relay.Config, *tcpProxy) {
	e.t.Helper()
	u, err := url.Parse(e.url)
	if err != nil || u.Host == "" {
		e.t.Skipf("needs a URL-form PostgreSQL URL to insert a proxy: %q", e.url)
	}
	target := u.Host
	if u.Port() == "" {
		target = net.JoinHostPort(u.Hostname(), "5432")
	}
	p := startProxy(e.t, target)
	u.Host = p.addr()
	cfg := e.config()
	cfg.PGURL = u.String()
	return cfg, p
}

func startProxy(t *testing.T, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{ln: ln, target: target, conns: map[*proxied]struct{}{}}
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Go(func() { p.serve(c) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		p.cut()
		p.wg.Wait()
	})
	return p
}

func (p *tcpProxy) addr() string { return p.ln.Addr().String() }

func (p *tcpProxy) serve(c net.Conn) {
	if p.refusing.Load() {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		c.Close()
		return
	}
	d, err := net.DialTimeout("tcp", p.target, 10*time.Second)
	if err != nil {
		c.Close()
		return
	}
	pr := &proxied{client: c, server: d, release: make(chan struct{})}
	pr.frozen.Store(p.hanging.Load())
	p.mu.Lock()
	p.conns[pr] = struct{}{}
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Go(func() { pr.pipe(d, c) })
	wg.Go(func() { pr.pipe(c, d) })
	wg.Wait()
	p.mu.Lock()
	delete(p.conns, pr)
	p.mu.Unlock()
}

// proxied is one forwarded connection.
type proxied struct {
	client, server net.Conn
	frozen         atomic.Bool
	release        chan struct{} // closed when the connection is cut
	once           sync.Once
}

// pipe copies src to dst until either side ends. Once frozen it forwards
// nothing more, not even the end of the connection, until cut: a silent
// network partition.
func (pr *proxied) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if pr.frozen.Load() {
			<-pr.release
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				err = werr
			}
		}
		if err != nil {
			pr.cut(false)
			return
		}
	}
}

// cut closes both sides, with a reset when abrupt.
func (pr *proxied) cut(abrupt bool) {
	pr.once.Do(func() {
		for _, c := range []net.Conn{pr.client, pr.server} {
			if tc, ok := c.(*net.TCPConn); ok && abrupt {
				_ = tc.SetLinger(0) // RST, not a polite FIN
			}
			c.Close()
		}
		close(pr.release)
	})
}

// cut resets every open connection on both sides; it returns how many it
// cut.
func (p *tcpProxy) cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pr := range p.conns {
		pr.cut(true)
	}
	n := len(p.conns)
	clear(p.conns)
	return n
}

// freeze stops forwarding on every open connection without closing it, as
// a network partition does; connections opened later work. It returns how
// many it froze.
func (p *tcpProxy) freeze() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pr := range p.conns {
		pr.frozen.Store(true)
	}
	return len(p.conns)
}

// refuse resets every open connection and, while on, every new one: a
// server that refuses connections. Off, connections work again.
func (p *tcpProxy) refuse(on bool) {
	p.refusing.Store(on)
	if on {
		p.cut()
	}
}

// hang freezes every open connection and, while on, every new one: a
// server stopped with SIGSTOP. Off, the frozen connections are cut (as a
// server that was away too long has ended them) and new ones work.
func (p *tcpProxy) hang(on bool) {
	p.hanging.Store(on)
	if on {
		p.freeze()
	} else {
		p.cut()
	}
}

// retryStats counts what a retrying writer did.
type retryStats struct {
	rows, retries int
	ambiguous     int // retries that found the rows committed by an attempt whose COMMIT reported an error
}

// writeRetrying writes transactions of 1 to 5 rows for writer w (keys
// w-0..w-9, seq increasing) until stop closes, reconnecting and retrying a
// transaction that failed. Ids come from the writer, so a retry reuses
// them: a unique violation on a retry means an earlier attempt did commit.
// Every committed transaction is counted in committed.
func writeRetrying(e *env, w int, pause time.Duration, stop <-chan struct{}, committed *atomic.Int64) (st retryStats, err error) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	rng := rand.New(rand.NewPCG(uint64(w), 13))
	for seq := 0; ; {
		select {
		case <-stop:
			return st, nil
		default:
		}
		size := 1 + rng.IntN(5)
		ids := make([]string, size)
		for i := range ids {
			ids[i] = newUUID()
		}
		giveUp := time.Now().Add(90 * time.Second)
		var last error
		for attempt := 0; ; attempt++ {
			if time.Now().After(giveUp) {
				return st, fmt.Errorf("transaction at seq %d not committed after 90s: %w", seq, last)
			}
			if e.ctx.Err() != nil {
				return st, e.ctx.Err()
			}
			if conn == nil {
				c, err := pgx.Connect(e.ctx, e.url)
				if err != nil {
					last = err
					time.Sleep(100 * time.Millisecond) // retry backoff
					continue
				}
				conn = c
			}
			err := pgx.BeginFunc(e.ctx, conn, func(tx pgx.Tx) error {
				for j, id := range ids {
					s := seq + j
					if _, err := tx.Exec(e.ctx, `INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, seq)
						VALUES ($1::uuid, 'w', $2, 'T', jsonb_build_object('writer', $3::int, 'seq', $4::int), $4)`,
						id, fmt.Sprintf("%d-%d", w, s%10), w, s); err != nil {
						return err
					}
				}
				return nil
			})
			if err == nil {
				break
			}
			var pgErr *pgconn.PgError
			if attempt > 0 && errors.As(err, &pgErr) && pgErr.Code == "23505" {
				st.ambiguous++
				break
			}
			st.retries++
			last = err
			conn.Close(context.Background())
			conn = nil
			time.Sleep(100 * time.Millisecond) // retry backoff
		}
		seq += size
		st.rows += size
		committed.Add(1)
		time.Sleep(pause) // paces the writer
	}
}

// soakWriter writes until stop closes and remembers what it committed.
type soakWriter struct {
	rows       []soakRow // committed, in commit order
	rolled     []string  // ids of rolled-back transactions
	rolledTxns int
	deleted    int
	txns       int
	err        error
}

type soakRow struct {
	id, key string
}

// run writes transactions of 1 to 5 rows for writer w (keys w-0..w-9, seq
// increasing over committed rows), deleting about half of the rows in the
// transaction that inserted them and rolling back one transaction in
// twenty. A row counts as committed only once COMMIT returned nil.
func (sw *soakWriter) run(e *env, w int, stop <-chan struct{}) {
	conn, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		sw.err = err
		return
	}
	defer conn.Close(context.Background())
	rng := rand.New(rand.NewPCG(uint64(w), 11))
	for seq := 0; ; {
		select {
		case <-stop:
			return
		default:
		}
		size := 1 + rng.IntN(5)
		rollback := rng.IntN(20) == 0
		rows := make([]soakRow, size)
		deleted := 0
		tx, err := conn.Begin(e.ctx)
		if err != nil {
			sw.err = err
			return
		}
		for j := range size {
			s := seq + j
			rows[j] = soakRow{id: newUUID(), key: fmt.Sprintf("%d-%d", w, s%10)}
			if _, err := tx.Exec(e.ctx, `INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, seq)
				VALUES ($1::uuid, 'w', $2, 'T', jsonb_build_object('writer', $3::int, 'seq', $4::int), $4)`,
				rows[j].id, rows[j].key, w, s); err != nil {
				sw.err = err
				return
			}
			if rng.IntN(2) == 0 {
				if _, err := tx.Exec(e.ctx, `DELETE FROM outbox WHERE id = $1::uuid`, rows[j].id); err != nil {
					sw.err = err
					return
				}
				deleted++
			}
		}
		if rollback {
			if err := tx.Rollback(e.ctx); err != nil {
				sw.err = err
				return
			}
			for _, r := range rows {
				sw.rolled = append(sw.rolled, r.id)
			}
			sw.rolledTxns++
			continue
		}
		if err := tx.Commit(e.ctx); err != nil {
			sw.err = err
			return
		}
		sw.rows = append(sw.rows, rows...)
		sw.deleted += deleted
		sw.txns++
		seq += size
		time.Sleep(time.Duration(20+rng.IntN(40)) * time.Millisecond) // paces the writer
	}
}

// newUUID is a random (version 4) UUID in PostgreSQL's text form.
func newUUID() string {
	var b [16]byte
	crand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// committedRows reads the outbox: per aggregate id, the ids in seq order.
func committedRows(t *testing.T, e *env, conn *pgx.Conn) (map[string][]string, int) {
	t.Helper()
	rows, err := conn.Query(e.ctx, `SELECT id::text, aggregate_id FROM outbox ORDER BY aggregate_id, seq`)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{}
	n := 0
	for rows.Next() {
		var id, key string
		if err := rows.Scan(&id, &key); err != nil {
			t.Fatal(err)
		}
		want[key] = append(want[key], id)
		n++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return want, n
}

func countRows(t *testing.T, e *env, conn *pgx.Conn) int {
	t.Helper()
	var n int
	if err := conn.QueryRow(e.ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// checkDelivered fails the test unless the ids read are exactly those of
// want (key → ids in commit order), none of forbidden, and per key their
// first arrivals come in want's order. It returns the duplicate count.
func checkDelivered(t *testing.T, recs []*kgo.Record, want map[string][]string, forbidden map[string]bool) int {
	t.Helper()
	wanted := map[string]string{} // id → key
	for k, ids := range want {
		for _, id := range ids {
			wanted[id] = k
		}
	}
	seen := map[string]bool{}
	order := map[string][]string{}
	dups, errs := 0, 0
	report := func(format string, args ...any) {
		if errs++; errs <= 10 {
			t.Errorf(format, args...)
		}
	}
	for _, r := range recs {
		id, ok := header(r, "id")
		if !ok {
			report("record without an id header at %s/%d@%d", r.Topic, r.Partition, r.Offset)
			continue
		}
		if seen[id] {
			dups++
			continue
		}
		seen[id] = true
		switch k, ok := wanted[id]; {
		case forbidden[id]:
			report("id %s of a rolled-back transaction was published", id)
		case !ok:
			report("id %s was published but never committed", id)
		case k != string(r.Key):
			report("id %s published with key %q, committed with %q", id, r.Key, k)
		default:
			order[k] = append(order[k], id)
		}
	}
	keys := make([]string, 0, len(want))
	for k := range want {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		got, exp := order[k], want[k]
		for i := range exp {
			if i >= len(got) {
				report("key %s: %d of %d committed events delivered; first missing %s", k, len(got), len(exp), exp[i])
				break
			}
			if got[i] != exp[i] {
				report("key %s: event %d in first-arrival order is %s, commit order says %s", k, i, got[i], exp[i])
				break
			}
		}
	}
	if errs > 10 {
		t.Errorf("… and %d more delivery errors", errs-10)
	}
	return dups
}

// readyz is the status code of a relay's /readyz, 0 when it does not
// answer.
// activeOf is which of two relays (metrics addresses addrs) is active,
// ready while the other is running but not (a standby); -1 and why
// otherwise.
func activeOf(addrs [2]string) (int, error) {
	a, b := readyz(addrs[0]), readyz(addrs[1])
	switch {
	case a == 200 && b == 503:
		return 0, nil
	case a == 503 && b == 200:
		return 1, nil
	}
	return -1, fmt.Errorf("/readyz: %d and %d", a, b)
}

func readyz(addr string) int {
	cl := http.Client{Timeout: 2 * time.Second}
	resp, err := cl.Get("http://" + addr + "/readyz")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}
