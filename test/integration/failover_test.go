package integration

// Failover tests: a primary with a streaming standby, writers committing
// through a multi-host URL, kill -9 of the primary and promotion of the
// standby, the relay connected through the same URL. Without failover
// slots the new primary has no slot: the relay refuses to go on, names
// the gap and creates nothing. With PostgreSQL 17's failover slots and
// synchronized_standby_slots the relay carries on from the synchronized
// slot: every committed id delivered, per-key order kept, in both delivery
// modes and across several failovers in a row.

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// failoverWriters commit outbox rows the documented way (docs/outbox-table.md: insert and delete in
// the business transaction) through the set's multi-host URL, and note
// each committed id in a table of their own in the same transaction: after
// any number of failovers, that table on the last primary is exactly what
// committed in the history that survived.
type failoverWriters struct {
	e        *env
	stop     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
}

func (e *env) startFailoverWriters(n int, pause time.Duration) *failoverWriters {
	e.t.Helper()
	e.exec(`CREATE TABLE committed (id uuid PRIMARY KEY, key text NOT NULL, seq bigint NOT NULL,
		lsn pg_lsn NOT NULL DEFAULT pg_current_wal_insert_lsn(), at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	fw := &failoverWriters{e: e, stop: make(chan struct{})}
	for w := 0; w < n; w++ {
		fw.wg.Go(func() { fw.run(w, pause) })
	}
	return fw
}

func (fw *failoverWriters) run(w int, pause time.Duration) {
	e := fw.e
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	key := fmt.Sprintf("k%d", w)
	for seq := 0; ; seq++ {
		select {
		case <-fw.stop:
			return
		default:
		}
		if conn == nil {
			c, err := pgx.Connect(e.ctx, e.url)
			if err != nil {
				time.Sleep(50 * time.Millisecond) // reconnect backoff
				continue
			}
			conn = c
		}
		id := newUUID()
		err := pgx.BeginFunc(e.ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(e.ctx, `INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, seq)
				VALUES ($1::uuid, 'order', $2, 'Created', jsonb_build_object('seq', $3::bigint), $3)`, id, key, seq); err != nil {
				return err
			}
			if _, err := tx.Exec(e.ctx, `INSERT INTO committed (id, key, seq) VALUES ($1::uuid, $2, $3)`, id, key, seq); err != nil {
				return err
			}
			_, err := tx.Exec(e.ctx, `DELETE FROM outbox WHERE id = $1::uuid`, id)
			return err
		})
		if err != nil {
			if e.ctx.Err() != nil {
				return
			}
			conn.Close(context.Background())
			conn = nil
			time.Sleep(50 * time.Millisecond) // reconnect backoff
			continue
		}
		time.Sleep(pause) // paces the writer
	}
}

func (fw *failoverWriters) halt() {
	fw.stopOnce.Do(func() { close(fw.stop) })
	fw.wg.Wait()
}

// committedIDs reads, on the current primary, every id that committed.
func (e *env) committedIDs() map[string]bool {
	e.t.Helper()
	c := e.conn()
	rows, err := c.Query(e.ctx, `SELECT id::text FROM committed`)
	if err != nil {
		e.t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		e.t.Fatal(err)
	}
	m := make(map[string]bool, len(ids))
	for _, id := range ids {
		m[id] = true
	}
	return m
}

// committedCount is how many rows committed so far, on the current primary.
func (e *env) committedCount() int {
	c, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		return -1
	}
	defer c.Close(context.Background())
	var n int
	if err := c.QueryRow(e.ctx, `SELECT count(*) FROM committed`).Scan(&n); err != nil {
		return -1
	}
	return n
}

// orderInversions counts, per key, records whose seq is below one already
// read for the first time on that key: a redelivered duplicate after a
// restart is not an inversion, a first delivery out of order is.
func orderInversions(recs []*kgo.Record) int {
	type seen struct {
		max    int64
		firsts map[string]bool
	}
	byKey := map[string]*seen{}
	bad := 0
	for _, r := range recs {
		id, ok := header(r, "id")
		if !ok {
			continue // a checkpoint or heartbeat record
		}
		var seq int64
		_, _ = fmt.Sscanf(strings.TrimPrefix(strings.TrimSpace(string(r.Value)), `{"seq": `), "%d", &seq)
		s := byKey[string(r.Key)]
		if s == nil {
			s = &seen{max: -1, firsts: map[string]bool{}}
			byKey[string(r.Key)] = s
		}
		if s.firsts[id] {
			continue
		}
		s.firsts[id] = true
		if seq < s.max {
			bad++
		}
		s.max = max(s.max, seq)
	}
	return bad
}

// waitSynced waits until the standby has a synchronized, persistent copy of
// the slot (PostgreSQL 17's slot synchronization).
func (rs *replicaSet) waitSynced(slotName string) {
	rs.t.Helper()
	c, err := pgx.Connect(context.Background(), rs.standby.URL("postgres"))
	if err != nil {
		rs.t.Fatal(err)
	}
	defer c.Close(context.Background())
	err = devcluster.WaitFor(3*time.Minute, 100*time.Millisecond, func() (bool, error) {
		var synced, temporary bool
		err := c.QueryRow(context.Background(), `SELECT synced, temporary FROM pg_replication_slots WHERE slot_name = $1`, slotName).Scan(&synced, &temporary)
		if errors.Is(err, pgx.ErrNoRows) {
			return false, errors.New("no copy of the slot on the standby")
		}
		return err == nil && synced && !temporary, fmt.Errorf("synced %v, temporary %v (%v)", synced, temporary, err)
	})
	if err != nil {
		rs.t.Fatalf("the standby's copy of slot %s: %v", slotName, err)
	}
}

// TestFailoverWithoutFailoverSlotIsRefused: on every version, a failover
// to a standby without a copy of the slot is refused by the running relay
// and by a restart, naming the gap; nothing is created on the new primary
// until walrelay setup --accept-gap, after which the relay goes on.
func TestFailoverWithoutFailoverSlotIsRefused(t *testing.T) {
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	c := e.consume()
	args := append(e.args(), "--no-failover-slot")
	p := startProc(t, nil, args...)
	e.waitSlotActive(p)
	out, _ := runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
	want := map[bool]string{true: "not a failover slot: a failover loses it", false: "a failover to one of its 1 standbys loses the slot"}[pgVersion >= 170000]
	if !strings.Contains(out, want) {
		t.Errorf("status does not warn %q:\n%s", want, out)
	}
	// The same from the relay's own least-privileged role, from which
	// pg_stat_replication hides the standby's state (it lacks
	// pg_read_all_stats).
	if out, code := runOutput(t, "status", "--pg-url", e.leastPrivilegedURL(), "--slot", e.name); !strings.Contains(out, want) {
		t.Errorf("status as a role without pg_read_all_stats does not warn %q (exit %d):\n%s", want, code, out)
	}
	// Writers start once the slot exists: rows committed before it (and
	// deleted in their transaction) are in no slot's stream.
	fw := e.startFailoverWriters(4, 5*time.Millisecond)
	defer fw.halt()
	e.waitFor("the relay streaming and publishing", 60*time.Second, func() (bool, error) {
		return len(distinctIDs(c.records())) >= 200, fmt.Errorf("%d ids read", len(distinctIDs(c.records())))
	})
	before := e.committedCount()
	rs.failover(nil)
	code, elapsed, exited := p.wait(2 * time.Minute)
	out = finalLines(p.out.String())
	t.Logf("the running relay, %s after the failover: exit %d: %s", elapsed.Round(time.Millisecond), code, out)
	if !exited || code != 2 {
		t.Fatalf("the running relay did not refuse (exited %v, code %d)", exited, code)
	}
	for _, w := range []string{"replication slot", "may be missing", "--accept-gap"} {
		if !strings.Contains(out, w) {
			t.Errorf("the refusal lacks %q: %s", w, out)
		}
	}
	// A supervisor's restart refuses too, at once, and creates nothing.
	refusedWith(t, withFlag(args, "--startup-timeout", "30s"), "replication slot", "--accept-gap", "failover slot")
	if _, err := e.slotInfoErr(); err == nil {
		t.Fatal("a slot exists on the new primary: the refusing relay created it")
	}
	fw.halt()
	committed := e.committedIDs()
	delivered := distinctIDs(c.records())
	lost := 0
	for id := range committed {
		if delivered[id] == 0 {
			lost++
		}
	}
	t.Logf("without failover slots: %d committed (%d before the failover), %d delivered, %d not delivered: the gap the refusal names", len(committed), before, len(delivered), lost)
	out2, code2 := runOutput(t, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name, "--accept-gap")
	if code2 != 0 {
		t.Fatalf("setup --accept-gap exit %d:\n%s", code2, out2)
	}
	startProc(t, nil, args...)
	after := e.insertRows(e.conn(), 10, "after")
	c.waitAll(after, time.Minute)
}

// TestFailoverSlotCarriesOn: PostgreSQL 17+, failover slots synchronized to
// the standby and synchronized_standby_slots on the primary. Writers commit
// throughout; the primary is killed and the standby promoted three times in
// a row; the relay, through the multi-host URL, goes on from the
// synchronized slot each time. Every committed id is delivered, none
// delivered that did not commit, and per-key order is kept, in both
// delivery modes.
func TestFailoverSlotCarriesOn(t *testing.T) {
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			// Each mode has servers of its own, and most of a failover is
			// waiting: the two side by side take little more than one,
			// the longest test of 17's core subset in CI.
			t.Parallel()
			rs := startReplicaSet(t, replicaSetOptions{FailoverSlots: true, SynchronizedStandbySlots: true})
			e := rs.newEnv()
			var c *consumer
			args := e.args()
			if mode == "exactly-once" {
				c = e.consumeWith(kgo.FetchIsolationLevel(kgo.ReadCommitted()))
				args = e.eosArgs()
			} else {
				c = e.consume()
			}
			p := startProc(t, nil, args...)
			e.waitSlotActive(p)
			// status says the failover keeps the slot. Asked until it does:
			// the slot shows active while the first start creates it, and
			// becomes a failover slot only after the initial snapshot.
			var out string
			e.waitFor("status saying synchronized_standby_slots protects the failover slot", 30*time.Second, func() (bool, error) {
				out, _ = runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
				return strings.Contains(out, "failover slot, held back by synchronized_standby_slots"), fmt.Errorf("status said:\n%s", out)
			})
			fw := e.startFailoverWriters(4, 5*time.Millisecond)
			defer fw.halt()
			const failovers = 3
			var promotedToRecord []time.Duration
			var promotions []string
			for i := 1; i <= failovers; i++ {
				n := len(distinctIDs(c.records()))
				e.waitFor(fmt.Sprintf("records before failover %d", i), 2*time.Minute, func() (bool, error) {
					got := len(distinctIDs(c.records()))
					return got >= n+200, fmt.Errorf("%d ids read", got)
				})
				rs.waitSynced(e.name)
				var promoted time.Time
				rs.failover(func() {
					promoted = time.Now()
					var l string
					c, err := pgx.Connect(e.ctx, rs.primary.URL("postgres"))
					if err == nil {
						_ = c.QueryRow(e.ctx, "SELECT pg_current_wal_lsn()::text").Scan(&l)
						c.Close(context.Background())
					}
					promotions = append(promotions, fmt.Sprintf("%s (%s)", promoted.Format("15:04:05.000"), l))
				})
				n = len(distinctIDs(c.records()))
				e.waitFor(fmt.Sprintf("records after failover %d", i), 2*time.Minute, func() (bool, error) {
					select {
					case <-p.done:
						return false, fmt.Errorf("the relay exited: %s", finalLines(p.out.String()))
					default:
					}
					got := len(distinctIDs(c.records()))
					return got > n, fmt.Errorf("%d ids read", got)
				})
				promotedToRecord = append(promotedToRecord, time.Since(promoted))
			}
			fw.halt()
			committed := e.committedIDs()
			var all []string
			for id := range committed {
				all = append(all, id)
			}
			err := devcluster.WaitFor(2*time.Minute, 500*time.Millisecond, func() (bool, error) {
				m := missingIDs(c, all)
				return len(m) == 0, fmt.Errorf("%d committed ids not read", len(m))
			})
			if err != nil {
				m := missingIDs(c, all)
				rows, qerr := e.conn().Query(e.ctx, `SELECT key, seq, lsn::text, at FROM committed WHERE id = ANY($1::uuid[]) ORDER BY lsn`, m)
				if qerr == nil {
					for rows.Next() {
						var key, lsn string
						var seq int64
						var at time.Time
						_ = rows.Scan(&key, &seq, &lsn, &at)
						t.Logf("not delivered: key %s seq %d lsn %s at %s", key, seq, lsn, at.Format("15:04:05.000"))
					}
				}
				select {
				case <-p.done:
					t.Logf("the relay had exited: %s", finalLines(p.out.String()))
				default:
				}
				t.Fatalf("%v; promotions at %v", err, promotions)
			}
			recs := c.records()
			dups, phantoms, inv := checkSurvivingHistory(t, mode, committed, recs)
			t.Logf("%s: %d failovers, %d committed, %d delivered, 0 lost, %d duplicates, %d delivered without committing, %d order inversions; promotion to the first new record: %v",
				mode, failovers, len(committed), len(distinctIDs(recs)), dups, phantoms, inv, promotedToRecord)
		})
	}
}

// leastPrivilegedURL is e.url as a role of the test's own with LOGIN and
// REPLICATION and the reads status needs (the record table), nothing more;
// dropped at the test's end.
func (e *env) leastPrivilegedURL() string {
	e.t.Helper()
	role := e.name + "_lp"
	e.exec(`CREATE ROLE ` + role + ` WITH LOGIN REPLICATION`)
	e.dropRoleAtEnd(role)
	e.exec(`GRANT USAGE ON SCHEMA walrelay TO ` + role)
	e.exec(`GRANT SELECT ON walrelay.slots TO ` + role)
	u, err := url.Parse(e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	u.User = url.User(role)
	return u.String()
}

// checkSurvivingHistory checks what a consumer read (recs) after failovers
// against the ids the surviving history committed: none published of a
// transaction it does not have, per-key order kept, and no duplicate under
// exactly-once. It returns the duplicates, those phantoms and the order
// inversions, for the test's log.
func checkSurvivingHistory(t *testing.T, mode string, committed map[string]bool, recs []*kgo.Record) (dups, phantoms, inv int) {
	t.Helper()
	for id, n := range distinctIDs(recs) {
		if !committed[id] {
			phantoms++
		}
		dups += n - 1
	}
	inv = orderInversions(recs)
	if phantoms > 0 {
		t.Errorf("%d records published of transactions the surviving history does not have", phantoms)
	}
	if inv > 0 {
		t.Errorf("%d records out of per-key order", inv)
	}
	if mode == "exactly-once" && dups > 0 {
		t.Errorf("%d duplicates under exactly-once with a read_committed consumer", dups)
	}
	return dups, phantoms, inv
}
