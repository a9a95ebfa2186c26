package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/snapshot"
)

// initialSnapshot is slot.SetupConfig.Snapshot for the relay: it publishes
// the rows present at the new slot's consistent point through rt, the
// relay's router, and returns once Kafka acknowledged all of them (with
// exactly-once delivery: once their Kafka transactions committed). Only
// then does slot.Prepare make the slot permanent, so a relay that dies
// during the snapshot finds no slot on its next start and snapshots again:
// duplicates, never loss.
func (r *Relay) initialSnapshot(rt *router.Router) func(ctx context.Context, name string, at decoder.LSN) error {
	return func(ctx context.Context, name string, at decoder.LSN) error {
		s := &snapshotSender{rt: rt, lsn: at, m: r.metrics}
		if r.cfg.ExactlyOnce {
			// This relay is creating the slot: the transactional id is
			// its to take (fencing any older holder) before the
			// snapshot's Kafka transactions.
			if err := r.initTransactions(ctx, rt); err != nil {
				return err
			}
			s.eos = &snapshotEOS{r: r}
		}
		r.log.Info("initial snapshot: publishing the rows present when the slot was created",
			zap.String("slot", r.cfg.Slot), zap.Stringer("consistent_point", at), zap.String("where", r.cfg.SnapshotWhere),
			zap.String("order", r.cfg.SnapshotOrder))
		res, err := runSnapshot(ctx, r.cfg, name, s, r.log, r.metrics)
		if err != nil {
			if s.eos != nil && rt.KafkaTxnOpen() {
				abortCtx, cancel := context.WithTimeout(context.Background(), r.cfg.Router.TransactionTimeout)
				rt.AbortKafkaTxn(abortCtx) // a failure marks the router for replacement
				cancel()
			}
			r.log.Warn("initial snapshot failed; the slot is not created, the next attempt snapshots again",
				zap.Int64("rows_sent", res.Rows), zap.Error(err))
			if res.Rows > 0 {
				// PostgreSQL and Kafka both answered: the startup timeout
				// (for what cannot be reached) counts from here, not from
				// before a snapshot that may have run for an hour.
				r.begin = r.now()
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
	rt, err := router.New(cfg.Router, cfg.KafkaOptions, log, m, func(error) {})
	if err != nil {
		return 0, err
	}
	defer rt.Close()
	pingCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
	err = rt.Ping(pingCtx)
	cancel()
	if err != nil {
		return 0, fmt.Errorf("reach kafka brokers: %w", err)
	}
	if err := rt.Start(ctx); err != nil {
		return 0, err
	}
	conn, err := slot.Connect(ctx, cfg.PGURL)
	if err != nil {
		return 0, err
	}
	var at decoder.LSN
	err = conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()").Scan(&at)
	conn.Close(context.Background())
	if err != nil {
		return 0, fmt.Errorf("read the current WAL position: %w", err)
	}
	s := &snapshotSender{rt: rt, lsn: at, m: m}
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

// snapshotSender is snapshot.Sender through the router: the same Send as
// streamed rows (topics, dead letters, the in-flight gate), every record
// counted by one acker.
type snapshotSender struct {
	rt    snapshotProducer
	lsn   decoder.LSN // named in dead letters: the slot's consistent point
	m     *metrics.Metrics
	acks  checkpoint.Counter
	eos   *snapshotEOS // nil with at-least-once delivery
	began time.Time
	timer *time.Timer
}

// snapshotProducer is what a snapshot uses of *router.Router.
type snapshotProducer interface {
	producer
	Failed() bool
	Err() error
}

// snapshotEOS commits the snapshot's Kafka transactions.
type snapshotEOS struct {
	r        *Relay
	txnStart time.Time
	systemID string // for the checkpoints; read once, at the first commit
	timeline int32
}

// produceFailed is the error of a router that Kafka refused a record of
// for good: the snapshot is abandoned and done again from the start.
func (s *snapshotSender) produceFailed() error {
	return fmt.Errorf("kafka refused a snapshot record: %w", s.rt.Err())
}

// Send hands ev to the router, waiting while it asks to.
func (s *snapshotSender) Send(ctx context.Context, ev *decoder.Event) error {
	if s.timer == nil {
		s.timer = time.NewTimer(time.Hour)
	}
	if s.eos != nil && !s.rt.KafkaTxnOpen() {
		s.eos.txnStart = time.Now()
	}
	for {
		if s.rt.Failed() {
			return s.produceFailed()
		}
		wait, err := s.rt.Send(ev, s.lsn, &s.acks)
		if err != nil {
			if s.eos != nil && errors.Is(err, router.ErrFenced) {
				return s.eos.r.snapshotTxnError(err)
			}
			return err
		}
		if wait == nil {
			break
		}
		// A refused record releases the gate too, but look now and then in
		// any case: nothing else would wake this wait.
		s.timer.Reset(tick)
		select {
		case <-wait:
		case <-s.timer.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	s.m.SnapshotRows.Inc()
	if e := s.eos; e != nil {
		cfg := e.r.cfg
		if s.rt.KafkaTxnRecords() >= cfg.TxnMaxEvents || time.Since(e.txnStart) >= cfg.TxnMaxInterval {
			return s.commit(ctx)
		}
	}
	return nil
}

// commit closes the open Kafka transaction with a checkpoint at the
// slot's consistent point: everything before it is in Kafka once the
// snapshot's last transaction committed, and the stream starts there.
func (s *snapshotSender) commit(ctx context.Context) error {
	r := s.eos.r
	if s.eos.systemID == "" {
		// The checkpoint names its cluster, as the stream's do, so the
		// first start after the snapshot can verify it.
		sys, err := slot.IdentifySystem(ctx, r.cfg.PGURL)
		if err != nil {
			return err
		}
		s.eos.systemID, s.eos.timeline = sys.SystemID, sys.Timeline
	}
	d := checkpoint.Durable{Slot: r.cfg.Slot, SystemID: s.eos.systemID, Timeline: s.eos.timeline, LSN: s.lsn, Time: time.Now()}
	cctx, cancel := context.WithTimeout(ctx, r.cfg.Router.TransactionTimeout)
	defer cancel()
	if err := s.rt.CommitKafkaTxn(cctx, []byte(r.cfg.Slot), d.Marshal()); err != nil {
		return r.snapshotTxnError(err)
	}
	r.metrics.KafkaTransactions.Inc()
	return nil
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

// finish commits the last Kafka transaction (exactly-once) and waits until
// Kafka acknowledged every record sent.
func (s *snapshotSender) finish(ctx context.Context) error {
	if s.eos != nil && s.rt.KafkaTxnOpen() {
		if err := s.commit(ctx); err != nil {
			return err
		}
	}
	// Flush returns once every record finished, after its promise (the
	// ack) ran.
	if err := s.rt.Flush(ctx); err != nil {
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
