package router

import (
	"sync/atomic"

	"github.com/walrelay/walrelay/metrics"
)

// gate bounds what is produced and not yet acknowledged, so memory is
// bounded by the producer buffer rather than by transaction size. The
// sending goroutine acquires; promises release from the producer's
// goroutine.
//
// A full gate wakes its waiter only once a quarter of the window is free
// (resume), not at the first release: franz-go finishes a batch's
// promises one by one, and waking the sender at each would hand it one
// record's room at a time, a goroutine switch per event.
type gate struct {
	events, bytes       atomic.Int64
	maxEvents, maxBytes int64
	resumeEvents        int64 // wake the waiter at or below these
	resumeBytes         int64
	waiting             atomic.Bool
	// answered counts the records Kafka answered for, acknowledged or
	// refused: the relay's Kafka watch tells a broker that answers from
	// one that does not by it.
	answered atomic.Uint64
	wake     chan struct{}
	metrics  *metrics.Metrics
}

func (g *gate) init(maxEvents, maxBytes int64, m *metrics.Metrics) {
	g.maxEvents, g.maxBytes = maxEvents, maxBytes
	g.resumeEvents, g.resumeBytes = maxEvents-(maxEvents+3)/4, maxBytes-(maxBytes+3)/4
	g.wake = make(chan struct{}, 1)
	g.metrics = m
}

func (g *gate) full() bool {
	return g.events.Load() >= g.maxEvents || g.bytes.Load() >= g.maxBytes
}

// wait returns nil when there is room, or a channel that receives once a
// quarter of the window is free. The flag is raised before the second
// check, so a release racing with it either is seen by the check or sends
// the wakeup; everything in flight is released in the end, so the
// releases reach resume.
func (g *gate) wait() <-chan struct{} {
	if !g.full() {
		return nil
	}
	g.waiting.Store(true)
	if !g.full() {
		g.waiting.Store(false)
		return nil
	}
	return g.wake
}

func (g *gate) acquire(size int) {
	g.bytes.Add(int64(size))
	g.metrics.InflightEvents.Set(float64(g.events.Add(1)))
}

func (g *gate) release(size int) {
	g.answered.Add(1)
	g.bytes.Add(-int64(size))
	g.metrics.InflightEvents.Set(float64(g.events.Add(-1)))
	if g.waiting.Load() && g.events.Load() <= g.resumeEvents && g.bytes.Load() <= g.resumeBytes &&
		g.waiting.CompareAndSwap(true, false) {
		select {
		case g.wake <- struct{}{}:
		default:
		}
	}
}
