package router

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/checkpointtopic"
)

// Exactly-once delivery: the producer is transactional. The first record
// after a commit begins a Kafka transaction; CommitKafkaTxn closes it with a
// checkpoint record that says how far it reaches in the PostgreSQL stream,
// waits for every record, commits, and only then acks the records'
// transactions, so the slot is confirmed only past committed Kafka
// transactions. A read_committed consumer sees each record once: aborted
// transactions are invisible, and after a crash the relay reads the newest
// committed checkpoint and skips what it covers.

// ErrFenced means another producer took this relay's transactional id:
// nothing this producer sent since its last commit will become visible,
// and it can commit nothing more. Usually a walrelay that took the slot
// after this one lost it without noticing (this one should then wait as a
// standby); otherwise a relay of another slot configured with the same
// transactional id. Only the caller, which knows whether it still holds
// the slot, can tell the two apart.
var ErrFenced = errors.New("fenced: another producer took over the transactional id")

// ErrTxnTimedOut means the broker aborted the open Kafka transaction because
// it stayed open longer than the transaction timeout. Nothing of it is
// visible to read_committed consumers; the relay resumes from the last
// checkpoint with a new producer.
var ErrTxnTimedOut = errors.New("kafka transaction timed out")

// ackRun is consecutive records of one transaction.
type ackRun struct {
	a Acker
	n int
}

func (r *Router) beginTxn() error {
	if r.inTxn {
		return nil
	}
	if err := r.client.BeginTransaction(); err != nil {
		r.txnBroken.Store(true)
		return fmt.Errorf("begin Kafka transaction: %w", err)
	}
	r.inTxn = true
	r.txnBegan.Store(time.Now().UnixNano())
	return nil
}

func (r *Router) txnAck(a Acker) {
	r.txnEvents++
	if n := len(r.txnAcks); n > 0 && r.txnAcks[n-1].a == a {
		r.txnAcks[n-1].n++
		return
	}
	r.txnAcks = append(r.txnAcks, ackRun{a: a, n: 1})
}

// KafkaTxnRecords is how many records the open Kafka transaction holds (0 when
// none is open).
func (r *Router) KafkaTxnRecords() int { return r.txnEvents }

// KafkaTxnOpen reports whether a Kafka transaction is open.
func (r *Router) KafkaTxnOpen() bool { return r.inTxn }

// CommitKafkaTxn adds the checkpoint record (key, value) to the open Kafka
// transaction, waits until Kafka has every record, commits, and then acks
// the records' transactions. With no transaction open it does nothing. An
// error leaves the transaction to AbortKafkaTxn; errors.Is(err, ErrFenced) means
// stop.
func (r *Router) CommitKafkaTxn(ctx context.Context, key, value []byte) error {
	if !r.inTxn {
		return nil
	}
	r.client.TryProduce(ctx, &kgo.Record{Topic: r.cfg.CheckpointTopic, Key: key, Value: value}, func(rec *kgo.Record, err error) {
		if err != nil {
			r.fail(fmt.Errorf("produce checkpoint to %s: %w", rec.Topic, r.fenceError(err)))
		}
	})
	if err := r.client.Flush(ctx); err != nil {
		r.txnBroken.Store(true)
		return fmt.Errorf("flush Kafka transaction: %w", err)
	}
	if r.failed.Load() {
		// A record's error, already classified (fenceError) by onPromise.
		return fmt.Errorf("kafka transaction: %w", *r.failErr.Load())
	}
	err := r.client.EndTransaction(ctx, kgo.TryCommit)
	if err != nil {
		return r.txnError(fmt.Errorf("commit Kafka transaction: %w", err))
	}
	r.inTxn = false
	for _, run := range r.txnAcks {
		for range run.n {
			run.a.Ack()
		}
	}
	clear(r.txnAcks)
	r.txnAcks, r.txnEvents = r.txnAcks[:0], 0
	return nil
}

// AbortKafkaTxn drops the open Kafka transaction: its records are never visible
// to read_committed consumers and their transactions are never acked.
func (r *Router) AbortKafkaTxn(ctx context.Context) error {
	clear(r.txnAcks)
	r.txnAcks, r.txnEvents = r.txnAcks[:0], 0
	if err := r.client.AbortBufferedRecords(ctx); err != nil {
		r.txnBroken.Store(true)
		return fmt.Errorf("abort buffered records: %w", err)
	}
	err := r.client.EndTransaction(ctx, kgo.TryAbort)
	r.inTxn = false
	if err != nil {
		return r.txnError(fmt.Errorf("abort Kafka transaction: %w", err))
	}
	return nil
}

// txnError marks the producer for replacement and classifies err
// (fenceError).
func (r *Router) txnError(err error) error {
	r.txnBroken.Store(true)
	return r.fenceError(err)
}

// fenceError classifies an error of a transactional call or of a record in
// the open transaction. Kafka answers PRODUCER_FENCED (to EndTxn and
// InitProducerId) or INVALID_PRODUCER_EPOCH (to Produce; Apache Kafka 4
// answers a fenced producer's records this way before its commit is even
// tried) both when a newer producer took the transactional id and when the
// broker itself aborted a transaction that outlived the transaction
// timeout (it bumps the epoch then too). The two cannot be told apart from
// the answer, but the broker's clock for a transaction starts after ours:
// one open for less than the timeout was not timed out, so it was fenced.
// It is safe for concurrent use (promises call it).
func (r *Router) fenceError(err error) error {
	if !errors.Is(err, kerr.ProducerFenced) && !errors.Is(err, kerr.InvalidProducerEpoch) {
		return err
	}
	if open := time.Since(time.Unix(0, r.txnBegan.Load())); open >= r.cfg.TransactionTimeout {
		return fmt.Errorf("%w (open %s, transaction timeout %s): %w", ErrTxnTimedOut, open.Round(time.Millisecond), r.cfg.TransactionTimeout, err)
	}
	return fmt.Errorf("%w: %w", ErrFenced, err)
}

// InitTransactions registers the transactional id with Kafka, fencing any
// older producer that holds it (its open transaction is aborted). Call it
// before reading the checkpoint; again on the same router it does nothing.
// An error marks the router for replacement (Failed).
func (r *Router) InitTransactions(ctx context.Context) error {
	if _, _, err := r.client.ProducerID(ctx); err != nil {
		r.txnBroken.Store(true)
		if errors.Is(err, kerr.ProducerFenced) {
			err = fmt.Errorf("%w: %w", ErrFenced, err)
		}
		if errors.Is(err, kerr.InvalidTransactionTimeout) {
			err = fmt.Errorf("the broker's transaction.max.timeout.ms is below router.Config.TransactionTimeout %s: lower router.Config.TransactionTimeout (keeping it at least twice relay.Config.TxnMaxInterval) or raise transaction.max.timeout.ms: %w", r.cfg.TransactionTimeout, err)
		}
		return fmt.Errorf("initialize transactional producer %q: %w", r.cfg.TransactionalID, err)
	}
	r.txnInit.Store(true)
	return nil
}

// TookTransactionalID reports whether InitTransactions succeeded on this
// router. Its producer epoch is then stale once another producer takes the
// id (a relay that took the slot while this one had lost it): a relay
// replaces such a router before it streams again, so that the new one takes
// the id afresh rather than being answered INVALID_PRODUCER_EPOCH.
func (r *Router) TookTransactionalID() bool { return r.txnInit.Load() }

// prepareCheckpointTopic creates (when topic creation is on) and checks
// the checkpoint topic.
func (r *Router) prepareCheckpointTopic(ctx context.Context) error {
	return checkpointtopic.Prepare(ctx, r.admin, r.cfg.CheckpointTopic, r.cfg.CreateTopics, r.cfg.TopicReplicationFactor)
}

// ReadCheckpoint returns the newest committed checkpoint record for key.
// It first commits a probe record (key "<key>/probe") in a transaction of
// its own, then reads the topic read_committed up to the probe: every
// checkpoint committed before it has been seen, whatever transaction
// markers or aborted records lie in between. Call InitTransactions first,
// so that no older producer can commit after the probe.
func (r *Router) ReadCheckpoint(ctx context.Context, key []byte) (value []byte, found bool, err error) {
	probeKey, probe := checkpointtopic.Probe(key)
	if err := r.beginTxn(); err != nil {
		return nil, false, err
	}
	if err := r.client.ProduceSync(ctx, &kgo.Record{Topic: r.cfg.CheckpointTopic, Key: probeKey, Value: probe}).FirstErr(); err != nil {
		r.AbortKafkaTxn(context.Background())
		return nil, false, r.txnError(fmt.Errorf("write checkpoint probe: %w", err))
	}
	if err := r.client.EndTransaction(ctx, kgo.TryCommit); err != nil {
		r.inTxn = false
		return nil, false, r.txnError(fmt.Errorf("commit checkpoint probe: %w", err))
	}
	r.inTxn = false
	return checkpointtopic.Read(ctx, r.connOpts, r.cfg.CheckpointTopic, key, probeKey, probe)
}

// ProduceHeartbeat produces one heartbeat record and waits for Kafka's
// answer. It never joins a Kafka transaction: with exactly-once delivery it
// goes through a non-transactional client of its own, made on first use.
// It is safe for concurrent use with everything else.
func (r *Router) ProduceHeartbeat(ctx context.Context, topic string, key, value []byte) error {
	cl := r.client
	if r.eos {
		r.hbMu.Lock()
		if r.hbClient == nil {
			c, err := kgo.NewClient(r.connOpts...)
			if err != nil {
				r.hbMu.Unlock()
				return err
			}
			r.hbClient = c
		}
		cl = r.hbClient
		r.hbMu.Unlock()
	}
	return cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Key: key, Value: value}).FirstErr()
}
