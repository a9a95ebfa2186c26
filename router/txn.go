package router

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/router/internal/checkpointtopic"
)

// txn.go: the transactional producers of exactly-once delivery. A Router
// made with a TransactionalID has a Txn (Router.Txn): the first record
// after a commit begins a Kafka transaction; Commit closes it with a
// checkpoint record that says how far it reaches in the PostgreSQL
// stream, waits for every record, commits, and only then acks the
// records' transactions, so the slot is confirmed only past committed
// Kafka transactions. A read_committed consumer sees each record once:
// aborted transactions are invisible, and after a crash the relay takes
// the transactional ids (Init, fencing any older holder), reads the
// newest committed checkpoint (ReadCheckpoint) and skips what it covers.
//
// With Config.TxnProducers 2, two producers take turns (lanes): the
// transactional id and "<id>-1". Commit hands one lane's commit to the
// background once Kafka has its records, and the next records go to the
// other lane at once, so the relay does not wait idle for a commit and
// its markers. The order stays Kafka's: a lane's records are produced
// only after the other lane's are all acknowledged (Commit flushes
// first), so on every partition they follow them, and a lane commits
// only after the other lane's commit was answered (the caller Settles
// first), so a committed transaction never follows one that did not
// commit. Each transaction carries a checkpoint record of the same key:
// the newest committed one, by offset, is the newest commit, whichever
// lane wrote it.
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
	r     *Router
	lanes []*lane // lanes[0] is the Router's client, with the transactional id
	cur   int     // the lane records go to
	// flying is the commit in the background (two lanes) until Settle
	// collects its outcome; nil when none is.
	flying     *flight
	noDescribe atomic.Bool   // the coordinator cannot be asked: do not wait
	authFailed atomic.Bool   // asking it failed Kafka authentication, said once until it answers
	settleMax  time.Duration // how long settle waits at most (0: settleMax)
	broken     atomic.Bool   // a transactional call failed: replace the producer
	took       atomic.Bool   // Init succeeded (TookID)
	opts       []kgo.Opt     // the lanes' client options but the transactional ones (sweep)
}

// lane is one transactional producer and its Kafka transaction. The
// fields are the Send goroutine's, except while the lane's commit runs in
// the background (flight): the background goroutine then has them until
// Settle.
type lane struct {
	n      int    // its index, named in a *CommitUnconfirmed
	id     string // transactional id
	client *kgo.Client
	open   bool
	// settled is closed once the coordinator completed the lane's last
	// committed transaction (see settle); nil when nothing is to wait for.
	settled   chan struct{}
	waitSince time.Time    // when a first record began to wait for settled (zero: not yet)
	acks      []ackRun     // ackers of the open Kafka transaction, in order
	first     firstWrites  // its first record in each partition, should its commit go unanswered
	events    int          // records in the open Kafka transaction
	began     atomic.Int64 // when the open Kafka transaction began, Unix ns (read by promises)
	traced    []*kgo.Record
}

// flight is a commit handed to the background; err is set before done is
// closed.
type flight struct {
	l    *lane
	done chan struct{}
	err  error
}

// ackRun is consecutive records of one transaction.
type ackRun struct {
	a Acker
	n int
}

// laneID is lane n's transactional id: the configured one, then "<id>-n".
func laneID(id string, n int) string {
	if n == 0 {
		return id
	}
	return id + "-" + strconv.Itoa(n)
}

// lane is the lane records go to now.
func (t *Txn) lane() *lane { return t.lanes[t.cur] }

// begin opens a Kafka transaction on the current lane unless one is open.
func (t *Txn) begin() error {
	l := t.lane()
	if l.open {
		return nil
	}
	if err := l.client.BeginTransaction(); err != nil {
		t.broken.Store(true)
		return fmt.Errorf("begin Kafka transaction: %w", err)
	}
	l.open = true
	l.began.Store(time.Now().UnixNano())
	return nil
}

// track counts a record of the open Kafka transaction, to be acked through
// a at its commit.
func (t *Txn) track(a Acker) {
	l := t.lane()
	l.events++
	if n := len(l.acks); n > 0 && l.acks[n-1].a == a {
		l.acks[n-1].n++
		return
	}
	l.acks = append(l.acks, ackRun{a: a, n: 1})
}

// Records is how many records the open Kafka transaction holds (0 when
// none is open).
func (t *Txn) Records() int { return t.lane().events }

// Open reports whether a Kafka transaction is open.
func (t *Txn) Open() bool { return t.lane().open }

// Commit adds the checkpoint record (key, value) to the open Kafka
// transaction, waits until Kafka has every record, and commits: with one
// lane before it returns, with two in the background (Settling is then
// non-nil, Settle collects the outcome, and ctx must live until then).
// Only after the commit are the records' transactions acked.
// With no transaction open it does nothing. Call Settle before it when a
// commit is in flight. An error leaves the transaction to Abort;
// errors.Is(err, ErrFenced) means stop. When the commit itself was asked
// and failed, the transaction may have committed: the error is then a
// *CommitUnconfirmed (Landed tells).
func (t *Txn) Commit(ctx context.Context, key, value []byte) error {
	l := t.lane()
	if !l.open {
		return nil
	}
	if t.flying != nil {
		panic("router: Txn.Commit with a commit in flight (call Settle first)")
	}
	r := t.r
	l.client.TryProduce(ctx, &kgo.Record{Topic: r.cfg.CheckpointTopic, Key: key, Value: value}, func(rec *kgo.Record, err error) {
		if err != nil {
			err = fmt.Errorf("produce checkpoint to %s: %w", rec.Topic, l.fenceError(r.cfg.TransactionTimeout, err))
			if d := r.denial(err, rec.Topic); d != nil {
				r.deny(d)
				err = d
			}
			r.fail(err)
		}
	})
	if err := l.client.Flush(ctx); err != nil {
		t.broken.Store(true)
		return fmt.Errorf("flush Kafka transaction: %w", err)
	}
	if r.failed.Load() {
		// A record's error, already classified (fenceError) by onPromise.
		return fmt.Errorf("kafka transaction: %w", *r.failErr.Load())
	}
	if len(t.lanes) == 1 {
		return t.end(ctx, l)
	}
	f := &flight{l: l, done: make(chan struct{})}
	t.flying = f
	t.cur = (t.cur + 1) % len(t.lanes)
	go func() {
		defer close(f.done)
		f.err = t.end(ctx, l)
	}()
	return nil
}

// end commits lane l's transaction, whose records Kafka has, and acks them.
func (t *Txn) end(ctx context.Context, l *lane) error {
	r := t.r
	err := l.client.EndTransaction(ctx, kgo.TryCommit)
	if err != nil {
		uc := l.first.unconfirmed(l.n, fmt.Errorf("commit Kafka transaction: %w", err))
		clear(l.first)
		return t.error(l, uc)
	}
	l.open = false
	for _, run := range l.acks {
		for range run.n {
			run.a.Ack()
		}
	}
	t.granted()
	if r.tracer != nil {
		l.endTraced(r.tracer, nil)
	}
	l.forget()
	clear(l.first) // Flush returned: no promise runs any more
	t.settle(l)
	return nil
}

// Settle waits for the commit Commit handed to the background and returns
// its outcome as Commit would have; nil when none is in flight.
func (t *Txn) Settle() error {
	f := t.flying
	if f == nil {
		return nil
	}
	<-f.done
	t.flying = nil
	return f.err
}

// Settling is closed once the commit in the background was answered (then
// Settle does not wait); nil when none is in flight.
func (t *Txn) Settling() <-chan struct{} {
	if t.flying == nil {
		return nil
	}
	return t.flying.done
}

// How long settle waits between two looks at the coordinator, and at most
// in all: past that the broker's own retries take over.
const (
	settlePause = 500 * time.Microsecond
	settleMax   = 100 * time.Millisecond
)

// settle asks the transaction coordinator, in the background, until lane
// l's transaction just committed is complete, and the lane's next
// transaction's first record waits for it (pending). EndTxn returns once
// the coordinator has logged the commit; it writes the markers to the
// partitions after. A produce of the next transaction that arrives
// meanwhile is answered CONCURRENT_TRANSACTIONS inside the broker, which
// holds it and tries again after add.partitions.to.txn.retry.backoff.ms,
// 20 ms by default (Kafka 4's transaction.version 2, where produce
// requests add their partitions; before it franz-go retries
// AddPartitionsToTxn after its own 20 ms, kgo.ConcurrentTransactionsBackoff).
// Measured on one Apache Kafka 4.4 node: back-to-back transactions' first
// produce took 26 ms (p50), and so did every commit behind it; waiting for
// the markers (2-3 ms, a few DescribeTransactions, each a lookup in the
// coordinator's memory) brought it to 2 ms. franz-go offers nothing for
// this: EndAndBeginTransaction is Flush, EndTransaction and
// BeginTransaction in a row, and its EndBeginTxnUnsafe is a no-op since
// Kafka 3.6. With two lanes the other lane's records go on meanwhile: only
// a lane's own next transaction waits, and rarely, as the other lane's
// turn comes first.
//
// DescribeTransactions needs DESCRIBE on the transactional id, which the
// WRITE that a transactional producer needs implies. A coordinator that
// cannot be asked (the ACL denied, a broker before Kafka 3.0) is not asked
// again, with a warning: the relay then pays the broker's retries. A
// passing failure (the coordinator moving) ends one wait only, at
// settleMax; so does a failure to authenticate to Kafka or to reach it,
// which says nothing of DESCRIBE (describeRefused).
func (t *Txn) settle(l *lane) {
	if t.noDescribe.Load() {
		return
	}
	r := t.r
	done := make(chan struct{})
	l.settled, l.waitSince = done, time.Time{}
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
			described, err := r.admin.DescribeTransactions(ctx, l.id)
			if err == nil {
				t.authFailed.Store(false)
				d := described[l.id]
				err = d.Err
				if err == nil && d.State != "PrepareCommit" && d.State != "PrepareAbort" {
					return
				}
			}
			if ctx.Err() != nil {
				return
			}
			if err != nil && !describeRefused(err) {
				if kafkaAuthFailure(err) && t.authFailed.CompareAndSwap(false, true) {
					r.log.Info("cannot ask the Kafka transaction coordinator whether a commit is complete: Kafka authentication (SASL) failed, so the next commit asks again; the credential source or the broker's log says why",
						zap.String("transactional_id", l.id), zap.Error(err))
				}
				return
			}
			if err != nil {
				// Not a passing failure, which franz-go retries until
				// ctx ends: a refusal.
				t.noDescribe.Store(true)
				r.log.Warn("cannot ask the Kafka transaction coordinator whether a commit is complete (grant DESCRIBE on the transactional id, or it is a broker before Kafka 3.0): each Kafka transaction's first records may now wait for the broker's retries (add.partitions.to.txn.retry.backoff.ms, 20 ms by default)",
					zap.String("transactional_id", l.id), zap.Error(err))
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

// describeRefused reports an error of DescribeTransactions that says it
// cannot be asked (an authorizer that denies DESCRIBE, a broker that does
// not know the request), rather than that this attempt failed: a failure
// to authenticate to Kafka (an OAUTHBEARER token that expired while its
// endpoint was down, a refused SASL re-authentication) or to reach the
// broker says nothing of what the principal may do.
func describeRefused(err error) bool {
	return !kafkaAuthFailure(err) && !kgo.IsRetryableBrokerErr(err)
}

// kafkaAuthFailure reports a failure to authenticate to Kafka: the
// broker's SASL errors, and a credential source that had no credential
// to give (kafkaauth.SourceError says so by its KafkaAuthentication
// method).
func kafkaAuthFailure(err error) bool {
	var source interface{ KafkaAuthentication() }
	return errors.Is(err, kerr.SaslAuthenticationFailed) || errors.Is(err, kerr.IllegalSaslState) ||
		errors.Is(err, kerr.UnsupportedSaslMechanism) || errors.As(err, &source)
}

// pending returns what a new Kafka transaction on the current lane must
// wait for before its first record (see settle), or nil.
// The wait is measured (walrelay_kafka_marker_wait_seconds) from the
// first record that found it until one found it over: most of what a
// Kafka transaction's cycle spends outside its commit.
func (t *Txn) pending() <-chan struct{} {
	l := t.lane()
	if l.open || l.settled == nil {
		return nil
	}
	select {
	case <-l.settled:
		var waited time.Duration
		if !l.waitSince.IsZero() {
			waited = time.Since(l.waitSince)
		}
		t.r.metrics.KafkaMarkerWait.Observe(waited.Seconds())
		l.settled, l.waitSince = nil, time.Time{}
		return nil
	default:
		if l.waitSince.IsZero() {
			l.waitSince = time.Now()
		}
		return l.settled
	}
}

// forget drops the lane's open transaction's records from the accounting.
func (l *lane) forget() {
	clear(l.acks)
	l.acks, l.events = l.acks[:0], 0
}

// Abort drops the open Kafka transaction: its records are never visible
// to read_committed consumers and their transactions are never acked. A
// commit in flight is waited for first (its outcome is Settle's).
func (t *Txn) Abort(ctx context.Context) error {
	if t.flying != nil {
		<-t.flying.done
	}
	l := t.lane()
	if t.r.tracer != nil {
		l.endTraced(t.r.tracer, ErrAborted)
	}
	l.forget()
	if err := l.client.AbortBufferedRecords(ctx); err != nil {
		t.broken.Store(true)
		return fmt.Errorf("abort buffered records: %w", err)
	}
	clear(l.first) // no promise runs any more
	err := l.client.EndTransaction(ctx, kgo.TryAbort)
	l.open = false
	if err != nil {
		return t.error(l, fmt.Errorf("abort Kafka transaction: %w", err))
	}
	return nil
}

// error marks the producer for replacement and classifies err, of a
// transactional call of lane l: fenced or timed out (fenceError), or an
// authorization failure (a *DeniedError, counted and logged; the
// checkpoint topic is the only topic a transactional call writes).
func (t *Txn) error(l *lane, err error) error {
	t.broken.Store(true)
	if d := t.r.denial(err, t.r.cfg.CheckpointTopic); d != nil {
		if d.Resource == resourceTxnID {
			d.Name = l.id
		}
		t.r.deny(d)
		return d
	}
	return l.fenceError(t.r.cfg.TransactionTimeout, err)
}

// granted lifts the denials of the transactional ids and the checkpoint
// topic once Kafka answered a transactional call: the relay is ready
// again (denied.go).
func (t *Txn) granted() {
	for _, l := range t.lanes {
		t.r.granted(resourceTxnID, l.id)
	}
	t.r.granted(resourceTopic, t.r.cfg.CheckpointTopic)
}

// fenceError classifies an error of a transactional call or of a record in
// the lane's open transaction. Kafka answers PRODUCER_FENCED (to EndTxn and
// InitProducerId) or INVALID_PRODUCER_EPOCH (to Produce; Apache Kafka 4
// answers a fenced producer's records this way before its commit is even
// tried) both when a newer producer took the transactional id and when the
// broker itself aborted a transaction that outlived the transaction
// timeout (it bumps the epoch then too). The two cannot be told apart from
// the answer, but the broker's clock for a transaction starts after ours:
// one open for less than the timeout was not timed out, so it was fenced.
// It is safe for concurrent use (promises call it).
func (l *lane) fenceError(timeout time.Duration, err error) error {
	if !errors.Is(err, kerr.ProducerFenced) && !errors.Is(err, kerr.InvalidProducerEpoch) {
		return err
	}
	if open := time.Since(time.Unix(0, l.began.Load())); open >= timeout {
		return fmt.Errorf("%w (open %s, transaction timeout %s): %w", ErrTxnTimedOut, open.Round(time.Millisecond), timeout, err)
	}
	return fmt.Errorf("%w (%s): %w", ErrFenced, l.id, err)
}

// Init registers the transactional ids with Kafka, fencing any older
// producer that holds one (its open transaction is aborted). Call it
// before reading the checkpoint; again on the same router it does
// nothing. An error marks the router for replacement (Router.Failed).
//
// The second lane's id, "<id>-1", needs its own WRITE: a prefixed ACL on
// the id covers both, a literal one only the first. Denied it, the router
// keeps one lane (commits wait for their markers, as before two lanes),
// with a warning naming the ACL to add. With one lane, Init first aborts
// a transaction a relay with two left open on "<id>-1" (sweep).
func (t *Txn) Init(ctx context.Context) error {
	if len(t.lanes) == 1 {
		t.sweep(ctx, laneID(t.lanes[0].id, 1))
	}
	for i, l := range t.lanes {
		err := t.initLane(ctx, l)
		if err != nil && i > 0 && t.r.denial(err, "") != nil {
			t.r.log.Warn("Kafka denies WRITE on the second transactional id, so exactly-once commits one Kafka transaction at a time (each waits for the last one's markers): add a PREFIXED ACL on the transactional id, which covers both, or a literal one on the second",
				zap.String("transactional_id", t.lanes[0].id), zap.String("second_transactional_id", l.id), zap.Error(err))
			for _, extra := range t.lanes[i:] {
				extra.client.Close()
			}
			t.lanes = t.lanes[:i]
			break
		}
		if err != nil {
			return err
		}
	}
	t.r.metrics.KafkaTxnProducers.Set(float64(len(t.lanes)))
	t.took.Store(true)
	return nil
}

// sweep aborts a Kafka transaction that a relay with two producers left
// open on the second id (killed, then started again with one: a
// downgrade, or TxnProducers lowered). Nothing else would take that id
// before the broker's transaction timeout (60 s by default), and until
// then read_committed consumers of its partitions stall, and so does the
// checkpoint read when it holds a checkpoint record. Only an open one is
// taken, so that a relay that never had two producers registers nothing.
// A look that fails or is denied only leaves such a transaction to the
// timeout: it is not an error.
func (t *Txn) sweep(ctx context.Context, id string) {
	log := t.r.log.With(zap.String("transactional_id", id))
	described, err := t.r.admin.DescribeTransactions(ctx, id)
	if err != nil {
		log.Debug("cannot look for an open Kafka transaction of a second producer", zap.Error(err))
		return
	}
	if d := described[id]; d.Err != nil || d.State != "Ongoing" {
		return
	}
	cl, err := kgo.NewClient(append(t.opts[:len(t.opts):len(t.opts)], kgo.TransactionalID(id), kgo.TransactionTimeout(t.r.cfg.TransactionTimeout))...)
	if err == nil {
		_, _, err = cl.ProducerID(ctx)
		cl.Close()
	}
	if err != nil {
		log.Warn("a second transactional producer's Kafka transaction is open (a relay ran with router.Config.TxnProducers 2) and could not be aborted: read_committed consumers of its partitions wait for the broker's transaction timeout", zap.Error(err))
		return
	}
	log.Info("aborted the Kafka transaction a second transactional producer left open (a relay ran with router.Config.TxnProducers 2)")
}

// initLane takes lane l's transactional id.
func (t *Txn) initLane(ctx context.Context, l *lane) error {
	r := t.r
	if _, _, err := l.client.ProducerID(ctx); err != nil {
		t.broken.Store(true)
		if d := r.denial(err, ""); d != nil {
			if d.Resource == resourceTxnID {
				d.Name = l.id
			}
			if l.n > 0 {
				return d // Init falls back to one lane
			}
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
		return classify(fmt.Errorf("initialize transactional producer %q: %w", l.id, err))
	}
	r.granted(resourceTxnID, l.id)
	return nil
}

// Lanes is how many transactional producers take turns: Config's
// TxnProducers, or 1 after Init found the second id denied.
func (t *Txn) Lanes() int { return len(t.lanes) }

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

// ReadCheckpoint returns the newest committed checkpoint record for key,
// whichever lane committed it. It commits a probe record (key
// "<key>/probe") in a transaction of its own and reads the topic
// read_committed up to the probe: every checkpoint committed before it
// has been seen, whatever transaction markers or aborted records lie in
// between. The reader starts before the probe, so that its connection and
// first fetches overlap the probe's commit (an exactly-once start reads
// the stream ahead into memory until this returns). Call Init first, so
// that no older producer of either id can commit after the probe.
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
	l := t.lane()
	if err := l.client.ProduceSync(ctx, &kgo.Record{Topic: r.cfg.CheckpointTopic, Key: probeKey, Value: probe}).FirstErr(); err != nil {
		_ = t.Abort(context.Background())
		return nil, false, t.error(l, fmt.Errorf("write checkpoint probe: %w", err))
	}
	if err := l.client.EndTransaction(ctx, kgo.TryCommit); err != nil {
		l.open = false
		return nil, false, t.error(l, fmt.Errorf("commit checkpoint probe: %w", err))
	}
	l.open = false
	t.settle(l)
	t.granted()
	return rd.Until(ctx, key, probeKey, probe)
}
