package confirm

import (
	"sync/atomic"
	"time"

	"github.com/walrelay/walrelay/decoder"
)

// Confirmer decides the position one replication stream confirms. It is
// owned by the goroutine reading the stream, but for Txn.Ack.
type Confirmer struct {
	marks *Watermark
	sched *Schedule
	clear *Clearance
	prog  *Progress
	start decoder.LSN
	pos   Position // the newest confirmable position, as Due found it
}

// Config configures a Confirmer.
type Config struct {
	// Start is where the stream started: confirmed already.
	Start decoder.LSN
	// Every is the longest time between two status updates; MinGap the
	// shortest between two that only move the position forward.
	Every, MinGap time.Duration
	// Clearance is the process's publication watch clearance.
	Clearance *Clearance
	// Progress is the process's record of what it confirmed.
	Progress *Progress
	// OnComplete, when set, is called once per transaction with events,
	// on any goroutine, when its last event is acknowledged after its
	// Commit (or its Commit arrives after its last ack).
	OnComplete func(commitTime time.Time)
}

// New is a Confirmer for a stream started at cfg.Start.
func New(cfg Config) *Confirmer {
	var opts []Option
	if cfg.OnComplete != nil {
		opts = append(opts, OnComplete(cfg.OnComplete))
	}
	return &Confirmer{
		marks: NewWatermark(cfg.Start, opts...),
		sched: NewSchedule(cfg.Every, cfg.MinGap),
		clear: cfg.Clearance,
		prog:  cfg.Progress,
		start: cfg.Start,
		pos:   Position{LSN: cfg.Start},
	}
}

// Begin opens a PostgreSQL transaction committed at commitTime; its events
// are acked through the Txn.
func (c *Confirmer) Begin(commitTime time.Time) *Txn { return c.marks.Begin(commitTime) }

// Commit closes t at end, its end LSN.
func (c *Confirmer) Commit(t *Txn, end decoder.LSN) { c.marks.Commit(t, end) }

// Marker queues a position with nothing for the relay before it: a
// keepalive's WAL end or a logical decoding message.
func (c *Confirmer) Marker(lsn decoder.LSN) { c.marks.Marker(lsn) }

// Due returns the position to confirm now and whether an update is due:
// force (the server asked for a reply), the periodic one, or the position
// moved and the minimum gap passed. The position is the newest one
// Kafka's acknowledgements allow, no further than the clearance.
func (c *Confirmer) Due(now time.Time, force bool) (decoder.LSN, bool) {
	pos := c.marks.Advance()
	c.prog.acked(pos.LSN)
	pos.LSN = c.clear.Limit(pos.LSN, c.start)
	c.pos = pos
	return pos.LSN, c.sched.Due(now, pos.LSN, force)
}

// Acknowledged is the newest position Kafka's acknowledgements allow, the
// clearance aside: what a stop asks the publication watch to vouch for
// before its last update.
func (c *Confirmer) Acknowledged() decoder.LSN {
	pos := c.marks.Advance()
	c.prog.acked(pos.LSN)
	return pos.LSN
}

// Sent records that an update confirming lsn went out at now.
func (c *Confirmer) Sent(now time.Time, lsn decoder.LSN) {
	c.sched.Sent(now, lsn)
	c.prog.confirmed.Store(uint64(lsn))
}

// Confirmed is the position of the last update sent on this stream (the
// start before the first).
func (c *Confirmer) Confirmed() decoder.LSN {
	if s := c.sched.Confirmed(); s != 0 {
		return s
	}
	return c.start
}

// Position is the confirmable position Due found last, with the commit
// time of the newest transaction at or before it (for the lag).
func (c *Confirmer) Position() Position { return c.pos }

// Pending reports whether the newest confirmable position is ahead of the
// last one sent: the reader should wake soon to send it.
func (c *Confirmer) Pending() bool { return c.sched.Pending(c.pos.LSN) }

// Next is when the next periodic update is due.
func (c *Confirmer) Next() time.Time { return c.sched.Next() }

// InFlight is how many transactions and markers wait behind the position.
func (c *Confirmer) InFlight() int { return c.marks.InFlight() }

// OldestCommit is the commit time of the oldest transaction waiting
// behind the position, zero when none.
func (c *Confirmer) OldestCommit() time.Time { return c.marks.OldestCommit() }

// Progress is what one process confirmed, across its streams. Safe for
// concurrent use.
type Progress struct {
	confirmed atomic.Uint64 // the newest position sent to PostgreSQL
	ack       atomic.Uint64 // the newest Kafka's acks allowed, sent or not
}

// Confirmed is the newest position this process confirmed (0 before the
// first status update).
func (p *Progress) Confirmed() decoder.LSN { return decoder.LSN(p.confirmed.Load()) }

// Acked is the newest position Kafka's acknowledgements allowed in this
// process, confirmed or not.
func (p *Progress) Acked() decoder.LSN { return decoder.LSN(p.ack.Load()) }

func (p *Progress) acked(lsn decoder.LSN) {
	for v := p.ack.Load(); uint64(lsn) > v && !p.ack.CompareAndSwap(v, uint64(lsn)); v = p.ack.Load() {
	}
}

// Resume is where the next stream starts, the slot being confirmed at
// slot: after what Kafka acknowledged in this process, which a stream that
// ended on a broken connection may not have confirmed (PostgreSQL skips
// transactions that end before the start, and the new stream confirms it
// at once), but no further than the clearance. After a failover (failover:
// the server is on another timeline than the last stream) what this
// process acknowledged and what was cleared belong to the old primary's
// history: both are forgotten, and the stream starts at the slot.
func (p *Progress) Resume(slot decoder.LSN, c *Clearance, failover bool) decoder.LSN {
	if failover {
		p.ack.Store(0)
		c.Forget()
		return slot
	}
	return max(slot, min(decoder.LSN(p.ack.Load()), c.Upto()))
}
