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
	"github.com/walrelay/walrelay/router"
)

// eosState is a session's exactly-once bookkeeping: which events PostgreSQL
// resends are already in Kafka (from the checkpoint found at start), and
// how far the open Kafka transaction reaches, for its checkpoint record.
type eosState struct {
	key       []byte           // checkpoint record key: the slot name
	skip      *checkpoint.Skip // what the checkpoint found at start covers
	lastFull  decoder.LSN      // end LSN of the newest PostgreSQL transaction wholly in Kafka transactions
	curCommit decoder.LSN      // commit LSN of the PostgreSQL transaction in progress
	curEvents int              // its outbox events so far, sent or skipped
	inPG      bool             // between a Begin and its Commit
	txnStart  time.Time        // when the open Kafka transaction began

	found    bool               // a checkpoint was found at start
	ckpt     checkpoint.Durable // the checkpoint found at start
	systemID string             // the PostgreSQL system identifier, written in every checkpoint
}

// startEOS reads the newest committed checkpoint of the slot; PostgreSQL
// may resend from before it (the slot is confirmed after the Kafka commit,
// so a crash in between leaves it behind), and those events are skipped.
// It runs before the stream starts: the router's InitTransactions already
// fenced any older producer, so the checkpoint cannot move any more, and a
// stream left unread meanwhile would make the walsender wait for us.
func (r *Relay) startEOS(ctx context.Context, rt *router.Router) (*eosState, error) {
	key := []byte(r.cfg.Slot)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	value, found, err := rt.ReadCheckpoint(ctx, key)
	if err != nil {
		return nil, r.eosError(err)
	}
	var d checkpoint.Durable
	if found {
		if d, err = checkpoint.UnmarshalDurable(value); err != nil {
			return nil, &fatalError{fmt.Errorf("checkpoint of slot %q: %w", r.cfg.Slot, err)}
		}
	}
	fields := []zap.Field{zap.Bool("found", found), zap.Stringer("checkpoint_lsn", d.LSN)}
	if d.Partial != nil {
		fields = append(fields, zap.Stringer("partial_commit_lsn", d.Partial.CommitLSN), zap.Int("partial_events", d.Partial.Events))
	}
	r.log.Info("exactly-once: resuming after the newest committed checkpoint", fields...)
	return &eosState{key: key, skip: checkpoint.NewSkip(d, found), lastFull: d.LSN, found: found, ckpt: d}, nil
}

// verifyEOS checks the checkpoint found at start against the stream's
// IDENTIFY_SYSTEM result before anything is skipped on its word: a
// checkpoint of another slot or cluster, or ahead of the server's WAL, is
// refused (fatal); one written before walrelay stored the system
// identifier is accepted with a warning.
func (r *Relay) verifyEOS(e *eosState, sys pglogrepl.IdentifySystemResult) error {
	e.systemID = sys.SystemID
	if !e.found {
		return nil
	}
	legacy, err := e.ckpt.Verify(r.cfg.Slot, sys.SystemID, sys.XLogPos)
	if err != nil {
		return &fatalError{fmt.Errorf("exactly-once: checkpoint topic %q: %w", r.cfg.Router.CheckpointTopic, err)}
	}
	if legacy {
		r.log.Warn("exactly-once: the checkpoint does not name its PostgreSQL system (written by an older walrelay); trusting it once, the next checkpoint will",
			zap.String("slot", r.cfg.Slot), zap.Stringer("checkpoint_lsn", e.ckpt.LSN), zap.String("system_id", sys.SystemID))
	}
	return nil
}

// txnError is a failed Kafka transaction (begin, commit, abort, checkpoint
// read): the session ends and the next resumes from the last checkpoint.
type txnError struct{ err error }

func (e *txnError) Error() string { return e.err.Error() }
func (e *txnError) Unwrap() error { return e.err }

// eosError turns a fenced producer into the documented fatal error, and
// marks other errors as Kafka's.
func (r *Relay) eosError(err error) error {
	if err == nil {
		return nil
	}
	if !errors.Is(err, router.ErrFenced) {
		return &txnError{err}
	}
	return &fatalError{fmt.Errorf("transactional id %q is now used by another walrelay (a newer relay for slot %q started); this one stops so that only one writes: %w",
		r.cfg.Router.TransactionalID, r.cfg.Slot, err)}
}

// eosError is the relay's eosError.
func (s *session) eosError(err error) error { return s.r.eosError(err) }

// commitDue reports whether the open Kafka transaction should commit now.
func (s *session) commitDue(now time.Time) bool {
	if s.eos == nil || !s.rt.InTxn() {
		return false
	}
	return s.rt.TxnEvents() >= s.r.cfg.TxnMaxEvents || now.Sub(s.eos.txnStart) >= s.r.cfg.TxnMaxInterval
}

// commitKafka closes the open Kafka transaction with a checkpoint record
// saying exactly how far it reaches, and waits for the commit while still
// answering PostgreSQL. The commit is never abandoned half-way while the
// relay runs: it waits for CommitTxn to return, which takes at most the
// transaction timeout, or once the relay stops, until the stop deadline
// (see kafkaCtx).
func (s *session) commitKafka() error {
	e := s.eos
	d := checkpoint.Durable{Slot: s.r.cfg.Slot, SystemID: e.systemID, LSN: e.lastFull, Time: time.Now()}
	if e.inPG && e.curEvents > 0 {
		d.Partial = &checkpoint.Partial{CommitLSN: e.curCommit, Events: e.curEvents}
	}
	done := make(chan error, 1)
	ctx, cancel := s.kafkaCtx()
	defer cancel()
	go func() { done <- s.rt.CommitTxn(ctx, e.key, d.Marshal()) }()
	for {
		s.timer.Reset(time.Until(s.nextTick))
		select {
		case err := <-done:
			if err != nil {
				return s.eosError(err)
			}
			s.r.metrics.KafkaTransactions.Inc()
			return nil
		case <-s.timer.C:
			s.housekeep(false)
		}
	}
}

// endEOS ends a session's open Kafka transaction: committed when the relay
// stops cleanly, aborted otherwise (the next session resends from the last
// checkpoint).
func (s *session) endEOS(commit bool) error {
	if s.eos == nil || !s.rt.InTxn() {
		return nil
	}
	if commit {
		return s.commitKafka()
	}
	ctx, cancel := s.kafkaCtx()
	defer cancel()
	return s.eosError(s.rt.AbortTxn(ctx))
}
