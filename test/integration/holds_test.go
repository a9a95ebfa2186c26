package integration

// What holds delivery, as every signal reports it (package holds): the
// dependency made to refuse or to hang, then readiness, /status as
// `walrelay status` reads it, walrelay_delivery_held and the log are read
// for its name and its cause.

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/holds"
)

// holdSignals reads what holds delivery in one relay through each signal.
type holdSignals struct {
	e    *env
	rr   *running
	reg  *prometheus.Registry
	logs *observer.ObservedLogs
}

// watchHolds observes the log of relays started afterwards; attach the
// relay with (*holdSignals).of.
func (e *env) watchHolds() *holdSignals { return &holdSignals{e: e, logs: e.observeLogs()} }

func (h *holdSignals) of(rr *running, reg *prometheus.Registry) *holdSignals {
	h.rr, h.reg = rr, reg
	return h
}

// held waits until dep holds delivery for reason by every signal:
// readiness names it (and not the lag it causes), Status lists it, the
// gauge is 1 for it, and the log has one WARN saying so. It returns the
// hold.
func (h *holdSignals) held(dep holds.Dependency, reason string, timeout time.Duration) holds.Hold {
	h.e.t.Helper()
	var hold holds.Hold
	h.e.waitFor(fmt.Sprintf("%s holding delivery (%s)", dep, reason), timeout, func() (bool, error) {
		for _, x := range h.rr.relay.Status().Holds {
			if x.Dependency == dep && x.Reason == reason {
				hold = x
				return true, nil
			}
		}
		return false, fmt.Errorf("holds %+v; ready: %v", h.rr.relay.Status().Holds, h.rr.relay.Ready())
	})
	err := h.rr.relay.Ready()
	if err == nil || !strings.HasPrefix(err.Error(), "delivery held by ") || !strings.Contains(err.Error(), string(dep)+" ("+reason) {
		h.e.t.Errorf("readiness says %v: want it to name %s (%s) first", err, dep, reason)
	}
	if g := gathered(h.reg, "walrelay_delivery_held"); g[string(dep)+","+reason] != 1 {
		h.e.t.Errorf("walrelay_delivery_held %v: want %s,%s = 1", g, dep, reason)
	}
	if n := len(warnings(h.logs, "delivery held by "+string(dep), zap.String("reason", reason))); n != 1 {
		h.e.t.Errorf("%d WARNs that %s holds delivery (%s), want 1", n, dep, reason)
	}
	return hold
}

// released waits until dep no longer holds delivery, by the signals, and
// the log said so once per hold it had.
func (h *holdSignals) released(dep holds.Dependency, timeout time.Duration) {
	h.e.t.Helper()
	h.e.waitFor(fmt.Sprintf("%s no longer holding delivery", dep), timeout, func() (bool, error) {
		for _, x := range h.rr.relay.Status().Holds {
			if x.Dependency == dep {
				return false, fmt.Errorf("still held: %+v", x)
			}
		}
		return true, nil
	})
	if g := gathered(h.reg, "walrelay_delivery_held"); g != nil {
		for k, v := range g {
			if strings.HasPrefix(k, string(dep)+",") && v != 0 {
				h.e.t.Errorf("walrelay_delivery_held %s = %v after the hold ended", k, v)
			}
		}
	}
	// A hold whose reason changed is logged again, with the reason it
	// had: one hold, which ends once.
	starts := 0
	for _, w := range warnings(h.logs, "delivery held by "+string(dep)) {
		if _, changed := w.ContextMap()["previous_reason"]; !changed {
			starts++
		}
	}
	ends := len(warnings(h.logs, string(dep)+" no longer holds delivery"))
	if ends == 0 || ends != starts {
		h.e.t.Errorf("%d holds by %s started (WARNs without a previous reason) and %d WARNs that it no longer holds: want one end per start", starts, dep, ends)
	}
}

// TestHoldKafka: a broker that refuses connections, before the relay's
// start and then under it, and one that hangs (SIGSTOP on Apache Kafka):
// each holds delivery by the kafka dependency, named by every signal
// with its cause (Unreachable, NotAcknowledging), and the hold ends when
// the broker answers again; every event arrives.
func TestHoldKafka(t *testing.T) {
	e := newEnv(t)
	h := e.watchHolds()

	// Refused: a broker of the test's own, down at the relay's start.
	b := startKafkaAt(t)
	b.stop()
	suite := e.brokers
	e.brokers = []string{b.addr()} // the relay's config and the consumer use this broker
	cfg := e.config()
	cfg.BackoffMax = time.Second
	cfg.StartupTimeout = 0
	rr, reg := e.launchRelay(cfg)
	h.of(rr, reg).held(holds.Kafka, "Unreachable", time.Minute)
	b.start()
	e.waitFor("the relay streaming once the broker is up", time.Minute, func() (bool, error) { return rr.relay.Streaming(), nil })
	c := e.consume()
	first := e.insertRows(e.conn(), 5, "first")
	c.waitAll(first, time.Minute)
	h.released(holds.Kafka, time.Minute)

	// Refused under the relay: records wait, unanswered.
	b.stop()
	during := e.insertRows(e.conn(), 5, "during")
	h.held(holds.Kafka, "NotAcknowledging", time.Minute)
	b.start()
	c.waitAll(append(first, during...), 2*time.Minute)
	h.released(holds.Kafka, time.Minute)
	if err := rr.stop(t); err != nil {
		t.Fatal(err)
	}

	// Hung: the suite's broker frozen (SIGSTOP on Apache Kafka).
	e.brokers = suite
	h2 := e.watchHolds()
	rr2, reg2 := e.startRelayGathered(e.config())
	h2.of(rr2, reg2)
	c2 := e.consume()
	thaw := e.freezeKafka()
	frozen := e.insertRows(e.conn(), 5, "frozen")
	h2.held(holds.Kafka, "NotAcknowledging", time.Minute)
	thaw()
	c2.waitAll(frozen, 2*time.Minute)
	h2.released(holds.Kafka, time.Minute)
}

// TestHoldPostgreSQL: PostgreSQL that refuses connections, then one that
// hangs (a network partition, as SIGSTOP looks from the relay): each holds
// delivery by the postgresql dependency, named by every signal with its
// cause (Unreachable, NotAnswering), not by the lag it causes; the hold
// ends once a stream runs again, and every event arrives.
func TestHoldPostgreSQL(t *testing.T) {
	e := newEnv(t)
	h := e.watchHolds()
	cfg, p := e.configThroughProxy()
	cfg.BackoffMax = time.Second
	cfg.ReceiveTimeout = 3 * time.Second
	rr, reg := e.startRelayGathered(cfg)
	h.of(rr, reg)
	c := e.consume()
	before := e.insertRows(e.conn(), 3, "before")
	c.waitAll(before, time.Minute)

	p.refuse(true)
	refused := e.insertRows(e.conn(), 3, "refused")
	h.held(holds.PostgreSQL, "Unreachable", time.Minute)
	p.refuse(false)
	c.waitAll(refused, time.Minute)
	h.released(holds.PostgreSQL, time.Minute)

	p.hang(true)
	hung := e.insertRows(e.conn(), 3, "hung")
	h.held(holds.PostgreSQL, "NotAnswering", time.Minute)
	p.hang(false)
	c.waitAll(hung, time.Minute)
	h.released(holds.PostgreSQL, time.Minute)
}

// TestHoldPublicationWatch: a transaction that changes the publication and
// stays open keeps the publication watch from vouching, so nothing is
// confirmed past it: publication_watch holds delivery (ChangeInProgress)
// until it ends.
func TestHoldPublicationWatch(t *testing.T) {
	e := newEnv(t)
	h := e.watchHolds()
	rr, reg := e.startRelayGathered(e.config())
	h.of(rr, reg)
	c := e.consume()
	c.waitAll(e.insertRows(e.conn(), 2, "before"), time.Minute)

	ddl := e.conn()
	tx, err := ddl.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(e.ctx, e.pubSQL(`ALTER PUBLICATION %[1]s SET (publish = 'insert')`)); err != nil {
		t.Fatal(err)
	}
	during := e.insertRows(e.conn(), 3, "during")
	c.waitAll(during, time.Minute) // published; not confirmed
	h.held(holds.PublicationWatch, "ChangeInProgress", time.Minute)
	if err := tx.Rollback(e.ctx); err != nil {
		t.Fatal(err)
	}
	h.released(holds.PublicationWatch, time.Minute)
}
