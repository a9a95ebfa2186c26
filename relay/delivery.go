package relay

import (
	"context"
	"time"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router"
)

// delivery is how a session hands the outbox events of the stream to
// Kafka, and when their PostgreSQL transactions count as acknowledged (the
// checkpoint.Txn given to Begin is acked). The session calls it in stream
// order from its own goroutine: Begin, Event for each outbox insert,
// Commit; Tick at every housekeeping chance in between; Close once when
// the session ends, before Flush. Two implementations: atLeastOnce acks a
// transaction once Kafka has each of its records; exactlyOnce produces in
// Kafka transactions closed by a checkpoint record, and acks at their
// commit.
type delivery interface {
	// Begin starts a PostgreSQL transaction whose commit record is at
	// b.FinalLSN; its events are acked through txn.
	Begin(b decoder.Begin, pgTxn *checkpoint.Txn)
	// Event hands over one event of the open transaction, read at lsn.
	// It may wait for room (answering PostgreSQL meanwhile); an error
	// ends the session.
	Event(ev *decoder.Event, lsn decoder.LSN) error
	// Commit ends the open transaction at end (its commit's end LSN).
	Commit(end decoder.LSN) error
	// Tick lets time-driven work happen (a due Kafka commit).
	Tick(now time.Time) error
	// Busy reports work that wants the next Tick soon, whatever the
	// status update schedule says.
	Busy() bool
	// WantsIdle reports work that is waiting only for the stream to run
	// dry (exactly-once: an open Kafka transaction at a PostgreSQL
	// transaction boundary): the session then asks the stream for a
	// message without waiting, and calls Idle when none is complete.
	WantsIdle() bool
	// Idle says the stream holds nothing more to read right now.
	Idle() error
	// Close ends what is open: commit true on a clean stop, false when
	// the session failed. Records already produced stay in flight.
	Close(commit bool) error
	// Flush waits until every record produced is acknowledged or failed,
	// or ctx ends.
	Flush(ctx context.Context) error
	// Inflight is how many records are produced and not yet acknowledged.
	Inflight() int64
}

// producer is what deliveries use of *router.Router: records in, acks
// out through the Acker, Kafka transactions for exactly-once.
type producer interface {
	Send(ev *decoder.Event, lsn decoder.LSN, a router.Acker) (<-chan struct{}, error)
	Flush(ctx context.Context) error
	Inflight() int64
	KafkaTxnOpen() bool
	KafkaTxnRecords() int
	CommitKafkaTxn(ctx context.Context, key, value []byte) error
	AbortKafkaTxn(ctx context.Context) error
}

// waitFunc blocks until done is closed while the session keeps answering
// PostgreSQL (status updates). interruptible also returns early, with the
// reason, when Kafka refused a record or the session's context ended.
type waitFunc func(done <-chan struct{}, interruptible bool) error

// atLeastOnce is today's send path: each record acks its PostgreSQL
// transaction once Kafka has it (on the producer's promise goroutine).
type atLeastOnce struct {
	p     producer
	wait  waitFunc
	pgTxn *checkpoint.Txn
}

func newAtLeastOnce(p producer, wait waitFunc) *atLeastOnce {
	return &atLeastOnce{p: p, wait: wait}
}

func (d *atLeastOnce) Begin(_ decoder.Begin, pgTxn *checkpoint.Txn) { d.pgTxn = pgTxn }

func (d *atLeastOnce) Event(ev *decoder.Event, lsn decoder.LSN) error {
	return send(d.p, d.wait, ev, lsn, d.pgTxn)
}

func (d *atLeastOnce) Commit(decoder.LSN) error        { d.pgTxn = nil; return nil }
func (d *atLeastOnce) Tick(time.Time) error            { return nil }
func (d *atLeastOnce) Busy() bool                      { return false }
func (d *atLeastOnce) WantsIdle() bool                 { return false }
func (d *atLeastOnce) Idle() error                     { return nil }
func (d *atLeastOnce) Close(bool) error                { return nil }
func (d *atLeastOnce) Flush(ctx context.Context) error { return d.p.Flush(ctx) }
func (d *atLeastOnce) Inflight() int64                 { return d.p.Inflight() }

// send hands ev to p, waiting (interruptibly) while p asks to.
func send(p producer, wait waitFunc, ev *decoder.Event, lsn decoder.LSN, a router.Acker) error {
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
