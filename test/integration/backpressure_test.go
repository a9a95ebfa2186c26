package integration

import (
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/relay"
)

// TestBackpressureKeepsReplicationConnection fills the relay's in-flight
// window while Kafka answers nothing (a frozen broker), so that the relay
// stops reading the replication stream and the walsender blocks writing
// to it, with a wal_sender_timeout of 3 s and the default status interval
// (10 s): the walsender must keep hearing the relay (its reply_time moves
// on) and must not end the connection for a replication timeout, however
// long Kafka stays out. A connection cut meanwhile is noticed while Kafka
// is still out (the stream ends, a WARN), not when it comes back.
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
