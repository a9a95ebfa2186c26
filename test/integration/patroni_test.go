package integration

// Patroni and walrelay: the two things Patroni does to a logical slot,
// done here as Patroni does them, without Patroni. With the slot named
// under slots: in its dynamic configuration, Patroni keeps a copy on each
// replica: it reads the slot's state file on the primary
// (pg_read_binary_file), writes it into the replica's pg_replslot with the
// replica stopped, starts it, and moves the copy forward with
// pg_replication_slot_advance to where the primary's slot was at its last
// loop. Without slots: (or ignore_slots) it drops every slot it does not
// know once no client streams from it: the slot walrelay setup just
// created, before walrelay run. docs/operating.md, running under Patroni,
// says what was seen with Patroni itself.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// copySlotAsPatroni copies the primary's logical slot name to the standby
// as Patroni does: the state file read on the primary, written into the
// stopped standby's pg_replslot, the standby started again.
func (rs *replicaSet) copySlotAsPatroni(db, name string) {
	rs.t.Helper()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, rs.primary.URL(db))
	if err != nil {
		rs.t.Fatal(err)
	}
	var state []byte
	err = c.QueryRow(ctx, `SELECT pg_read_binary_file('pg_replslot/' || $1 || '/state')`, name).Scan(&state)
	c.Close(ctx)
	if err != nil {
		rs.t.Fatalf("read the slot's state file on the primary: %v", err)
	}
	if err := rs.standby.Stop(); err != nil {
		rs.t.Fatal(err)
	}
	dir := filepath.Join(rs.standby.Dir, "data", "pg_replslot", name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		rs.t.Fatal(err)
	}
	file := filepath.Join(dir, "state")
	if err := os.WriteFile(file, state, 0o600); err != nil {
		rs.t.Fatal(err)
	}
	if os.Geteuid() == 0 { // the server runs as postgres (devcluster)
		u, err := user.Lookup("postgres")
		if err != nil {
			rs.t.Fatal(err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		for _, p := range []string{dir, file} {
			if err := os.Chown(p, uid, gid); err != nil {
				rs.t.Fatal(err)
			}
		}
	}
	if err := rs.standby.Start(ctx); err != nil {
		rs.t.Fatal(err)
	}
	if err := rs.standby.WaitStreaming(ctx); err != nil {
		rs.t.Fatal(err)
	}
}

// copyAdvancer moves the standby's copy of a slot forward every interval
// to where the primary's slot was at the previous round, no further than
// the standby replayed: Patroni's loop, which publishes the primary's
// confirmed_flush_lsn in its DCS and advances the replicas' copies to it.
type copyAdvancer struct {
	stop     chan struct{}
	wg       sync.WaitGroup
	mu       sync.Mutex
	advanced int
	lastErr  error
}

func (rs *replicaSet) advanceCopy(db, name string, interval time.Duration) *copyAdvancer {
	a := &copyAdvancer{stop: make(chan struct{})}
	primaryURL, standbyURL := rs.primary.URL(db), rs.standby.URL(db)
	a.wg.Go(func() {
		ctx := context.Background()
		var published string // the primary's position at the previous round
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-a.stop:
				return
			case <-t.C:
			}
			err := func() error {
				if published != "" {
					s, err := pgx.Connect(ctx, standbyURL)
					if err != nil {
						return err
					}
					defer s.Close(ctx)
					if _, err := s.Exec(ctx, `SELECT pg_replication_slot_advance($1, least($2::pg_lsn, pg_last_wal_replay_lsn()))
						FROM pg_replication_slots WHERE slot_name = $1 AND confirmed_flush_lsn < $2::pg_lsn`, name, published); err != nil {
						return err
					}
				}
				p, err := pgx.Connect(ctx, primaryURL)
				if err != nil {
					return err
				}
				defer p.Close(ctx)
				return p.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, name).Scan(&published)
			}()
			a.mu.Lock()
			if err == nil {
				a.advanced++
			}
			a.lastErr = err
			a.mu.Unlock()
		}
	})
	return a
}

func (a *copyAdvancer) halt() (rounds int, err error) {
	select {
	case <-a.stop:
	default:
		close(a.stop)
	}
	a.wg.Wait()
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.advanced, a.lastErr
}

// confirmedOn is the confirmed position of slot name on the server of url.
func confirmedOn(t *testing.T, url, name string) decoder.LSN {
	t.Helper()
	c, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	var s string
	if err := c.QueryRow(context.Background(), `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, name).Scan(&s); err != nil {
		t.Fatalf("the confirmed position of slot %s: %v", name, err)
	}
	lsn, err := slot.ParseLSN(s)
	if err != nil {
		t.Fatal(err)
	}
	return lsn
}

// TestPatroniSlotCopyCarriesOn: a primary and a standby with a copy of the
// relay's slot kept as Patroni keeps it for a slot under slots: (on 17+
// the slot is not a failover slot, as Patroni's is not). Given both
// nodes' URLs, the relay's failover line (INFO, not WARN) and status say a
// failover keeps the slot and how far the copy lags, never that it loses
// it; status on the standby says it holds a copy. Then the primary is
// killed and the standby promoted under writers: the relay goes on from
// the copy, every committed id delivered, the duplicates those of the
// WAL the copy lagged.
func TestPatroniSlotCopyCarriesOn(t *testing.T) {
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	c := e.consume()
	primaryURL, standbyURL := rs.primary.URL(e.name), rs.standby.URL(e.name)
	nodes := []string{"--standby-url", primaryURL, "--standby-url", standbyURL}
	args := append(withFlag(e.args(), "--slot-poll-interval", "1s"), "--no-failover-slot")
	args = append(args, nodes...)
	p := startProc(t, nil, args...)
	e.waitSlotActive(p)
	conn := e.conn()
	first := e.insertRows(conn, 20, "first")
	c.waitAll(first, time.Minute)

	rs.copySlotAsPatroni(e.name, e.name)
	adv := rs.advanceCopy(e.name, e.name, 500*time.Millisecond)
	defer adv.halt()
	const keeps = "keeps a copy of the slot that slot synchronization did not make"
	var out string
	e.waitFor("status saying the standby's copy keeps the slot", time.Minute, func() (bool, error) {
		out, _ = runOutput(t, append([]string{"status", "--pg-url", e.url, "--slot", e.name}, nodes...)...)
		return strings.Contains(out, keeps), fmt.Errorf("status said:\n%s", out)
	})
	for _, w := range []string{"standby postgres@127.0.0.1:" + strconv.Itoa(rs.standby.Port), "a failover to it keeps the slot and resumes from the copy's position",
		"Kafka can hold events of the old primary's last transactions that the new primary does not have"} {
		if !strings.Contains(out, w) {
			t.Errorf("status lacks %q:\n%s", w, out)
		}
	}
	if strings.Contains(out, "loses the slot") {
		t.Errorf("status says a failover loses the slot though the standby keeps a copy:\n%s", out)
	}
	e.waitFor("the relay's failover line naming the copy", time.Minute, func() (bool, error) {
		line := logLine(p.out.String(), keeps)
		return line != "", errors.New("no failover line naming the copy yet")
	})
	if line := logLine(p.out.String(), keeps); !strings.Contains(line, `"level":"info"`) {
		t.Errorf("the failover line naming a copy that keeps the slot is not at INFO: %s", line)
	}
	if out, _ := runOutput(t, "status", "--pg-url", standbyURL, "--slot", e.name); !strings.Contains(out, "this server is a standby, and this standby "+keeps) {
		t.Errorf("status on the standby does not say it keeps a copy:\n%s", out)
	}

	fw := e.startFailoverWriters(2, 5*time.Millisecond)
	defer fw.halt()
	n := len(distinctIDs(c.records()))
	e.waitFor("records before the failover", 2*time.Minute, func() (bool, error) {
		got := len(distinctIDs(c.records()))
		return got >= n+200, fmt.Errorf("%d ids read", got)
	})
	rounds, advErr := adv.halt()
	if rounds == 0 {
		t.Fatalf("the copy was never advanced: %v", advErr)
	}
	copyAt, primaryAt := confirmedOn(t, standbyURL, e.name), confirmedOn(t, primaryURL, e.name)
	rs.failover(nil)
	n = len(distinctIDs(c.records()))
	e.waitFor("records after the failover", 2*time.Minute, func() (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("the relay exited: %s", finalLines(p.out.String()))
		default:
		}
		got := len(distinctIDs(c.records()))
		return got > n, fmt.Errorf("%d ids read", got)
	})
	fw.halt()
	committed := e.committedIDs()
	var all []string
	for id := range committed {
		all = append(all, id)
	}
	e.waitFor("every committed id delivered", 2*time.Minute, func() (bool, error) {
		m := missingIDs(c, all)
		return len(m) == 0, fmt.Errorf("%d committed ids not read", len(m))
	})
	// Not checkSurvivingHistory: before PostgreSQL 17 nothing holds
	// decoding back until the standby has the WAL, so events of the last
	// transactions the killed primary committed and the standby never
	// received can be in Kafka (status says so: asserted above).
	dups, phantoms := 0, 0
	for id, n := range distinctIDs(c.records()) {
		if !committed[id] {
			phantoms++
		}
		dups += n - 1
	}
	if inv := orderInversions(c.records()); inv > 0 {
		t.Errorf("%d records out of per-key order", inv)
	}
	// The promoted standby's slot is the copy: the relay resumed from the
	// copy's last position and sent the events after it again.
	resumed := logLine(p.out.String(), "behind what this process had acknowledged on the old timeline")
	if !strings.Contains(resumed, `"slot_confirmed_lsn":"`+copyAt.String()+`"`) || dups == 0 {
		t.Errorf("the relay did not resume from the copy's position %s, sending the events after it again (%d duplicates): %s", copyAt, dups, resumed)
	}
	t.Logf("a copy kept as Patroni keeps it (advanced %d times): confirmed at %s when the primary's was at %s (%d bytes behind); kill -9 failover: %d committed, 0 lost, %d duplicates, %d delivered of transactions the promoted standby never received",
		rounds, copyAt, primaryAt, int64(primaryAt-copyAt), len(committed), dups, phantoms)
}

// TestSlotNeverStreamedRefusal: a slot walrelay setup created and that is
// gone before walrelay run (Patroni without slots: or ignore_slots drops
// it within its loop) is refused as one no relay streamed from, naming
// Patroni's settings and log line, not a failover under a running relay;
// once a relay streamed from it, the refusal says so. A record table of
// an older walrelay gains the column that tells them apart, its rows
// counting as streamed from (not known).
func TestSlotNeverStreamedRefusal(t *testing.T) {
	e := newEnv(t)
	c := e.consume()
	if out, code := runOutput(t, e.setupArgs()...); code != 0 {
		t.Fatalf("setup exit %d:\n%s", code, out)
	}
	e.exec(`SELECT pg_drop_replication_slot($1)`, e.name) // as Patroni does
	run := withFlag(e.args(), "--startup-timeout", "5s")
	const never, streamed = "no relay ever streamed from it", "is gone, though walrelay streamed from it"
	refusedWith(t, run, `replication slot "`+e.name+`" is gone`, never, "Dropped unknown replication slot", "slots: {"+e.name+":", "ignore_slots: [{name: "+e.name+"}]", "may be missing", "--accept-gap")
	out, code := runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
	if code != 2 || !strings.Contains(out, never) || strings.Contains(out, streamed) {
		t.Errorf("status of the slot never streamed from: exit %d, want 2 saying %q:\n%s", code, never, out)
	}

	// The way on, then a relay that streams: the record says so, and the
	// refusal once the slot is gone again says walrelay streamed from it.
	if out, code := runOutput(t, e.setupArgs("--accept-gap")...); code != 0 {
		t.Fatalf("setup --accept-gap exit %d:\n%s", code, out)
	}
	p := startProc(t, nil, e.args()...)
	e.waitSlotActive(p)
	ids := e.insertRows(e.conn(), 5, "streamed")
	c.waitAll(ids, time.Minute)
	var marked bool
	rc := e.conn()
	e.waitFor("the record saying a relay streamed from the slot", 30*time.Second, func() (bool, error) {
		err := rc.QueryRow(e.ctx, `SELECT streamed_at IS NOT NULL FROM walrelay.slots WHERE slot_name = $1`, e.name).Scan(&marked)
		return marked, err
	})
	stopProc(t, p)
	e.exec(`SELECT pg_drop_replication_slot($1)`, e.name)
	out, _, _, _ = runBounded(t, 30*time.Second, nil, run...)
	if final := finalLines(out); !strings.Contains(final, streamed) || strings.Contains(final, never) || !strings.Contains(final, "Dropped unknown replication slot") {
		t.Errorf("the refusal of a slot a relay streamed from does not say so, or names no Patroni: %s", final)
	}

	// A record table without the column (an older walrelay's): setup adds
	// it, the row already there counting as streamed from; a new slot's
	// row as never streamed from.
	e.exec(`ALTER TABLE walrelay.slots DROP COLUMN streamed_at`)
	other := e.name + "_b"
	if out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", other, "--publication", e.name); code != 0 {
		t.Fatalf("setup of a second slot exit %d:\n%s", code, out)
	}
	rows, err := rc.Query(e.ctx, `SELECT slot_name, coalesce(streamed_at::text, 'NULL') FROM walrelay.slots ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for rows.Next() {
		var name, at string
		if err := rows.Scan(&name, &at); err != nil {
			t.Fatal(err)
		}
		got[name] = at
	}
	if got[e.name] != "-infinity" || got[other] != "NULL" {
		t.Errorf("streamed_at after adding the column: %v, want -infinity for the row already there and NULL for the new slot's", got)
	}
}
