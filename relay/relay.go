// Package relay wires walrelay's pipeline together and keeps it running:
//
//	slot (replication stream) → decoder → router (Kafka) → acks → checkpoint → slot (standby status)
//
// Run prepares the source database, then runs sessions: one replication
// stream each, from the last confirmed position. A session ends when the
// connection breaks, Kafka refuses a record for good, or Run's context ends;
// the next one starts after a capped, jittered backoff. Nothing carries over
// between sessions but the confirmed position, so every restart is the same
// simple, safe path: duplicates after it, never loss.
//
// A session (session.go, opened in start.go) reads the stream, decodes it
// and hands each PostgreSQL transaction to a delivery (delivery.go): Begin,
// Event per outbox insert, Commit, Tick between messages, Close at the end.
// The delivery decides when a transaction counts as acknowledged, which is
// all the session's checkpoint needs to know. atLeastOnce acks a
// transaction once Kafka has each of its records; exactlyOnce
// (exactlyonce.go) produces in Kafka transactions, each closed by a
// checkpoint record, acks at their commit, and after a restart skips what
// the newest checkpoint covers. The session never asks which one it has,
// and unit tests drive it with a fake stream and a fake producer.
//
// The pipeline lives here rather than in cmd/walrelay so that integration
// tests, `walrelay dev` and the benchmark run the very code the daemon runs.
//
// DefaultConfig is the one definition of walrelay's defaults: the flags of
// `walrelay run` and `walrelay dev` take theirs from it, so an embedder
// that starts from it runs with the daemon's configuration. It is a
// function rather than "zero means the default" because several defaults
// are on (the initial snapshot, creating the slot and the publication,
// creating topics) and several zeros mean something (no heartbeat, no
// readiness lag check, commit at once): with zero as the default each of
// those would need an inverted field or a negative stand-in, and a zero
// would mean two things. So a field holds what it means, and New refuses a
// zero where only a positive value works, naming the field and its
// default.
package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/confirm"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// Relay runs the pipeline. Create it with New, then call Run once. It is
// the wiring of parts that each own their state (their files say what):
//
//   - sup (supervisor.go): retries, the backoff, the startup timeout;
//   - guard (guard.go): what the slot streams from, the publication
//     watch, refusals, where a stream starts, failovers, fencing;
//   - the session (session.go, opened in start.go): one stream, read,
//     decoded and delivered (delivery.go, exactlyonce.go);
//   - progress and a confirmer per session (package confirm): the one
//     position confirmed to PostgreSQL;
//   - live (live.go): what the relay does now;
//   - commits (exactlyonce.go): what this process knows of its Kafka
//     commits;
//   - tables (session.go): the inserts of tables no outbox maps;
//   - the slot poller (slotpoll.go) and the heartbeat (beat.go), in the
//     background.
type Relay struct {
	cfg     Config
	log     *zap.Logger
	metrics *metrics.Metrics

	sup      *supervisor
	guard    *guard
	live     *live
	progress *confirm.Progress
	commits  *commitMemory
	tables   *tableCounts
	kafka    *kafkaWatch
	// identify runs IDENTIFY_SYSTEM on a connection of its own
	// (slot.IdentifySystem on PGURL; tests replace it).
	identify func(context.Context) (pglogrepl.IdentifySystemResult, error)
}

// New checks cfg (start from DefaultConfig) and returns a Relay.
func New(cfg Config, log *zap.Logger, m *metrics.Metrics) (*Relay, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if cfg.Holds == nil {
		cfg.Holds = holds.New(log, m)
	}
	if cfg.Router.Denials == nil {
		cfg.Router.Denials = cfg.Holds.Condition(holds.KafkaAuthorization)
	}
	if err := slot.ValidSlotName(cfg.Slot); err != nil {
		return nil, err
	}
	if cfg.Publication == "" {
		return nil, errors.New("relay.Config.Publication is empty: name the publication the slot streams")
	}
	if len(cfg.Tables) == 0 {
		return nil, errors.New("relay.Config.Tables is empty: name at least one outbox table")
	}
	if m := cfg.Read.MaxMessageBytes; m > 0 && m <= cfg.Router.MaxRecordBytes {
		return nil, fmt.Errorf("relay.Config.Read.MaxMessageBytes %d must exceed relay.Config.Router.MaxRecordBytes %d: a row carrying a record of the largest size must fit in one message", m, cfg.Router.MaxRecordBytes)
	}
	if _, err := decoder.New(decoder.Config{Tables: cfg.Tables, Mapping: cfg.Mapping, Binary: cfg.Binary}); err != nil {
		return nil, err
	}
	if err := cfg.Router.Validate(); err != nil {
		return nil, err
	}
	if err := withValues(&cfg, log, m); err != nil {
		return nil, err
	}
	if cfg.ExactlyOnce && 2*cfg.TxnMaxInterval > cfg.Router.TransactionTimeout {
		// A transaction is committed TxnMaxInterval after it began at the
		// earliest; past the timeout the broker has aborted it, and every
		// quiet transaction would be retried forever.
		return nil, fmt.Errorf("exactly-once: the commit interval (relay.Config.TxnMaxInterval %s) must be at most half the Kafka transaction timeout (relay.Config.Router.TransactionTimeout %s)",
			cfg.TxnMaxInterval, cfg.Router.TransactionTimeout)
	}
	if cfg.StatusInterval < cfg.ConfirmDelay {
		return nil, fmt.Errorf("relay.Config.StatusInterval %s is shorter than the confirm delay, relay.Config.ConfirmDelay %s: raise it, or lower the delay", cfg.StatusInterval, cfg.ConfirmDelay)
	}
	for _, kind := range heartbeat.Kinds() {
		m.Heartbeats.WithLabelValues(string(kind))
	}
	for _, cause := range RestartCauses() {
		m.StreamRestarts.WithLabelValues(string(cause))
	}
	progress := &confirm.Progress{}
	lv := &live{metrics: m}
	r := &Relay{
		cfg: cfg, log: log, metrics: m,
		sup:      newSupervisor(cfg, log, m, progress),
		live:     lv,
		progress: progress,
		commits:  &commitMemory{log: log, metrics: m},
		tables:   &tableCounts{cfg: cfg, log: log, metrics: m},
		kafka:    &kafkaWatch{cond: cfg.Holds.Condition(holds.Kafka)},
	}
	r.identify = func(ctx context.Context) (pglogrepl.IdentifySystemResult, error) {
		return slot.IdentifySystem(ctx, cfg.PGURL)
	}
	r.guard = &guard{cfg: cfg, log: log, metrics: m, live: lv, progress: progress, clearance: confirm.NewClearance(),
		watchHold: cfg.Holds.Condition(holds.PublicationWatch), firstStream: make(chan struct{})}
	r.guard.slotHolder = r.guard.holdsSlot
	r.guard.coverage = r.guard.readCoverage
	m.SetReadiness(r.Ready)
	return r, nil
}

// Confirmed returns the position last confirmed to PostgreSQL by this
// process (0 before the first status update).
func (r *Relay) Confirmed() decoder.LSN { return r.progress.Confirmed() }

// Streaming reports whether a replication stream is open.
func (r *Relay) Streaming() bool { return r.live.streaming.Load() }

// ReplicationLag is, while any transaction is in flight, now minus the
// commit time of the newest confirmable transaction (of the oldest one in
// flight when none is confirmable yet); 0 when nothing is in flight. It is
// how far behind PostgreSQL what Kafka has lies, as housekeep computes it.
func (r *Relay) ReplicationLag() time.Duration { return time.Duration(r.live.lag.Load()) }

// Holds is the board the relay's parts report what holds delivery into
// (Config.Holds, or the one New made).
func (r *Relay) Holds() *holds.Board { return r.cfg.Holds }

// Ready returns nil when nothing holds delivery (package holds: Kafka,
// its authorizer, the token source, the schema registry, PostgreSQL, the
// standby's replay, the publication watch), the relay is streaming, and
// its replication lag is under ReadyMaxLag, else why not: the holds
// first, which name the dependency and its cause, rather than the lag
// they cause.
func (r *Relay) Ready() error {
	if err := r.cfg.Holds.Err(); err != nil {
		return err
	}
	if !r.Streaming() {
		return errors.New(r.sup.notStreaming())
	}
	if lag := r.ReplicationLag(); r.cfg.ReadyMaxLag > 0 && lag > r.cfg.ReadyMaxLag {
		return fmt.Errorf("replication lag %s exceeds %s", lag.Round(time.Millisecond), r.cfg.ReadyMaxLag)
	}
	return nil
}

// poller is the slot poller of this relay's parts.
func (r *Relay) poller() *slotPoller {
	return &slotPoller{cfg: r.cfg, log: r.log, metrics: r.metrics, guard: r.guard, live: r.live, sup: r.sup, progress: r.progress,
		replay: r.cfg.Holds.Condition(holds.StandbyReplay)}
}

// Run prepares the database and relays until ctx ends, then waits (at most
// ShutdownTimeout) for outstanding acks, confirms them and returns nil.
// It returns an error only for what retrying cannot fix: a setup refusal,
// an invalidated or vanished slot, an invalid event with on-invalid=fail
// (such as a row written while its table lacked a mapped column).
func (r *Relay) Run(parent context.Context) error {
	r.sup.started()
	rt, err := r.prepare(parent)
	if err != nil {
		if parent.Err() != nil {
			return nil
		}
		return err
	}
	r.live.useRouter(rt)
	// Background work that may stop the relay (an invalidated slot)
	// cancels ctx with a cause; the parent's cancellation is a clean stop.
	ctx, stop := context.WithCancelCause(parent)
	var bg sync.WaitGroup
	// Deferred calls run last first: stop the background work, then wait
	// for it.
	defer bg.Wait()
	defer stop(nil)
	bg.Go(func() { r.poller().watchSlot(ctx, stop) })
	bg.Go(func() { r.guard.watchPublication(ctx, stop) })
	bg.Go(func() { r.guard.recordStreamed(ctx) })
	hb := &heartbeatProducer{opts: r.cfg.KafkaOptions}
	defer hb.close() // after the heartbeat stopped (deferred calls run last first)
	bg.Go(func() { r.beater(hb).Run(ctx) })
	// stopped is Run's result once it stops: err when retrying gave up
	// for good, else the cause background work stopped the relay with,
	// else nil (a clean stop).
	stopped := func(err error) error {
		if isFatal(err) {
			return err
		}
		if cause := context.Cause(ctx); parent.Err() == nil && cause != nil && !errors.Is(cause, context.Canceled) {
			return cause
		}
		return nil
	}

	defer func() {
		if rt != nil {
			r.live.useRouter(nil)
			rt.Close()
		}
	}()
	for {
		if rt == nil {
			var err error
			if rt, err = r.newRouter(ctx); err != nil {
				if ctx.Err() != nil {
					return stopped(nil)
				}
				if isFatal(err) {
					return err
				}
				r.kafka.failed(err)
				if err := r.sup.retry(ctx, kafkaCause(err), err); err != nil {
					return stopped(err)
				}
				continue
			}
			r.live.useRouter(rt)
		}
		err := r.session(ctx, rt)
		if rt.Failed() || rt.Txn() != nil && rt.Txn().TookID() {
			// A producer that lost a record is not reused: its
			// idempotence state and buffered records are suspect. Nor
			// is one that took the transactional id: another relay may
			// have taken it since, and the next session must take it
			// afresh, after the slot (initTransactions).
			r.live.useRouter(nil)
			rt.Close()
			rt = nil
		}
		if ctx.Err() != nil {
			return stopped(nil)
		}
		if isFatal(err) {
			return err
		}
		cause := causeOf(err)
		if cause == CauseKafka {
			r.kafka.failed(err)
		}
		if err := r.sup.retry(ctx, cause, err); err != nil {
			return stopped(err)
		}
	}
}

// prepare connects to Kafka, then runs the setup checks and creates what
// is missing (with the initial snapshot, published through the router it
// returns), retrying what may be transient. Kafka comes first: a slot
// created by a start that then fails on Kafka would hold WAL for nothing.
func (r *Relay) prepare(ctx context.Context) (*router.Router, error) {
	var rt *router.Router
	fail := func(err error) (*router.Router, error) {
		if rt != nil {
			rt.Close()
		}
		return nil, err
	}
	for {
		if rt == nil {
			var err error
			if rt, err = r.newRouter(ctx); err != nil {
				rt = nil
				if ctx.Err() != nil || isFatal(err) {
					return fail(err)
				}
				r.kafka.failed(err)
				if err := r.sup.retry(ctx, kafkaCause(err), err); err != nil {
					return fail(err)
				}
				continue
			}
		}
		setup := r.setupConfig()
		if r.cfg.InitialSnapshot {
			setup.Snapshot = r.initialSnapshot(rt)
		}
		rec, err := source.Prepare(ctx, setup, r.log)
		if err == nil {
			r.sup.backoff.Reset()
			r.guard.prepared(ctx, rec)
			return rt, nil
		}
		cause := CauseSetup
		if rt.Failed() {
			// Kafka refused a snapshot record: a new producer for the
			// next attempt.
			cause = CauseKafka
			rt.Close()
			rt = nil
		}
		if slot.IsSetupError(err) || isFatal(err) || ctx.Err() != nil {
			return fail(err)
		}
		if certificateError(err) {
			// Retrying cannot make an untrusted certificate trusted.
			return fail(&fatalError{fmt.Errorf("postgresql: %w", err)})
		}
		if pgAuthError(err) {
			return fail(&fatalError{fmt.Errorf("postgresql refused the credentials (check the user and password of relay.Config.PGURL, PGPASSWORD or the passfile, and pg_hba.conf): %w", err)})
		}
		err = r.primaryAtStart(ctx, err)
		if err := r.sup.retry(ctx, cause, err); err != nil {
			return fail(err)
		}
	}
}

// setupConfig is what the source database must provide for this start:
// the configuration's, with the startup deadline that bounds a slot
// creation waiting for transactions.
func (r *Relay) setupConfig() source.SetupConfig {
	c := r.cfg.setupConfig()
	c.CreateDeadline = r.sup.startupDeadline()
	c.OnCreateWait = func(waited time.Duration) { r.metrics.SlotCreationWait.Set(waited.Seconds()) }
	return c
}

// newRouter is the relay's router, started (startRouter) with the
// heartbeat topic among its extra topics. With exactly-once delivery the
// transactional id is taken only once the slot is held
// (initTransactions): a standby fences nobody.
func (r *Relay) newRouter(ctx context.Context) (*router.Router, error) {
	var extra []string
	if r.cfg.HeartbeatTopic != "" && r.cfg.HeartbeatInterval > 0 {
		extra = append(extra, r.cfg.HeartbeatTopic)
	}
	return startRouter(ctx, r.cfg, r.log, r.metrics, r.onProduceError, extra...)
}

// startRouter makes a router for cfg and readies it: a broker reached
// first (unreachable brokers, a wrong SASL password or an untrusted
// certificate say so, rather than time out creating topics; what retrying
// cannot fix is a *fatalError), then the dead-letter topic and the extra
// topics prepared (Router.Start). fatal is the router's fatal handler.
func startRouter(ctx context.Context, cfg Config, log *zap.Logger, m *metrics.Metrics, fatal func(error), extra ...string) (*router.Router, error) {
	rt, err := router.New(cfg.Router, cfg.KafkaOptions, log, m, fatal)
	if err != nil {
		return nil, &fatalError{err}
	}
	pingCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
	err = rt.Ping(pingCtx)
	cancel()
	if err != nil {
		rt.Close()
		if kafkaConfigError(err) {
			return nil, err // a *router.ConfigError: fatal
		}
		return nil, fmt.Errorf("%w: %w", errKafkaUnreachable, err)
	}
	if err := rt.Start(ctx, extra...); err != nil {
		rt.Close()
		return nil, err
	}
	return rt, nil
}

// onProduceError is the router's fatal handler: it ends the current
// session, whose successor starts from the last confirmed position.
func (r *Relay) onProduceError(err error) { r.live.endSession(&produceError{err}) }
