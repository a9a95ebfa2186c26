package router

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/router/internal/checkpointtopic"
)

// txn.go: the transactional producer of exactly-once delivery. A Router
// made with a TransactionalID has a Txn (Router.Txn): the first record
// after a commit begins a Kafka transaction; Commit closes it with a
// checkpoint record that says how far it reaches in the PostgreSQL
// stream, waits for every record, commits, and only then acks the
// records' transactions, so the slot is confirmed only past committed
// Kafka transactions. A read_committed consumer sees each record once:
// aborted transactions are invisible, and after a crash the relay takes
// the transactional id (Init, fencing any older holder), reads the newest
// committed checkpoint (ReadCheckpoint) and skips what it covers.
//
// Txn's methods belong to the goroutine that calls Router.Send (or one it
// waits for), except TookID, which is safe for concurrent use.

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

// Txn is a Router's Kafka transaction state and calls. See txn.go.
type Txn struct {
	r    *Router
	open bool
	// settled is closed once the coordinator completed the last committed
	// transaction (see settle); nil when nothing is to wait for.
	settled    chan struct{}
	waitSince  time.Time     // when a first record began to wait for settled (zero: not yet)
	noDescribe atomic.Bool   // the coordinator cannot be asked: do not wait
	settleMax  time.Duration // how long settle waits at most (0: settleMax)
	acks       []ackRun      // ackers of the open Kafka transaction, in order
	first      firstWrites   // its first record in each partition, should its commit go unanswered
	events     int           // records in the open Kafka transaction
	began      atomic.Int64  // when the open Kafka transaction began, Unix ns (read by promises)
	broken     atomic.Bool   // a transactional call failed: replace the producer
	took       atomic.Bool   // Init succeeded (TookID)
	traced     []*kgo.Record // the open Kafka transaction's records, with a tracer (trace.go)
}

// ackRun is consecutive records of one transaction.
type ackRun struct {
	a Acker
	n int
}

// begin opens a Kafka transaction unless one is open.
func (t *Txn) begin() error {
	if t.open {
		return nil
	}
	if err := t.r.client.BeginTransaction(); err != nil {
		t.broken.Store(true)
		return fmt.Errorf("begin Kafka transaction: %w", err)
	}
	t.open = true
	t.began.Store(time.Now().UnixNano())
	return nil
}

// track counts a record of the open Kafka transaction, to be acked through
// a at its commit.
func (t *Txn) track(a Acker) {
	t.events++
	if n := len(t.acks); n > 0 && t.acks[n-1].a == a {
		t.acks[n-1].n++
		return
	}
	t.acks = append(t.acks, ackRun{a: a, n: 1})
}

// Records is how many records the open Kafka transaction holds (0 when
// none is open).
func (t *Txn) Records() int { return t.events }

// Open reports whether a Kafka transaction is open.
func (t *Txn) Open() bool { return t.open }

// Commit adds the checkpoint record (key, value) to the open Kafka
// transaction, waits until Kafka has every record, commits, and then acks
// the records' transactions. With no transaction open it does nothing. An
// error leaves the transaction to Abort; errors.Is(err, ErrFenced) means
// stop. When the commit itself was asked and failed, the transaction may
// have committed: the error is then a *CommitUnconfirmed (Landed tells).
func (t *Txn) Commit(ctx context.Context, key, value []byte) error {
	if !t.open {
		return nil
	}
	r := t.r
	r.client.TryProduce(ctx, &kgo.Record{Topic: r.cfg.CheckpointTopic, Key: key, Value: value}, func(rec *kgo.Record, err error) {
		if err != nil {
			err = fmt.Errorf("produce checkpoint to %s: %w", rec.Topic, t.fenceError(err))
			if d := r.denial(err, rec.Topic); d != nil {
				r.deny(d)
				err = d
			}
			r.fail(err)
		}
	})
	if err := r.client.Flush(ctx); err != nil {
		t.broken.Store(true)
		return fmt.Errorf("flush Kafka transaction: %w", err)
	}
	if r.failed.Load() {
		// A record's error, already classified (fenceError) by onPromise.
		return fmt.Errorf("kafka transaction: %w", *r.failErr.Load())
	}
	err := r.client.EndTransaction(ctx, kgo.TryCommit)
	if err != nil {
		uc := t.first.unconfirmed(fmt.Errorf("commit Kafka transaction: %w", err))
		clear(t.first)
		return t.error(uc)
	}
	t.open = false
	for _, run := range t.acks {
		for range run.n {
			run.a.Ack()
		}
	}
	t.granted()
	if r.tracer != nil {
		t.endTraced(nil)
	}
	t.forget()
	clear(t.first) // Flush returned: no promise runs any more
	t.settle()
	return nil
}

// How long settle waits between two looks at the coordinator, and at most
// in all: past that the broker's own retries take over.
const (
	settlePause = 500 * time.Microsecond
	settleMax   = 100 * time.Millisecond
)

// settle asks the transaction coordinator, in the background, until the
// transaction just committed is complete, and the next transaction's first
// record waits for it (pending). EndTxn returns once the coordinator has
// logged the commit; it writes the markers to the partitions after. A
// produce of the next transaction that arrives meanwhile is answered
// CONCURRENT_TRANSACTIONS inside the broker, which holds it and tries
// again after add.partitions.to.txn.retry.backoff.ms, 20 ms by default
// (Kafka 4's transaction.version 2, where produce requests add their
// partitions; before it franz-go retries AddPartitionsToTxn after its own
// 20 ms, kgo.ConcurrentTransactionsBackoff). Measured on one Apache Kafka
// 4.4 node: back-to-back transactions' first produce took 26 ms (p50), and
// so did every commit behind it; waiting for the markers (2-3 ms, a few
// DescribeTransactions, each a lookup in the coordinator's memory) brought
// it to 2 ms. franz-go offers nothing for this: EndAndBeginTransaction is
// Flush, EndTransaction and BeginTransaction in a row, and its
// EndBeginTxnUnsafe is a no-op since Kafka 3.6.
//
// DescribeTransactions needs DESCRIBE on the transactional id, which the
// WRITE that a transactional producer needs implies. A coordinator that
// cannot be asked (the ACL denied, a broker before Kafka 3.0) is not asked
// again, with a warning: the relay then pays the broker's retries. A
// passing failure (the coordinator moving) ends one wait only, at
// settleMax.
func (t *Txn) settle() {
	if t.noDescribe.Load() {
		return
	}
	r := t.r
	done := make(chan struct{})
	t.settled, t.waitSince = done, time.Time{}
	limit := t.settleMax
	if limit == 0 {
		limit = settleMax
	}
	r.bg.Add(1)
	go func() {
		defer r.bg.Done()
		defer close(done)
		ctx, cancel := context.WithTimeout(r.closing, limit)
		defer cancel()
		for {
			described, err := r.admin.DescribeTransactions(ctx, r.cfg.TransactionalID)
			if err == nil {
				d := described[r.cfg.TransactionalID]
				err = d.Err
				if err == nil && d.State != "PrepareCommit" && d.State != "PrepareAbort" {
					return
				}
			}
			if ctx.Err() != nil {
				return
			}
			if err != nil {
				// Not a passing failure, which franz-go retries until
				// ctx ends: a refusal.
				t.noDescribe.Store(true)
				r.log.Warn("cannot ask the Kafka transaction coordinator whether a commit is complete (grant DESCRIBE on the transactional id, or it is a broker before Kafka 3.0): each Kafka transaction's first records may now wait for the broker's retries (add.partitions.to.txn.retry.backoff.ms, 20 ms by default)",
					zap.String("transactional_id", r.cfg.TransactionalID), zap.Error(err))
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(settlePause):
			}
		}
	}()
}

// pending returns what a new Kafka transaction must wait for before its
// first record (see settle), or nil.
// The wait is measured (walrelay_kafka_marker_wait_seconds) from the
// first record that found it until one found it over: most of what a
// Kafka transaction's cycle spends outside its commit.
func (t *Txn) pending() <-chan struct{} {
	if t.open || t.settled == nil {
		return nil
	}
	select {
	case <-t.settled:
		var waited time.Duration
		if !t.waitSince.IsZero() {
			waited = time.Since(t.waitSince)
		}
		t.r.metrics.KafkaMarkerWait.Observe(waited.Seconds())
		t.settled, t.waitSince = nil, time.Time{}
		return nil
	default:
		if t.waitSince.IsZero() {
			t.waitSince = time.Now()
		}
		return t.settled
	}
}

// forget drops the open transaction's records from the accounting.
func (t *Txn) forget() {
	clear(t.acks)
	t.acks, t.events = t.acks[:0], 0
}

// Abort drops the open Kafka transaction: its records are never visible
// to read_committed consumers and their transactions are never acked.
func (t *Txn) Abort(ctx context.Context) error {
	if t.r.tracer != nil {
		t.endTraced(ErrAborted)
	}
	t.forget()
	if err := t.r.client.AbortBufferedRecords(ctx); err != nil {
		t.broken.Store(true)
		return fmt.Errorf("abort buffered records: %w", err)
	}
	clear(t.first) // no promise runs any more
	err := t.r.client.EndTransaction(ctx, kgo.TryAbort)
	t.open = false
	if err != nil {
		return t.error(fmt.Errorf("abort Kafka transaction: %w", err))
	}
	return nil
}

// error marks the producer for replacement and classifies err: fenced or
// timed out (fenceError), or an authorization failure (a *DeniedError,
// counted and logged; the checkpoint topic is the only topic a
// transactional call writes).
func (t *Txn) error(err error) error {
	t.broken.Store(true)
	if d := t.r.denial(err, t.r.cfg.CheckpointTopic); d != nil {
		t.r.deny(d)
		return d
	}
	return t.fenceError(err)
}

// granted lifts the denials of the transactional id and the checkpoint
// topic once Kafka answered a transactional call: the relay is ready
// again (denied.go).
func (t *Txn) granted() {
	t.r.granted(resourceTxnID, t.r.cfg.TransactionalID)
	t.r.granted(resourceTopic, t.r.cfg.CheckpointTopic)
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
func (t *Txn) fenceError(err error) error {
	if !errors.Is(err, kerr.ProducerFenced) && !errors.Is(err, kerr.InvalidProducerEpoch) {
		return err
	}
	timeout := t.r.cfg.TransactionTimeout
	if open := time.Since(time.Unix(0, t.began.Load())); open >= timeout {
		return fmt.Errorf("%w (open %s, transaction timeout %s): %w", ErrTxnTimedOut, open.Round(time.Millisecond), timeout, err)
	}
	return fmt.Errorf("%w: %w", ErrFenced, err)
}

// Init registers the transactional id with Kafka, fencing any older
// producer that holds it (its open transaction is aborted). Call it before
// reading the checkpoint; again on the same router it does nothing. An
// error marks the router for replacement (Router.Failed).
func (t *Txn) Init(ctx context.Context) error {
	r := t.r
	if _, _, err := r.client.ProducerID(ctx); err != nil {
		t.broken.Store(true)
		if d := r.denial(err, ""); d != nil {
			// The relay waits for an ACL (or, before it ever streamed,
			// stops: a configuration to fix).
			r.deny(d)
			return fmt.Errorf("initialize transactional producer: %w", d)
		}
		if errors.Is(err, kerr.ProducerFenced) {
			err = fmt.Errorf("%w: %w", ErrFenced, err)
		}
		if errors.Is(err, kerr.InvalidTransactionTimeout) {
			err = fmt.Errorf("the broker's transaction.max.timeout.ms is below router.Config.TransactionTimeout %s: lower router.Config.TransactionTimeout (keeping it at least twice relay.Config.TxnMaxInterval) or raise transaction.max.timeout.ms: %w", r.cfg.TransactionTimeout, err)
		}
		return classify(fmt.Errorf("initialize transactional producer %q: %w", r.cfg.TransactionalID, err))
	}
	t.took.Store(true)
	r.granted(resourceTxnID, r.cfg.TransactionalID)
	return nil
}

// TookID reports whether Init succeeded on this router. Its producer
// epoch is then stale once another producer takes the id (a relay that
// took the slot while this one had lost it): a relay replaces such a
// router before it streams again, so that the new one takes the id afresh
// rather than being answered INVALID_PRODUCER_EPOCH.
func (t *Txn) TookID() bool { return t.took.Load() }

// prepareCheckpointTopic creates (when topic creation is on) and checks
// the checkpoint topic.
func (t *Txn) prepareCheckpointTopic(ctx context.Context) error {
	r := t.r
	err := checkpointtopic.Prepare(ctx, r.admin, r.cfg.CheckpointTopic, r.cfg.CreateTopics, r.cfg.TopicReplicationFactor)
	if d := r.denial(err, r.cfg.CheckpointTopic); d != nil {
		d.Operation = "DESCRIBE"
		r.deny(d)
		return d
	}
	return err
}

// ReadCheckpoint returns the newest committed checkpoint record for key.
// It commits a probe record (key "<key>/probe") in a transaction of its
// own and reads the topic read_committed up to the probe: every
// checkpoint committed before it has been seen, whatever transaction
// markers or aborted records lie in between. The reader starts before the
// probe, so that its connection and first fetches overlap the probe's
// commit (an exactly-once start reads the stream ahead into memory until
// this returns). Call Init first, so that no older producer can commit
// after the probe.
func (t *Txn) ReadCheckpoint(ctx context.Context, key []byte) (value []byte, found bool, err error) {
	r := t.r
	rd, err := checkpointtopic.OpenReader(r.connOpts, r.cfg.CheckpointTopic)
	if err != nil {
		return nil, false, fmt.Errorf("read checkpoint topic: %w", err)
	}
	defer rd.Close()
	probeKey, probe := checkpointtopic.Probe(key)
	if err := t.begin(); err != nil {
		return nil, false, err
	}
	if err := r.client.ProduceSync(ctx, &kgo.Record{Topic: r.cfg.CheckpointTopic, Key: probeKey, Value: probe}).FirstErr(); err != nil {
		_ = t.Abort(context.Background())
		return nil, false, t.error(fmt.Errorf("write checkpoint probe: %w", err))
	}
	if err := r.client.EndTransaction(ctx, kgo.TryCommit); err != nil {
		t.open = false
		return nil, false, t.error(fmt.Errorf("commit checkpoint probe: %w", err))
	}
	t.open = false
	t.settle()
	t.granted()
	return rd.Until(ctx, key, probeKey, probe)
}
