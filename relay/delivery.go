package relay

import (
	"context"
	"time"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router"
)

// delivery is how outbox events reach Kafka, and when their PostgreSQL
// transactions count as acknowledged (the Acker given to Begin is acked).
// It serves one reader (a session's stream, or a snapshot), which calls it
// from its own goroutine: Begin, Event for each outbox event, Commit, in
// order, with Tick at every chance in between; then Close once, which
// returns the only way to wait for what is still in flight. Two
// implementations: atLeastOnce acks a transaction once Kafka has each of
// its records; exactlyOnce produces in Kafka transactions closed by a
// checkpoint record, and acks at their commit.
type delivery interface {
	// Begin starts a PostgreSQL transaction whose commit record is at
	// b.FinalLSN; its events are acked through a.
	Begin(b decoder.Begin, a router.Acker)
	// Event hands over one event of the open transaction, read at lsn.
	// It may wait for room (the reader's wait answers PostgreSQL
	// meanwhile); an error ends the reader.
	Event(ev *decoder.Event, lsn decoder.LSN) error
	// Commit ends the open transaction at end (its commit's end LSN).
	Commit(end decoder.LSN) error
	// Tick lets time-driven work happen (a due Kafka commit); dry says
	// the stream holds nothing more to read right now.
	Tick(now time.Time, dry bool) error
	// Wants says when the reader should call Tick next.
	Wants() wake
	// Close ends what is open: committed when commit (a clean stop),
	// abandoned otherwise. Records already produced stay in flight: the
	// drain waits for them.
	Close(commit bool) (drain, error)
}

// wake is when a delivery wants its next Tick.
type wake uint8

const (
	// wakeScheduled: at the reader's own schedule (status updates).
	wakeScheduled wake = iota
	// wakeSoon: within a tick, whatever the schedule (an open Kafka
	// transaction that must not outlive its interval).
	wakeSoon
	// wakeDry: as soon as the stream runs dry, with dry set (an open
	// Kafka transaction at a PostgreSQL transaction boundary, committed
	// once nothing more would join it).
	wakeDry
)

// drain is what a closed delivery still has in flight.
type drain interface {
	// Flush waits until every record produced is acknowledged or failed,
	// or ctx ends.
	Flush(ctx context.Context) error
	// Inflight is how many records are produced and not yet acknowledged.
	Inflight() int64
}

// sender is what deliveries use of *router.Router: records in, acks out
// through the Acker.
type sender interface {
	Send(ev *decoder.Event, lsn decoder.LSN, a router.Acker) (<-chan struct{}, error)
	drain
}

// kafkaTxn is what exactly-once delivery uses of *router.Txn.
type kafkaTxn interface {
	Open() bool
	Records() int
	Commit(ctx context.Context, key, value []byte) error
	// Settling is non-nil while a commit goes on in the background (two
	// producers taking turns), closed once Kafka answered it; Settle
	// waits for it and returns its outcome.
	Settling() <-chan struct{}
	Settle() error
	Abort(ctx context.Context) error
}

// waitFunc blocks until done is closed while the reader keeps answering
// PostgreSQL (status updates). interruptible also returns early, with the
// reason, when Kafka refused a record or the reader's context ended.
type waitFunc func(done <-chan struct{}, interruptible bool) error

// atLeastOnce acks each record's PostgreSQL transaction once Kafka has it
// (on the producer's promise goroutine).
type atLeastOnce struct {
	p    sender
	wait waitFunc
	acks router.Acker
}

func newAtLeastOnce(p sender, wait waitFunc) *atLeastOnce {
	return &atLeastOnce{p: p, wait: wait}
}

func (d *atLeastOnce) Begin(_ decoder.Begin, a router.Acker) { d.acks = a }

func (d *atLeastOnce) Event(ev *decoder.Event, lsn decoder.LSN) error {
	return send(d.p, d.wait, ev, lsn, d.acks)
}

func (d *atLeastOnce) Commit(decoder.LSN) error   { d.acks = nil; return nil }
func (d *atLeastOnce) Tick(time.Time, bool) error { return nil }
func (d *atLeastOnce) Wants() wake                { return wakeScheduled }
func (d *atLeastOnce) Close(bool) (drain, error)  { return d.p, nil }

// send hands ev to p, waiting (interruptibly) while p asks to.
func send(p sender, wait waitFunc, ev *decoder.Event, lsn decoder.LSN, a router.Acker) error {
	for {
		ch, err := p.Send(ev, lsn, a)
		if err != nil || ch == nil {
			return err
		}
		if err := wait(ch, true); err != nil {
			return err
		}
	}
}
