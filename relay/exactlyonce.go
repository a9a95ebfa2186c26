package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// resumePoint is the checkpoint an exactly-once session found at start:
// PostgreSQL may resend from before it (the slot is confirmed after the
// Kafka commit, so a crash in between leaves it behind), and the events it
// covers are skipped.
type resumePoint struct {
	found bool
	ckpt  checkpoint.Durable
}

// readCheckpoint reads the newest committed checkpoint of the slot. It runs
// once the slot is held and before the stream is read: initTransactions
// already fenced any older producer, so the checkpoint cannot move any
// more (answeringServer reads the stream and answers the walsender
// meanwhile).
func (r *Relay) readCheckpoint(ctx context.Context, txn *router.Txn) (resumePoint, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	value, found, err := txn.ReadCheckpoint(ctx, []byte(r.cfg.Slot))
	if err != nil {
		return resumePoint{}, kafkaTxnError(err)
	}
	var d checkpoint.Durable
	if found {
		if d, err = checkpoint.UnmarshalDurable(value); err != nil {
			return resumePoint{}, &fatalError{fmt.Errorf("checkpoint of slot %q: %w", r.cfg.Slot, err)}
		}
	}
	fields := []zap.Field{zap.Bool("found", found), zap.Stringer("checkpoint_lsn", d.LSN)}
	if d.Partial != nil {
		fields = append(fields, zap.Stringer("partial_commit_lsn", d.Partial.CommitLSN), zap.Int("partial_events", d.Partial.Events))
	}
	r.log.Info("exactly-once: resuming after the newest committed checkpoint", fields...)
	return resumePoint{found: found, ckpt: d}, nil
}

// distrust is the checkpoint a session resumes after, given the one it
// found: normally the same, but after a Kafka commit of this process whose
// outcome was not confirmed (a commit cut off by a broker's death) that
// wrote the newer checkpoint found, only once landed has read back that
// the commit landed on every partition it wrote to. On Apache Kafka 4.4 a
// transaction coordinator killed during a commit has been seen to leave
// the transaction committed on the checkpoint's partition and aborted on
// an event partition: skipping by that checkpoint would lose the aborted
// events. Then, or when the outcome cannot be read, the session resumes
// after the last checkpoint whose commit Kafka confirmed: duplicates of
// what did commit, at worst. It also remembers found as the last sure
// checkpoint when nothing is in doubt.
func (m *commitMemory) distrust(ctx context.Context, found resumePoint, landed func(context.Context, *router.CommitUnconfirmed) (bool, error)) resumePoint {
	if !m.unsure {
		m.lastSure = found
		return found
	}
	if !found.found || m.lastSure.found && found.ckpt.LSN == m.lastSure.ckpt.LSN && samePartial(found.ckpt.Partial, m.lastSure.ckpt.Partial) {
		return found // the doubtful commit did not write it
	}
	if m.doubt != nil {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		ok, err := landed(ctx, m.doubt)
		cancel()
		if err == nil && ok {
			m.log.Info("exactly-once: the last Kafka commit's outcome was not confirmed; read back, it landed on every partition: resuming after its checkpoint",
				zap.Stringer("checkpoint_lsn", found.ckpt.LSN), zap.Int("partitions", m.doubt.Partitions()))
			m.lastSure, m.unsure, m.doubt = found, false, nil
			return found
		}
		if err != nil {
			m.log.Warn("exactly-once: could not read back the Kafka commit whose outcome was not confirmed", zap.Error(err))
		}
	}
	m.metrics.UnconfirmedCommits.Inc()
	m.log.Warn("exactly-once: the last Kafka commit's outcome was not confirmed and it did not land on every partition, or could not be read back: resending the events after the last checkpoint whose commit Kafka confirmed, rather than skipping them on the newer one's word (a read_committed consumer may see some twice)",
		zap.Stringer("checkpoint_lsn", found.ckpt.LSN), zap.Stringer("resume_lsn", m.lastSure.ckpt.LSN))
	return m.lastSure
}

// abortHanging runs before the checkpoint is read, after a Kafka commit
// whose outcome was not confirmed: abort (router.Txn.AbortHanging) aborts
// the records of that transaction the coordinator left open, neither
// committed nor aborted, which would otherwise take the fate of this
// session's first transaction on their partitions (read twice, or lost).
// Their events are then resent after the last checkpoint Kafka confirmed.
//
// It never stops the relay: a failure (a partition still without a
// leader after the broker's restart) is tried again for up to
// hangingWait, and then, or at once when READ is denied, the session goes
// on as it did before this check existed, with a warning (a broker
// without DescribeProducers, before Kafka 2.8, fails every time).
func (m *commitMemory) abortHanging(ctx context.Context, abort func(context.Context, *router.CommitUnconfirmed) ([]string, error)) error {
	if !m.unsure || m.doubt == nil {
		return nil
	}
	wait := m.hangingWait
	if wait == 0 {
		wait = 30 * time.Second
	}
	deadline := time.Now().Add(wait)
	for {
		actx, cancel := context.WithDeadline(ctx, deadline)
		where, err := abort(actx, m.doubt)
		cancel()
		if err == nil {
			if len(where) > 0 {
				m.metrics.HangingAborted.Add(float64(len(where)))
				m.log.Warn("exactly-once: Kafka's transaction coordinator left the unconfirmed commit's transaction open on some partitions (it skips the markers of a partition whose leader it cannot find, as when a broker restarts): aborted it there, so that its events are resent once rather than committed with, or lost in, the next transaction; where it did commit, a read_committed consumer may see an event twice",
					zap.Strings("partitions", where))
			}
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, kerr.TopicAuthorizationFailed) || !time.Now().Add(time.Second).Before(deadline) {
			m.log.Warn("exactly-once: cannot tell whether the transaction of the Kafka commit whose outcome was not confirmed is still open on its partitions (DescribeProducers, which needs READ on the event topics and Kafka 2.8 or later): a transaction Kafka's coordinator left open is not aborted, and read_committed consumers may see its events twice",
				zap.Error(err))
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// commitMemory is what this process knows of its exactly-once Kafka
// commits, across sessions: the newest checkpoint Kafka confirmed
// committing (lastSure), and whether a commit's outcome was not confirmed
// since (unsure), with what that commit wrote (doubt) when Kafka was asked
// to commit it. Only the session goroutine (one at a time) touches it.
type commitMemory struct {
	log      *zap.Logger
	metrics  *metrics.Metrics
	lastSure resumePoint
	unsure   bool
	doubt    *router.CommitUnconfirmed
	// hangingWait bounds abortHanging's tries (0: 30 s).
	hangingWait time.Duration
}

// committed hears of a commit Kafka confirmed, of checkpoint d.
func (m *commitMemory) committed(d checkpoint.Durable) {
	m.lastSure, m.unsure, m.doubt = resumePoint{found: true, ckpt: d}, false, nil
}

// unconfirmed hears of a commit whose outcome is not known (err: a
// *router.CommitUnconfirmed names what it wrote, when it got that far).
func (m *commitMemory) unconfirmed(err error) {
	m.unsure, m.doubt = true, nil
	errors.As(err, &m.doubt)
}

func samePartial(a, b *checkpoint.Partial) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

// onThisTimeline cuts the checkpoint found at start where the server's
// timeline forked from the checkpoint's (a failover): past that point the
// old primary's WAL, whose events the checkpoint covers, is not the new
// primary's, and skipping by it would drop the new primary's transactions
// there. Events the old primary published past the fork belong to
// transactions the new primary does not have (a standby that was behind,
// without synchronized_standby_slots): they stay in Kafka, and the log
// says so.
func (r *Relay) onThisTimeline(ctx context.Context, p resumePoint, sys pglogrepl.IdentifySystemResult) (resumePoint, error) {
	if !p.found || p.ckpt.Timeline == 0 || p.ckpt.Timeline == sys.Timeline {
		return p, nil
	}
	if r.cfg.PrimaryURL != "" {
		// Decoding on a standby that was promoted since, or that follows
		// a standby promoted when its primary failed over: its slot is
		// its own (no standby's slot is a synchronized copy one decodes
		// from), so every position the checkpoint names was decoded from
		// this server's WAL, on either side of the fork.
		r.log.Info("exactly-once: the server the slot is on is on a new timeline (the standby was promoted, or follows a new primary after a failover); the checkpoint's positions are this server's WAL and hold",
			zap.Int32("checkpoint_timeline", p.ckpt.Timeline), zap.Int32("timeline", sys.Timeline))
		p.ckpt.Timeline = sys.Timeline
		return p, nil
	}
	switchpoint, err := slot.TimelineSwitch(ctx, r.cfg.PGURL, p.ckpt.Timeline, sys.Timeline)
	if err != nil {
		return p, err
	}
	forked, cut := p.ckpt.Forked(switchpoint)
	if cut {
		r.log.Warn("exactly-once: the checkpoint reaches past the point the server's timeline forked from the old primary's (a failover to a standby that lacked some WAL): events the old primary published after it stay in Kafka, though their transactions are not on the new primary; the new primary's transactions after it are published",
			zap.Int32("checkpoint_timeline", p.ckpt.Timeline), zap.Int32("timeline", sys.Timeline),
			zap.Stringer("checkpoint_lsn", p.ckpt.LSN), zap.Stringer("fork_lsn", switchpoint))
	} else {
		r.log.Info("exactly-once: the server is on a new timeline (a failover); the checkpoint lies before the fork and holds",
			zap.Int32("checkpoint_timeline", p.ckpt.Timeline), zap.Int32("timeline", sys.Timeline), zap.Stringer("fork_lsn", switchpoint))
	}
	forked.Timeline = sys.Timeline
	p.ckpt = forked
	return p, nil
}

// verifyCheckpoint checks the checkpoint found at start against the
// stream's IDENTIFY_SYSTEM result before anything is skipped on its word: a
// checkpoint of another slot or cluster, or ahead of the server's WAL, is
// refused (fatal); one written before walrelay stored the system
// identifier is accepted with a warning.
//
// IDENTIFY_SYSTEM ran before START_REPLICATION took the slot: a relay that
// held the slot until then (and was fenced since) may have committed a
// checkpoint of WAL written after that answer. So a checkpoint ahead of it
// is checked again against the position read now, and refused only if
// still ahead.
func (r *Relay) verifyCheckpoint(ctx context.Context, p resumePoint, sys pglogrepl.IdentifySystemResult) error {
	if !p.found {
		return nil
	}
	if p.ckpt.Timeline != 0 && p.ckpt.Timeline != sys.Timeline {
		return &fatalError{fmt.Errorf("exactly-once: the checkpoint is on timeline %d, the server on %d, and the point they forked is unknown", p.ckpt.Timeline, sys.Timeline)}
	}
	legacy, err := p.ckpt.Verify(r.cfg.Slot, sys.SystemID, sys.XLogPos)
	var ahead *checkpoint.AheadError
	if errors.As(err, &ahead) {
		now, ierr := r.identify(ctx)
		if ierr != nil {
			return fmt.Errorf("exactly-once: the checkpoint is ahead of the WAL position the stream opened at; reading the position again: %w", ierr)
		}
		if now.SystemID != sys.SystemID || now.Timeline != sys.Timeline {
			// A failover while the stream opened: the next session
			// starts on the server as it is now.
			return fmt.Errorf("exactly-once: the server changed while the stream opened (system %s timeline %d, now system %s timeline %d)", sys.SystemID, sys.Timeline, now.SystemID, now.Timeline)
		}
		r.log.Info("exactly-once: the checkpoint is ahead of the WAL position read when the stream opened (another relay committed it while this one waited for the slot); checked against the position now",
			zap.Stringer("checkpoint_lsn", p.ckpt.LSN), zap.Stringer("opened_at", sys.XLogPos), zap.Stringer("server_wal", now.XLogPos))
		legacy, err = p.ckpt.Verify(r.cfg.Slot, now.SystemID, now.XLogPos)
	}
	if err != nil {
		return &fatalError{fmt.Errorf("exactly-once: checkpoint topic %q: %w", r.cfg.Router.CheckpointTopic, err)}
	}
	if legacy {
		r.log.Warn("exactly-once: the checkpoint does not name its PostgreSQL system (written by an older walrelay); trusting it once, the next checkpoint will",
			zap.String("slot", r.cfg.Slot), zap.Stringer("checkpoint_lsn", p.ckpt.LSN), zap.String("system_id", sys.SystemID))
	}
	return nil
}

// kafkaTxnFailure is a failed Kafka transaction (begin, commit, abort, checkpoint
// read): the session ends and the next resumes from the last checkpoint.
type kafkaTxnFailure struct{ err error }

func (e *kafkaTxnFailure) Error() string { return e.err.Error() }
func (e *kafkaTxnFailure) Unwrap() error { return e.err }

// kafkaTxnError marks err as a failed Kafka transaction's. A fenced one
// (router.ErrFenced) is returned as is: the session's end decides, knowing
// whether the relay still holds the slot, whether to stop (afterFence).
func kafkaTxnError(err error) error {
	if err == nil || errors.Is(err, router.ErrFenced) {
		return err
	}
	return &kafkaTxnFailure{err}
}

// exactlyOnce delivers through Kafka transactions. Each is closed by a
// checkpoint record saying exactly how far it reaches in the PostgreSQL
// stream, and a PostgreSQL transaction is acked (the slot may move past
// it) only when the Kafka transactions holding its events committed.
// Events the checkpoint found at start covers are skipped.
type exactlyOnce struct {
	p        sender
	txn      kafkaTxn
	wait     waitFunc
	kafkaCtx func() (context.Context, context.CancelFunc) // bounds a commit or an abort
	// failed classifies a failed Kafka transaction: kafkaTxnError for a
	// session, which afterFence then judges; the snapshot's is fatal when
	// fenced.
	failed func(error) error
	// committed and unconfirmed, when set, hear of each commit that
	// Kafka confirmed and of each whose outcome is unknown (see
	// Relay.distrust).
	committed   func(checkpoint.Durable)
	unconfirmed func(error)
	metrics     *metrics.Metrics
	slot        string
	systemID    string // the PostgreSQL system identifier, written in every checkpoint
	timeline    int32  // and the timeline the stream's LSNs are on
	key         []byte // checkpoint record key: the slot name

	// A Kafka transaction commits as soon as the stream runs dry at a
	// PostgreSQL transaction boundary (Tick with dry), so a commit is
	// visible within a Kafka round trip at low rates; under load the
	// stream never runs dry between commits and the transactions grow.
	// These bound it.
	maxEvents   int           // commit once the Kafka transaction holds this many events
	maxInterval time.Duration // or is this old
	minInterval time.Duration // a dry stream commits only a transaction this old

	acks      router.Acker     // the PostgreSQL transaction in progress
	skip      *checkpoint.Skip // what the checkpoint found at start covers
	lastFull  decoder.LSN      // end LSN of the newest PostgreSQL transaction wholly in Kafka transactions
	curCommit decoder.LSN      // commit LSN of the PostgreSQL transaction in progress
	curEvents int              // its outbox events so far, sent or skipped
	inPG      bool             // between a Begin and its Commit
	txnStart  time.Time        // when the open Kafka transaction began

	// flying is the checkpoint of the commit going on in the background
	// (kafkaTxn.Settling), and flyingEnd ends its context once settled.
	flying    *checkpoint.Durable
	flyingEnd context.CancelFunc
}

// newExactlyOnce is exactly-once delivery through p and txn, resuming
// after the checkpoint found at start, on the system and timeline of sys,
// waiting with wait and bounding commits with kafkaCtx.
func (r *Relay) newExactlyOnce(p sender, txn kafkaTxn, resume resumePoint, sys pglogrepl.IdentifySystemResult,
	wait waitFunc, kafkaCtx func() (context.Context, context.CancelFunc)) *exactlyOnce {
	return &exactlyOnce{
		p: p, txn: txn, wait: wait, kafkaCtx: kafkaCtx, failed: kafkaTxnError, metrics: r.metrics,
		slot: r.cfg.Slot, systemID: sys.SystemID, timeline: sys.Timeline, key: []byte(r.cfg.Slot),
		maxEvents: r.cfg.TxnMaxEvents, maxInterval: r.cfg.TxnMaxInterval, minInterval: r.cfg.TxnMinInterval,
		skip: checkpoint.NewSkip(resume.ckpt, resume.found), lastFull: resume.ckpt.LSN,
	}
}

func (e *exactlyOnce) Begin(b decoder.Begin, a router.Acker) {
	e.acks = a
	e.skip.Begin(b.FinalLSN)
	e.curCommit, e.curEvents, e.inPG = b.FinalLSN, 0, true
}

func (e *exactlyOnce) Event(ev *decoder.Event, lsn decoder.LSN) error {
	if e.skip.Event() {
		e.curEvents++
		return nil // in Kafka already, by the checkpoint found at start
	}
	if err := e.send(ev, lsn); err != nil {
		if errors.Is(err, router.ErrFenced) {
			return e.failed(err)
		}
		return err
	}
	// Counted once in the Kafka transaction, not before: a stop while
	// waiting for room commits a checkpoint that must not claim an event
	// never sent.
	e.curEvents++
	if e.txn.Records() >= e.maxEvents {
		return e.commit() // a large transaction is split across Kafka transactions
	}
	return nil
}

// send hands ev to the producer, waiting while it asks to. A wait can
// last: a topic Kafka's authorizer denies the relay holds its event until
// an ACL allows it. The open Kafka transaction does not wait with it past
// its interval: it commits what it holds (a partial checkpoint when
// mid-transaction, as a split does), so the events before the held one
// become visible and the broker never times the transaction out.
func (e *exactlyOnce) send(ev *decoder.Event, lsn decoder.LSN) error {
	for {
		if !e.txn.Open() {
			e.txnStart = time.Now()
		}
		ch, err := e.p.Send(ev, lsn, e.acks)
		if err != nil || ch == nil {
			return err
		}
		if e.txn.Open() {
			due := time.Until(e.txnStart.Add(e.maxInterval))
			if due <= 0 {
				if err := e.commit(); err != nil {
					return err
				}
				continue
			}
			var stop func()
			ch, stop = untilOrAfter(ch, due)
			err = e.wait(ch, true)
			stop()
		} else {
			err = e.wait(ch, true)
		}
		if err != nil {
			return err
		}
	}
}

// untilOrAfter returns a channel closed when ch delivers or d has
// passed, whichever comes first, and a function that releases it.
func untilOrAfter(ch <-chan struct{}, d time.Duration) (<-chan struct{}, func()) {
	out := make(chan struct{})
	stop := make(chan struct{})
	timer := time.NewTimer(d)
	go func() {
		defer close(out)
		select {
		case <-ch:
		case <-timer.C:
		case <-stop:
		}
	}()
	return out, func() { timer.Stop(); close(stop) }
}

func (e *exactlyOnce) Commit(end decoder.LSN) error {
	e.acks = nil
	e.lastFull, e.curEvents, e.inPG = end, 0, false
	return e.Tick(time.Now(), false)
}

// Tick commits the open Kafka transaction when it is due (its bounds), or
// when the stream ran dry at a PostgreSQL transaction boundary: nothing
// more is there to join it, so waiting for the interval would only delay
// it. Mid-transaction it waits for the rest (or the bounds). At most one
// commit is in flight: with one producer the commit is synchronous, and
// what arrives meanwhile waits in the socket and joins the next one; with
// two, the next one's records go to the other producer meanwhile, and its
// commit waits for this one's answer. Tick also collects the answer of a
// commit in the background once it came.
func (e *exactlyOnce) Tick(now time.Time, dry bool) error {
	if e.flying != nil && isClosed(e.txn.Settling()) {
		if err := e.settle(); err != nil {
			return err
		}
	}
	if e.commitDue(now) || dry && e.Wants() == wakeDry {
		return e.commit()
	}
	return nil
}

// isClosed reports whether ch is closed (a nil channel is not).
func isClosed(ch <-chan struct{}) bool {
	if ch == nil {
		return false
	}
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Wants is wakeDry between PostgreSQL transactions while a Kafka
// transaction is open (and minInterval old): it commits as soon as nothing
// more is waiting; wakeSoon while a younger one is open, so that its
// bounds are looked at within a tick. The clock is read only when
// minInterval is set.
func (e *exactlyOnce) Wants() wake {
	switch {
	case !e.txn.Open() && e.flying != nil:
		return wakeSoon // to collect the commit's answer (Tick)
	case !e.txn.Open():
		return wakeScheduled
	case !e.inPG && (e.minInterval <= 0 || time.Since(e.txnStart) >= e.minInterval):
		return wakeDry
	default:
		return wakeSoon
	}
}

// Close ends the open Kafka transaction: committed when the relay stops
// cleanly, aborted otherwise (the next session resends from the last
// checkpoint). Nothing else is in flight after.
func (e *exactlyOnce) Close(commit bool) (drain, error) {
	if commit && e.txn.Open() {
		if err := e.commit(); err != nil {
			return e.p, err
		}
	}
	settleErr := e.settle()
	if !e.txn.Open() {
		return e.p, settleErr
	}
	ctx, cancel := e.kafkaCtx()
	defer cancel()
	if err := e.txn.Abort(ctx); err != nil && settleErr == nil {
		return e.p, e.failed(err)
	}
	return e.p, settleErr
}

// commitDue reports whether the open Kafka transaction should commit now.
func (e *exactlyOnce) commitDue(now time.Time) bool {
	if !e.txn.Open() {
		return false
	}
	return e.txn.Records() >= e.maxEvents || now.Sub(e.txnStart) >= e.maxInterval
}

// commit closes the open Kafka transaction with a checkpoint record saying
// exactly how far it reaches, and waits for the commit while still
// answering PostgreSQL. The commit is never abandoned half-way while the
// relay runs: it waits for Txn.Commit to return, which takes at most the
// transaction timeout, or once the relay stops, until the stop deadline
// (see session.kafkaCtx).
//
// With two producers taking turns, kafkaTxn.Commit hands the commit
// itself to the background once Kafka has the records; the next commit
// (or Tick, or Close) collects its answer first (settle). The commit's
// time (walrelay_kafka_commit_seconds) is then what the relay waited:
// the last commit's answer, the records, the checkpoint.
func (e *exactlyOnce) commit() error {
	began := time.Now()
	if err := e.settle(); err != nil {
		return err
	}
	d := checkpoint.Durable{Slot: e.slot, SystemID: e.systemID, Timeline: e.timeline, LSN: e.lastFull, Time: time.Now()}
	if e.inPG && e.curEvents > 0 {
		d.Partial = &checkpoint.Partial{CommitLSN: e.curCommit, Events: e.curEvents}
	}
	ctx, cancel := e.kafkaCtx()
	done := make(chan struct{})
	var err error
	go func() {
		defer close(done)
		err = e.txn.Commit(ctx, e.key, d.Marshal())
	}()
	_ = e.wait(done, false) // not interruptible: returns once done
	e.metrics.KafkaCommit.Observe(time.Since(began).Seconds())
	if err == nil && e.txn.Settling() != nil {
		e.flying, e.flyingEnd = &d, cancel
		return nil
	}
	cancel()
	return e.answered(d, err)
}

// settle waits for the answer to the commit in the background, if one
// is, while still answering PostgreSQL.
func (e *exactlyOnce) settle() error {
	if e.flying == nil {
		return nil
	}
	d, end := *e.flying, e.flyingEnd
	e.flying, e.flyingEnd = nil, nil
	_ = e.wait(e.txn.Settling(), false) // not interruptible: returns once answered
	err := e.txn.Settle()
	end()
	return e.answered(d, err)
}

// answered hears Kafka's answer (err) to the commit of checkpoint d.
func (e *exactlyOnce) answered(d checkpoint.Durable, err error) error {
	if err != nil {
		if e.unconfirmed != nil {
			e.unconfirmed(err)
		}
		return e.failed(err)
	}
	if e.committed != nil {
		e.committed(d)
	}
	e.metrics.KafkaTransactions.Inc()
	return nil
}
