package confirm

import (
	"sync/atomic"
	"time"

	"github.com/walrelay/walrelay/decoder"
)

// Position is a confirmable point in the stream: an LSN and the commit time
// of the newest transaction at or before it (zero when it is only a
// keepalive marker that no transaction preceded).
type Position struct {
	LSN        decoder.LSN
	CommitTime time.Time
}

// Txn is one PostgreSQL transaction whose events are in flight, or a
// keepalive marker. It is the router.Acker of its events.
type Txn struct {
	// pending counts unacknowledged events plus one while the transaction
	// is open (its Commit not yet seen). It reaches zero exactly once.
	pending    atomic.Int64
	events     int // written by the owner only, before the atomic ops that publish it
	end        decoder.LSN
	commitTime time.Time
	marker     bool
	tracker    *Watermark
}

// Add records that one more event of t was handed to the producer. Call it
// before handing the event over, so an early ack cannot complete t.
func (t *Txn) Add() {
	t.events++
	t.pending.Add(1)
}

// Ack records that one event of t was acknowledged by Kafka. It is safe for
// concurrent use. Calling it more often than Add is a bug and panics, since
// it would confirm a position whose events are not all acknowledged.
func (t *Txn) Ack() {
	n := t.pending.Add(-1)
	switch {
	case n == 0:
		t.tracker.complete(t)
	case n < 0:
		panic("checkpoint: more acks than events")
	}
}

// Watermark keeps the in-flight transactions in commit order and computes
// the position Kafka's acknowledgements allow: the end LSN of the newest
// transaction that is complete together with every transaction before it
// (acks arrive in any order across partitions; the watermark never jumps a
// gap). Keepalive positions are markers queued behind the data received
// before them, never shortcuts past events still in flight.
//
// Begin, Commit, Marker and Advance belong to the goroutine that reads the
// replication stream; Txn.Ack may be called from any goroutine (the
// producer's promises): it touches only an atomic counter.
type Watermark struct {
	queue     []*Txn // in commit order; head at queue[0]
	confirmed Position
	onDone    func(commitTime time.Time)
}

// Option configures a Watermark.
type Option func(*Watermark)

// OnComplete registers fn, called once per transaction with events when its
// last event is acknowledged after its Commit (or its Commit arrives after
// its last ack). It may run on any goroutine; walrelay uses it for the
// commit-to-ack latency histogram.
func OnComplete(fn func(commitTime time.Time)) Option {
	return func(t *Watermark) { t.onDone = fn }
}

// NewWatermark returns a Watermark that starts at start, the position the
// stream was started from (everything before it is already confirmed).
func NewWatermark(start decoder.LSN, opts ...Option) *Watermark {
	t := &Watermark{confirmed: Position{LSN: start}}
	for _, o := range opts {
		o(t)
	}
	return t
}

// Begin opens a transaction. commitTime comes from the Begin message
// (pgoutput announces it up front because it sends only committed
// transactions).
func (tr *Watermark) Begin(commitTime time.Time) *Txn {
	t := &Txn{commitTime: commitTime, tracker: tr}
	t.pending.Store(1)
	tr.queue = append(tr.queue, t)
	return t
}

// Commit closes t: its end LSN (CommitMessage.TransactionEndLSN, never the
// commit record's start) becomes confirmable once all of its events, and all
// earlier transactions, are acknowledged.
func (tr *Watermark) Commit(t *Txn, end decoder.LSN) {
	// The store of end happens before the decrement; Advance reads end
	// only after observing pending == 0, so the atomic orders them.
	t.end = end
	if t.pending.Add(-1) == 0 {
		tr.complete(t)
	}
}

// complete runs once per transaction, on whichever goroutine brought its
// pending count to zero.
func (tr *Watermark) complete(t *Txn) {
	if tr.onDone != nil && t.events > 0 {
		tr.onDone(t.commitTime)
	}
}

// Marker queues a keepalive's WAL end behind everything received so far.
// It becomes confirmable once every transaction before it is complete; with
// nothing in flight that is at once. A keepalive may arrive in the middle of
// a transaction; its marker then waits for that transaction too.
func (tr *Watermark) Marker(walEnd decoder.LSN) {
	n := len(tr.queue)
	if n == 0 {
		if walEnd > tr.confirmed.LSN {
			tr.confirmed.LSN = walEnd
		}
		return
	}
	if last := tr.queue[n-1]; last.marker {
		// Consecutive markers collapse into the newest: the queue grows
		// with transactions, not with keepalives.
		if walEnd > last.end {
			last.end = walEnd
		}
		return
	}
	tr.queue = append(tr.queue, &Txn{end: walEnd, marker: true, tracker: tr})
}

// Advance pops every complete transaction at the head of the queue and
// returns the watermark. The watermark never moves backwards.
func (tr *Watermark) Advance() Position {
	i := 0
	for ; i < len(tr.queue); i++ {
		t := tr.queue[i]
		if t.pending.Load() != 0 {
			break
		}
		if t.end > tr.confirmed.LSN {
			tr.confirmed.LSN = t.end
		}
		if !t.marker {
			tr.confirmed.CommitTime = t.commitTime
		}
	}
	if i > 0 {
		n := copy(tr.queue, tr.queue[i:])
		clear(tr.queue[n:])
		tr.queue = tr.queue[:n]
	}
	return tr.confirmed
}

// Confirmed returns the watermark computed by the last Advance.
func (tr *Watermark) Confirmed() Position { return tr.confirmed }

// OldestCommit returns the commit time of the oldest transaction queued
// behind the watermark, or zero when only markers (or nothing) are queued.
func (tr *Watermark) OldestCommit() time.Time {
	for _, t := range tr.queue {
		if !t.marker {
			return t.commitTime
		}
	}
	return time.Time{}
}

// InFlight returns how many transactions and markers are queued behind the
// watermark.
func (tr *Watermark) InFlight() int { return len(tr.queue) }
