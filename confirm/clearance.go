package confirm

import (
	"sync/atomic"

	"github.com/walrelay/walrelay/decoder"
)

// Clearance is how far the publication watch found what the slot streams
// from intact, for the life of a process: the watch Vouches, sessions ask
// it to look further (Want) and confirm no further than it vouched for
// (Limit). Safe for concurrent use.
type Clearance struct {
	upto   atomic.Uint64 // vouched for
	wanted atomic.Uint64 // asked for
	wake   chan struct{}
}

// NewClearance is a Clearance that has vouched for nothing yet.
func NewClearance() *Clearance {
	return &Clearance{wake: make(chan struct{}, 1)}
}

// Vouch records that a check found the publication intact up to lsn. It
// never moves back.
func (c *Clearance) Vouch(lsn decoder.LSN) {
	for v := c.upto.Load(); uint64(lsn) > v && !c.upto.CompareAndSwap(v, uint64(lsn)); v = c.upto.Load() {
	}
}

// Upto is the newest position vouched for.
func (c *Clearance) Upto() decoder.LSN { return decoder.LSN(c.upto.Load()) }

// Want asks the watch to vouch for positions up to lsn, waking it.
func (c *Clearance) Want(lsn decoder.LSN) {
	for w := c.wanted.Load(); uint64(lsn) > w && !c.wanted.CompareAndSwap(w, uint64(lsn)); w = c.wanted.Load() {
	}
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// Wanted is the newest position asked for.
func (c *Clearance) Wanted() decoder.LSN { return decoder.LSN(c.wanted.Load()) }

// Wake is signalled after Want: the watch waits on it.
func (c *Clearance) Wake() <-chan struct{} { return c.wake }

// Behind reports whether positions were asked for past what was vouched
// for: the watch has checking to do.
func (c *Clearance) Behind() bool { return c.wanted.Load() > c.upto.Load() }

// Forget drops what was vouched for and asked, after a failover: positions
// of the old primary's history say nothing of the new one's.
func (c *Clearance) Forget() {
	c.upto.Store(0)
	c.wanted.Store(0)
}

// Limit is how far pos may be confirmed: no further than vouched for, nor
// than start (where the stream started, confirmed already). Short of pos,
// it asks the watch to look.
func (c *Clearance) Limit(pos, start decoder.LSN) decoder.LSN {
	v := c.Upto()
	if pos <= max(v, start) {
		return pos
	}
	c.Want(pos)
	return max(v, start)
}
