package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/snapshot"
)

// initialSnapshot is source.SetupConfig.Snapshot for the relay: it publishes
// the rows present at the new slot's consistent point through rt, the
// relay's router, and returns once Kafka acknowledged all of them (with
// exactly-once delivery: once their Kafka transactions committed). Until
// then walrelay's record marks the slot as waiting for its snapshot, so a
// relay that dies during the snapshot drops that slot at its next start
// and snapshots again: duplicates, never loss.
func (r *Relay) initialSnapshot(rt *router.Router) func(ctx context.Context, name string, at decoder.LSN) error {
	return func(ctx context.Context, name string, at decoder.LSN) error {
		s := newSnapshotSender(ctx, rt, at, r.metrics)
		if r.cfg.ExactlyOnce {
			// This relay is creating the slot: the transactional id is
			// its to take (fencing any older holder) before the
			// snapshot's Kafka transactions, which the same exactly-once
			// delivery as the stream's commits, each with a checkpoint at
			// the slot's consistent point.
			if err := r.initTransactions(ctx, rt); err != nil {
				return err
			}
			sys, err := r.identify(ctx)
			if err != nil {
				return err
			}
			s = r.newExactlyOnceSnapshot(ctx, rt, rt.Txn(), at, sys)
		}
		r.log.Info("initial snapshot: publishing the rows present when the slot was created",
			zap.String("slot", r.cfg.Slot), zap.Stringer("consistent_point", at), zap.String("where", r.cfg.SnapshotWhere),
			zap.String("order", r.cfg.SnapshotOrder))
		res, err := runSnapshot(ctx, r.cfg, name, s, r.log, r.metrics)
		if err != nil {
			s.d.Close(false) // aborts an open Kafka transaction; a failure marks the router for replacement
			r.log.Warn("initial snapshot failed; the next attempt drops the slot created for it and snapshots again",
				zap.Int64("rows_sent", res.Rows), zap.Error(err))
			if res.Rows > 0 {
				// PostgreSQL and Kafka both answered: the startup timeout
				// (for what cannot be reached) counts from here, not from
				// before a snapshot that may have run for an hour.
				r.sup.started()
			}
			if errors.Is(err, snapshot.ErrQuery) {
				return &fatalError{err}
			}
			return err
		}
		r.log.Info("initial snapshot published", zap.Int64("rows", res.Rows), zap.Any("rows_by_table", byTable(r.cfg.Tables, res.Tables)),
			zap.Time("record_timestamp", res.Time), zap.Duration("took", time.Since(s.began)))
		return nil
	}
}

// PublishSnapshot publishes the current rows of cfg.Tables (those meeting
// cfg.SnapshotWhere, in cfg.SnapshotOrder) once, with the records, topics
// and Kafka settings the relay would use, and returns how many rows it
// sent. It is `walrelay snapshot`: at-least-once and outside any slot, so
// a row may also arrive through the stream, and a failure part-way leaves
// the rows already sent in Kafka. It never uses Kafka transactions: the
// transactional id belongs to the running relay.
func PublishSnapshot(ctx context.Context, cfg Config, log *zap.Logger, m *metrics.Metrics) (int64, error) {
	cfg.ExactlyOnce = false
	cfg.setDefaults()
	if err := withValues(&cfg, log, m); err != nil {
		return 0, err
	}
	rt, err := startRouter(ctx, cfg, log, m, func(error) {})
	if err != nil {
		return 0, err
	}
	defer rt.Close()
	conn, err := slot.Connect(ctx, cfg.PGURL)
	if err != nil {
		return 0, err
	}
	var at decoder.LSN
	// A standby (snapshot run on the one a relay decodes on) has no WAL
	// position of its own: what it replayed is what its rows show.
	err = conn.QueryRow(ctx, "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END").Scan(&at)
	conn.Close(context.Background())
	if err != nil {
		return 0, fmt.Errorf("read the current WAL position: %w", err)
	}
	s := newSnapshotSender(ctx, rt, at, m)
	log.Info("snapshot: publishing the current rows", zap.Any("tables", cfg.Tables), zap.String("where", cfg.SnapshotWhere), zap.String("order", cfg.SnapshotOrder))
	res, err := runSnapshot(ctx, cfg, "", s, log, m)
	if err != nil {
		return res.Rows, err
	}
	log.Info("snapshot published", zap.Int64("rows", res.Rows), zap.Any("rows_by_table", byTable(cfg.Tables, res.Tables)),
		zap.Time("record_timestamp", res.Time), zap.Duration("took", time.Since(s.began)))
	return res.Rows, nil
}

// runSnapshot reads the snapshot on a connection of its own, sends every
// row through s and waits until Kafka has acknowledged all of them.
func runSnapshot(ctx context.Context, cfg Config, name string, s *snapshotSender, log *zap.Logger, m *metrics.Metrics) (snapshot.Result, error) {
	s.began = time.Now()
	m.SnapshotRunning.Set(1)
	defer m.SnapshotRunning.Set(0)
	conn, err := slot.Connect(ctx, cfg.PGURL)
	if err != nil {
		return snapshot.Result{}, err
	}
	defer conn.Close(context.Background())
	res, err := snapshot.Read(ctx, conn, name, snapshot.Config{
		Tables: cfg.Tables, Mapping: cfg.Mapping, Where: cfg.SnapshotWhere, Order: cfg.SnapshotOrder,
	}, s, log)
	if err != nil {
		return res, err
	}
	return res, s.finish(ctx)
}

// byTable pairs table names with their row counts, for the log.
func byTable(tables []decoder.Table, rows []int64) map[string]int64 {
	out := make(map[string]int64, len(tables))
	for i, t := range tables {
		if i < len(rows) {
			out[t.String()] = rows[i]
		}
	}
	return out
}

// snapshotSender is snapshot.Sender through a delivery, the one the
// stream uses: the same Send as streamed rows (topics, dead letters, the
// in-flight gate) and, with exactly-once delivery, the same Kafka
// transactions and checkpoints. The snapshot is one PostgreSQL
// transaction committing at the slot's consistent point, every record
// counted by one acker.
type snapshotSender struct {
	ctx     context.Context
	d       delivery
	rt      snapshotRouter
	lsn     decoder.LSN // the slot's consistent point; named in dead letters
	m       *metrics.Metrics
	acks    checkpoint.Counter
	began   time.Time
	started bool
}

// snapshotRouter is what a snapshot uses of *router.Router beyond its
// delivery: whether Kafka refused a record for good.
type snapshotRouter interface {
	sender
	Failed() bool
	Err() error
}

// newSnapshotSender sends through rt at-least-once; the relay's initial
// snapshot replaces the delivery for exactly-once.
func newSnapshotSender(ctx context.Context, rt snapshotRouter, at decoder.LSN, m *metrics.Metrics) *snapshotSender {
	s := &snapshotSender{ctx: ctx, rt: rt, lsn: at, m: m}
	s.d = newAtLeastOnce(rt, s.wait)
	return s
}

// newExactlyOnceSnapshot sends through rt in Kafka transactions of txn,
// each closed by a checkpoint at the consistent point at (on the system
// and timeline of sys): the stream starts there, so once the snapshot's
// last transaction committed, everything before it is in Kafka. Being
// fenced is fatal: no slot exists yet to tell a standby apart.
func (r *Relay) newExactlyOnceSnapshot(ctx context.Context, rt snapshotRouter, txn kafkaTxn, at decoder.LSN, sys pglogrepl.IdentifySystemResult) *snapshotSender {
	s := newSnapshotSender(ctx, rt, at, r.metrics)
	kafkaCtx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(ctx, r.cfg.Router.TransactionTimeout)
	}
	eo := r.newExactlyOnce(rt, txn, resumePoint{ckpt: checkpoint.Durable{LSN: at}}, sys, s.wait, kafkaCtx)
	eo.failed = r.snapshotTxnError
	s.d = eo
	return s
}

// wait is the snapshot's waitFunc: there is no stream to answer while
// waiting. Interruptible, it also returns after a tick (the caller looks
// again: a refused record releases the gate too, and nothing else would
// wake it), when Kafka refused a record for good, or when ctx ends.
func (s *snapshotSender) wait(done <-chan struct{}, interruptible bool) error {
	if !interruptible {
		<-done
		return nil
	}
	if s.rt.Failed() {
		return s.produceFailed()
	}
	t := time.NewTimer(tick)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	case <-s.ctx.Done():
		return s.ctx.Err()
	}
	return nil
}

// produceFailed is the error of a router that Kafka refused a record of
// for good: the snapshot is abandoned and done again from the start.
func (s *snapshotSender) produceFailed() error {
	return fmt.Errorf("kafka refused a snapshot record: %w", s.rt.Err())
}

// Send hands ev to the delivery.
func (s *snapshotSender) Send(ctx context.Context, ev *decoder.Event) error {
	if !s.started {
		s.d.Begin(decoder.Begin{FinalLSN: s.lsn}, &s.acks)
		s.started = true
	}
	if s.rt.Failed() {
		return s.produceFailed()
	}
	if err := s.d.Event(ev, s.lsn); err != nil {
		return err
	}
	s.m.SnapshotRows.Inc()
	return s.d.Tick(time.Now(), false)
}

// snapshotTxnError is kafkaTxnError for the initial snapshot, which runs
// before the slot exists: no slot tells a standby apart, so being fenced
// then stops the relay (exit code 3).
func (r *Relay) snapshotTxnError(err error) error {
	if errors.Is(err, router.ErrFenced) {
		return &fatalError{fmt.Errorf("transactional id %q was taken by another producer during the initial snapshot for slot %q: another relay started with the same transactional id (relay.Config.Router.TransactionalID) before this one created the slot; start the others once one streams: %w",
			r.cfg.Router.TransactionalID, r.cfg.Slot, err)}
	}
	return kafkaTxnError(err)
}

// finish ends the snapshot's transaction at the consistent point (with
// exactly-once delivery: commits the last Kafka transaction, its
// checkpoint covering everything before the point) and waits until Kafka
// acknowledged every record sent.
func (s *snapshotSender) finish(ctx context.Context) error {
	if s.started {
		if err := s.d.Commit(s.lsn); err != nil {
			return err
		}
	}
	pending, err := s.d.Close(true)
	if err != nil {
		return err
	}
	// Flush returns once every record finished, after its promise (the
	// ack) ran.
	if err := pending.Flush(ctx); err != nil {
		return err
	}
	if s.rt.Failed() {
		return s.produceFailed()
	}
	if n := s.acks.Pending(); n != 0 {
		return fmt.Errorf("%d snapshot records were not acknowledged by Kafka; the snapshot is done again", n)
	}
	return nil
}
