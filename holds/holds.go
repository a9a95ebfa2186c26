// Package holds is the one place that knows what holds delivery. Each
// part of the relay that depends on something outside it reports into a
// Board, through a Condition of its own, when that dependency holds
// delivery and why, and clears the report when it no longer does:
//
//   - kafka: the brokers unreachable, refusing records or acknowledging
//     nothing while events wait (the relay's Kafka watch);
//   - kafka_authorization: Kafka's authorizer denying an operation (the
//     router);
//   - token_source: no valid OAUTHBEARER token to authenticate to Kafka
//     with (kafkaauth);
//   - schema_registry: a subject's schema that cannot be read while its
//     events wait (schema);
//   - postgresql: the replication connection failing or silent (the
//     supervisor);
//   - standby_replay: replay paused or behind on the hot standby the
//     relay decodes on (the slot poller);
//   - publication_watch: the publication cannot be checked, so nothing is
//     confirmed (the guard).
//
// Every signal reads the board instead of deciding for itself from what
// it happens to see (the lag a hold causes, a connection that is not
// streaming): readiness (/readyz and walrelay_ready), the relay's /status
// and `walrelay status`, the metric walrelay_delivery_held with the
// dependency and the reason as labels (the shipped alerts read it), and
// the log, which gets one WARN when a hold starts and one when it ends,
// both at WARN so that a filter on WARN sees the pair.
//
// The model is Kubernetes' conditions: a hold has a type (its
// Dependency), a reason (one CamelCase word a program may match), a
// message (one line for people, naming the cause and the fix) and the
// time since it holds. A reporter that holds again for the same reason
// only updates the message: the hold keeps its start, and nothing is
// logged. A reason that changes is a new hold.
package holds

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/metrics"
)

// Dependency is what can hold delivery: the dependency label of
// walrelay_delivery_held.
type Dependency string

// The dependencies that can hold delivery.
const (
	Kafka              Dependency = "kafka"
	KafkaAuthorization Dependency = "kafka_authorization"
	TokenSource        Dependency = "token_source"
	SchemaRegistry     Dependency = "schema_registry"
	PostgreSQL         Dependency = "postgresql"
	StandbyReplay      Dependency = "standby_replay"
	PublicationWatch   Dependency = "publication_watch"
)

// Dependencies lists every Dependency (a new slice each call), in the
// order a pipeline meets them, source first.
func Dependencies() []Dependency {
	return []Dependency{PostgreSQL, StandbyReplay, PublicationWatch, SchemaRegistry, TokenSource, Kafka, KafkaAuthorization}
}

// Hold is a dependency holding delivery, as a Condition reported it.
type Hold struct {
	Dependency Dependency `json:"dependency"`
	// Reason is one CamelCase word (Unreachable, NotAnswering, Paused…).
	Reason string `json:"reason"`
	// Message is one line naming the cause and the fix.
	Message string `json:"message"`
	// Since is when the hold started (its reason last changed).
	Since time.Time `json:"since"`
}

// String is the hold as readiness and the log say it.
func (h Hold) String() string {
	return fmt.Sprintf("%s (%s): %s", h.Dependency, h.Reason, h.Message)
}

// Board collects the holds its conditions report. Its methods are safe
// for concurrent use; a nil *Board holds nothing, and its conditions
// report nowhere.
type Board struct {
	log  *zap.Logger
	held *prometheus.GaugeVec
	now  func() time.Time

	mu    sync.Mutex
	conds []*Condition
}

// New returns a board that logs to log and exports
// walrelay_delivery_held on m (0 for every dependency until one holds).
func New(log *zap.Logger, m *metrics.Metrics) *Board {
	b := &Board{log: log, held: m.DeliveryHeld, now: time.Now}
	for _, d := range Dependencies() {
		b.held.WithLabelValues(string(d), "").Set(0)
	}
	return b
}

// Condition returns a new condition reporting on d. Each part that can
// see d hold delivery takes its own: two parts can hold the same
// dependency for different reasons, and one clearing its report does not
// clear the other's.
func (b *Board) Condition(d Dependency) *Condition {
	if b == nil {
		return nil
	}
	c := &Condition{board: b, dep: d}
	b.mu.Lock()
	b.conds = append(b.conds, c)
	b.mu.Unlock()
	return c
}

// Holds returns the holds in force, oldest first.
func (b *Board) Holds() []Hold {
	if b == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	var hs []Hold
	for _, c := range b.conds {
		if c.held.Load() {
			hs = append(hs, c.hold)
		}
	}
	sort.SliceStable(hs, func(i, j int) bool { return hs[i].Since.Before(hs[j].Since) })
	return hs
}

// Err is nil when nothing holds delivery, else a *HeldError naming every
// hold: what readiness reports.
func (b *Board) Err() error {
	hs := b.Holds()
	if len(hs) == 0 {
		return nil
	}
	return &HeldError{Holds: hs, now: b.now()}
}

// HeldError is delivery held by one dependency or more.
type HeldError struct {
	Holds []Hold
	now   time.Time
}

func (e *HeldError) Error() string {
	parts := make([]string, len(e.Holds))
	for i, h := range e.Holds {
		parts[i] = fmt.Sprintf("%s (%s for %s): %s", h.Dependency, h.Reason, e.now.Sub(h.Since).Round(time.Second), h.Message)
	}
	return "delivery held by " + strings.Join(parts, "; and by ")
}

// Condition is one part's report on one dependency. Its methods are safe
// for concurrent use, and do nothing on a nil *Condition (a part used
// without a board).
type Condition struct {
	board *Board
	dep   Dependency
	held  atomic.Bool // read without the lock by Clear's fast path
	hold  Hold        // under board.mu
}

// Hold reports that the dependency holds delivery for reason, as message
// says. A new hold, or a new reason, is logged at WARN and exported; the
// same reason again only updates the message.
func (c *Condition) Hold(reason, message string) {
	if c == nil {
		return
	}
	b := c.board
	b.mu.Lock()
	defer b.mu.Unlock()
	prev := c.hold
	c.hold.Message = message
	if c.held.Load() && prev.Reason == reason {
		return
	}
	c.hold = Hold{Dependency: c.dep, Reason: reason, Message: message, Since: b.now()}
	c.held.Store(true)
	b.export(c.dep)
	fields := []zap.Field{zap.String("dependency", string(c.dep)), zap.String("reason", reason)}
	if prev.Reason != "" {
		fields = append(fields, zap.String("previous_reason", prev.Reason))
	}
	b.log.Warn("delivery held by "+string(c.dep)+": "+message, fields...)
}

// Clear reports that the dependency no longer holds delivery, as far as
// this condition knows: one WARN says so, with how long it held.
func (c *Condition) Clear() {
	if c == nil || !c.held.Load() {
		return
	}
	b := c.board
	b.mu.Lock()
	defer b.mu.Unlock()
	if !c.held.Load() {
		return
	}
	c.held.Store(false)
	h := c.hold
	c.hold = Hold{}
	b.export(c.dep)
	b.log.Warn(string(c.dep)+" no longer holds delivery", zap.String("dependency", string(c.dep)),
		zap.String("reason", h.Reason), zap.Duration("held_for", b.now().Sub(h.Since).Round(time.Millisecond)))
}

// HoldAfter holds for reason with message once d has passed, unless the
// returned stop is called first: for a call that hangs rather than
// fails, so that it is named while it hangs, not only at its timeout.
// stop does not clear a hold already made.
func (c *Condition) HoldAfter(d time.Duration, reason, message string) (stop func()) {
	if c == nil {
		return func() {}
	}
	var mu sync.Mutex
	stopped := false
	t := time.AfterFunc(d, func() {
		mu.Lock()
		defer mu.Unlock()
		if !stopped {
			c.Hold(reason, message)
		}
	})
	// Once stop returns no hold comes, even from a timer that fired as
	// it was called: a Clear right after it is final.
	return func() {
		mu.Lock()
		stopped = true
		mu.Unlock()
		t.Stop()
	}
}

// Held reports whether this condition holds delivery now.
func (c *Condition) Held() bool { return c != nil && c.held.Load() }

// export sets d's series of walrelay_delivery_held from its conditions:
// 1 for each reason held, or 0 with an empty reason when none; b.mu is
// held.
func (b *Board) export(d Dependency) {
	b.held.DeletePartialMatch(prometheus.Labels{"dependency": string(d)})
	any := false
	for _, c := range b.conds {
		if c.dep == d && c.held.Load() {
			b.held.WithLabelValues(string(d), c.hold.Reason).Set(1)
			any = true
		}
	}
	if !any {
		b.held.WithLabelValues(string(d), "").Set(0)
	}
}

// Status is what a relay reports of itself on its /status endpoint, and
// what `walrelay status` reads there: ready or why not, and what holds
// delivery.
type Status struct {
	Ready bool `json:"ready"`
	// NotReady is readiness's answer when not ready: the holds first,
	// else what else keeps the relay from being ready.
	NotReady  string `json:"not_ready,omitempty"`
	Streaming bool   `json:"streaming"`
	// ReplicationLagSeconds is how far behind PostgreSQL what Kafka has
	// lies (relay.Relay.ReplicationLag).
	ReplicationLagSeconds float64 `json:"replication_lag_seconds"`
	// ConfirmedLSN is the position last confirmed to PostgreSQL by the
	// process ("0/0" before its first).
	ConfirmedLSN string `json:"confirmed_lsn"`
	Holds        []Hold `json:"holds"`
}

// StatusHandler serves status() as JSON: the relay's /status, which
// `walrelay status --relay-url` reads.
func StatusHandler(status func() Status) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(status()) // a client gone mid-answer is its loss
	})
}
