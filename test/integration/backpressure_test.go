package integration

import (
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/relay"
)

// TestBackpressureKeepsReplicationConnection fills the relay's in-flight
// window while Kafka answers nothing (a frozen broker), so that the relay
// stops reading the replication stream and the walsender blocks writing
// to it, with a wal_sender_timeout of 3 s and the default status interval
// (10 s): the walsender must keep hearing the relay (its reply_time moves
// on) and must not end the connection for a replication timeout. The
// stream is one large transaction, which reaches the relay in full-sized
// segments: its socket fills without the window shrinking that stops
// status updates under many small transactions (the case of
// TestFrozenBrokerReplicationTimeoutNoticedAtOnce). A connection cut on
// the network (the proxy's) meanwhile is noticed while Kafka is still out
// (the stream ends, a WARN), not when it comes back.
func TestBackpressureKeepsReplicationConnection(t *testing.T) {
	e := newEnv(t)
	const senderTimeout = 3 * time.Second
	cfg, proxy := e.configThroughProxy()
	// %20, not +: pgx reads a URL's query without turning + into a space.
	cfg.PGURL += fmt.Sprintf("&options=-c%%20wal_sender_timeout%%3D%dms", senderTimeout.Milliseconds())
	// The default, longer than the server's timeout, as a relay's may well
	// be (a role's setting, a managed server's default): the relay must
	// not depend on it while it does not read.
	cfg.StatusInterval = relay.DefaultConfig().StatusInterval
	cfg.ReceiveTimeout = 60 * time.Second
	logs := e.observeLogs()
	rr, reg := e.startRelayGathered(cfg)
	c := e.consume()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', '{}', 0)`)
	c.waitIDs(1, 30*time.Second)

	unfreeze := e.freezeKafka()
	defer unfreeze()
	// Far more than the in-flight window and every socket buffer between
	// the walsender and the relay hold.
	const rows = 30000
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
		SELECT 'o', 'k' || (g % 10), 'T', jsonb_build_object('pad', repeat('x', 1000)), g FROM generate_series(1, $1) g`, rows)
	conn := e.conn()
	var pid int32
	var blockedAt time.Time
	e.waitFor("the walsender blocked writing to the relay", 60*time.Second, func() (bool, error) {
		var ev *string
		err := conn.QueryRow(e.ctx, `SELECT pid, wait_event FROM pg_stat_activity
			WHERE pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1)`, e.name).Scan(&pid, &ev)
		if err == pgx.ErrNoRows {
			return false, nil
		}
		blockedAt = time.Now()
		return err == nil && ev != nil && *ev == "WalSenderWriteData", err
	})
	e.waitFor("3 x wal_sender_timeout with the walsender blocked", 60*time.Second, func() (bool, error) {
		var now int32
		var reply *time.Time
		err := conn.QueryRow(e.ctx, `SELECT coalesce((SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1), 0),
			(SELECT reply_time FROM pg_stat_replication WHERE pid = $2)`, e.name, pid).Scan(&now, &reply)
		if err != nil {
			return false, err
		}
		if now != pid {
			t.Fatalf("the walsender changed (pid %d, now %d) %s after it blocked: the server ended the connection; restarts: %v",
				pid, now, time.Since(blockedAt).Round(time.Millisecond), gathered(reg, "walrelay_stream_restarts_total"))
		}
		return time.Since(blockedAt) > 3*senderTimeout && reply != nil && reply.After(blockedAt.Add(2*senderTimeout)), nil
	})

	// A cut on the network (a terminated walsender is no test of this: it
	// waits to write its error to a client that does not read).
	if proxy.cut() == 0 {
		t.Fatal("no connection through the proxy to cut")
	}
	e.waitFor("the relay to notice the cut while Kafka is frozen", 30*time.Second, func() (bool, error) {
		return !rr.relay.Streaming() && len(warnings(logs, "the replication connection broke")) > 0, nil
	})
	unfreeze()
	c.waitIDs(rows+1, 120*time.Second)
}

// freezeKafka makes the test's broker stop answering, as a process stopped
// by SIGSTOP does: Apache Kafka is stopped so, kfake stops answering
// produce requests. It returns the thaw, which may be called more than
// once.
func (e *env) freezeKafka() (thaw func()) {
	e.t.Helper()
	var once sync.Once
	if apache != nil {
		pid := apache.Pid(1)
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			e.t.Fatal(err)
		}
		thaw = func() { once.Do(func() { _ = syscall.Kill(pid, syscall.SIGCONT) }) }
		e.t.Cleanup(thaw)
		return thaw
	}
	e.needKfake()
	ch := make(chan struct{})
	e.kafka.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.KeepControl()
		select {
		case <-ch:
			e.kafka.DropControl()
			return nil, nil, false
		default:
		}
		e.kafka.SleepControl(func() { <-ch })
		return nil, nil, false
	})
	return func() { once.Do(func() { close(ch) }) }
}

// TestFrozenBrokerReplicationTimeoutNoticedAtOnce freezes Kafka under a
// steady stream of small transactions, as an outbox takes them, with a
// wal_sender_timeout of 3 s and the replication connection straight to
// PostgreSQL (no proxy between them). Once the in-flight window is full
// the relay stops reading; its socket from PostgreSQL fills with small
// segments, and Linux can then discard every acknowledgement PostgreSQL
// sends it (docs/failures.md says how), so the status updates stop
// reaching the walsender and PostgreSQL ends the connection for a
// replication timeout. The relay must keep the connection, or notice its
// end while Kafka is still frozen: not streaming, one WARN naming
// wal_sender_timeout; and once Kafka answers, restart from the confirmed
// position and lose nothing.
func TestFrozenBrokerReplicationTimeoutNoticedAtOnce(t *testing.T) {
	e := newEnv(t)
	const senderTimeout = 3 * time.Second
	cfg := e.config()
	cfg.PGURL += fmt.Sprintf("&options=-c%%20wal_sender_timeout%%3D%dms", senderTimeout.Milliseconds())
	cfg.StatusInterval = relay.DefaultConfig().StatusInterval
	cfg.ReceiveTimeout = 60 * time.Second
	// A smaller window than the default only fills sooner.
	cfg.Router.MaxInflightEvents = 1000
	logs := e.observeLogs()
	rr, reg := e.startRelayGathered(cfg)
	c := e.consume()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', '{}', 0)`)
	c.waitIDs(1, 30*time.Second)
	conn := e.conn()
	var pid int32
	if err := conn.QueryRow(e.ctx, `SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1`, e.name).Scan(&pid); err != nil {
		t.Fatal(err)
	}

	// One row per transaction, about a thousand a second, until stopped.
	stop, wrote := make(chan struct{}), make(chan int, 1)
	go func() {
		w := e.conn()
		n := 0
		defer func() { wrote <- n }()
		tk := time.NewTicker(50 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			for range 50 {
				if _, err := w.Exec(e.ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
					VALUES ('o', 'k' || ($1::int % 10), 'T', jsonb_build_object('pad', repeat('x', 100)), $1)`, n+1); err != nil {
					t.Error(err)
					return
				}
				n++
			}
		}
	}()
	stopWriting := sync.OnceValue(func() int { close(stop); return <-wrote })
	defer stopWriting()
	thaw := e.freezeKafka()
	defer thaw()
	frozenAt := time.Now()

	// Kept for 10 wal_sender_timeouts, or ended: either is the server's
	// doing; what the relay makes of an end is the subject.
	var cut bool
	e.waitFor("the walsender to end or to outlast 10 x wal_sender_timeout", 120*time.Second, func() (bool, error) {
		var now int32
		var reply *time.Time
		err := conn.QueryRow(e.ctx, `SELECT coalesce((SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1), 0),
			(SELECT reply_time FROM pg_stat_replication WHERE pid = $2)`, e.name, pid).Scan(&now, &reply)
		if err != nil {
			return false, err
		}
		if now != pid {
			cut = true
			return true, nil
		}
		if time.Since(frozenAt) < 10*senderTimeout {
			return false, nil
		}
		if reply == nil || time.Since(*reply) > senderTimeout {
			return false, fmt.Errorf("the walsender outlasted 10 x wal_sender_timeout without hearing the relay (reply_time %v)", reply)
		}
		return true, nil
	})
	if cut {
		t.Logf("PostgreSQL ended the walsender %s after Kafka froze", time.Since(frozenAt).Round(time.Millisecond))
		e.waitFor("the relay to notice the cut while Kafka is frozen", 10*senderTimeout, func() (bool, error) {
			if ok, err := rr.returned(); ok {
				return false, fmt.Errorf("relay stopped: %v", err)
			}
			return !rr.relay.Streaming() && gathered(reg, "walrelay_streaming")[""] == 0 &&
				len(warnings(logs, "wal_sender_timeout")) > 0, nil
		})
	} else {
		t.Log("the connection outlived the freeze: nothing to notice")
	}

	n := stopWriting()
	thaw()
	c.waitIDs(n+1, 120*time.Second)
	e.waitFor("the relay streaming again", 60*time.Second, func() (bool, error) { return rr.relay.Streaming(), nil })
	if cut {
		// One notice of the timeout itself; the board's hold on
		// postgresql, which repeats the error as its cause, is the other
		// signal, started and ended once.
		if got := warnings(logs, "replication connection timed out", zap.Duration("wal_sender_timeout", senderTimeout)); len(got) != 1 {
			t.Errorf("%d WARNs of the replication connection's timeout, want 1: %v", len(got), got)
		}
		if got := warnings(logs, "delivery held by postgresql", zap.String("reason", "ConnectionLost")); len(got) < 1 {
			t.Errorf("no WARN of postgresql holding delivery for the lost connection")
		}
		if r := gathered(reg, "walrelay_stream_restarts_total")["connection"]; r < 1 {
			t.Errorf("restarts for a lost connection: %v, want at least 1", r)
		}
	}
}
