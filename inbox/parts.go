package inbox

// parts.go: the partitions this member consumes, and the workers that
// handle them. The polling goroutine appends each partition's records to
// the partition's queue; Config.Workers goroutines each take a partition
// whose queue is not empty, handle a batch of its records (one
// transaction), and put it back at the end of the line if more came
// meanwhile. A partition is handled by one worker at a time, in offset
// order, so the records of one key (one aggregate) are applied in the
// order they were produced; different partitions run in parallel.
//
// A revoked or lost partition is marked gone: its queue is dropped (the
// next owner reads those records from the database's position), no batch
// of it starts again, and the callback waits for the one in flight.
// Everything here is guarded by Consumer.mu.

import (
	"context"
	"slices"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// part is one partition this member consumes.
type part struct {
	topic     string
	partition int32
	// ctx ends when Run's does, or when the partition is lost.
	ctx    context.Context
	cancel context.CancelFunc

	queue []*kgo.Record // read, not handled yet
	hwm   int64         // the partition's high watermark at the last fetch

	running bool // a worker handles a batch of it
	ready   bool // in Consumer.ready
	gone    bool // revoked or lost: no batch starts again
	lost    bool // lost: what its batch in flight commits is not recorded
	// hold: the polling goroutine checks its position against the
	// database's; no batch starts meanwhile.
	hold bool
	// moved: a transaction found the database's position elsewhere than
	// this member left it; its records are dropped until the polling
	// goroutine has rewound it.
	moved bool

	// pos is the next offset the offsets table holds as far as this
	// member knows: read at assignment, moved by each of its
	// transactions; known is false while there is no row.
	pos   int64
	known bool
	// done is the last record handled whose offset Kafka was not given
	// yet; follow, a database position Kafka's committed offset must be
	// moved to though no record was handled since (the partition started
	// or was rewound there).
	done      *kgo.Record
	follow    int64
	following bool
}

type topicPartition struct {
	topic     string
	partition int32
}

// newPart starts tracking a partition assigned to this member, in place of
// any earlier one of the same partition.
func (c *Consumer) newPart(topic string, partition int32, pos int64, known bool) *part {
	ctx, cancel := context.WithCancel(c.runCtx)
	p := &part{topic: topic, partition: partition, ctx: ctx, cancel: cancel, pos: pos, known: known}
	tp := topicPartition{topic, partition}
	if old := c.parts[tp]; old != nil {
		c.dropLocked(old)
		old.gone = true
		old.cancel()
	}
	c.parts[tp] = p
	return p
}

// dispatch appends a poll's records to their partitions' queues. Records
// of a partition no longer assigned, moved, or rewound by this poll's
// caller (skip: they were fetched from the position left behind) are
// dropped.
func (c *Consumer) dispatch(fs kgo.Fetches, skip map[topicPartition]bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	fs.EachPartition(func(fp kgo.FetchTopicPartition) {
		if len(fp.Records) == 0 {
			return
		}
		tp := topicPartition{fp.Topic, fp.Partition}
		p := c.parts[tp]
		if p == nil {
			// Assigned without adjust's knowing (it sees every assigned
			// partition): with no position known, its first transaction
			// finds the database's, if any, and rewinds there.
			p = c.newPart(fp.Topic, fp.Partition, 0, false)
		}
		if p.gone || p.moved || skip[tp] {
			return
		}
		p.queue = append(p.queue, fp.Records...)
		p.hwm = fp.HighWatermark
		c.held += len(fp.Records)
		c.schedule(p)
	})
}

// schedule puts p in line for a worker if it has records and nothing
// stops it.
func (c *Consumer) schedule(p *part) {
	if p.running || p.ready || p.gone || p.hold || p.moved || len(p.queue) == 0 {
		return
	}
	p.ready = true
	c.ready = append(c.ready, p)
	c.cond.Broadcast()
}

// next waits for a partition with records and takes a batch of them:
// up to Config.MaxBatchRecords, and Config.MaxBatchBytes of keys and
// values (at least one record). It returns nil once the workers stop.
func (c *Consumer) next() (*part, []*kgo.Record) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		for len(c.ready) == 0 && !c.stopping {
			c.cond.Wait()
		}
		if c.stopping {
			return nil, nil
		}
		p := c.ready[0]
		c.ready = c.ready[1:]
		p.ready = false
		if p.running || p.gone || p.hold || p.moved || len(p.queue) == 0 {
			continue
		}
		n := batchLen(p.queue, c.cfg.MaxBatchRecords, c.cfg.MaxBatchBytes)
		recs := slices.Clone(p.queue[:n])
		p.queue = slices.Delete(p.queue, 0, n)
		c.held -= n
		p.running = true
		c.cond.Broadcast() // room for the polling goroutine
		return p, recs
	}
}

// batchLen is how many of the queue's first records one batch takes.
func batchLen(queue []*kgo.Record, maxRecords, maxBytes int) int {
	n, size := 0, 0
	for n < len(queue) && n < maxRecords {
		size += len(queue[n].Key) + len(queue[n].Value)
		if n > 0 && size > maxBytes {
			break
		}
		n++
	}
	return n
}

// release ends p's batch: rest, the records it did not get to (a batch
// cut by Config.MaxBatchTime), go back to the head of the queue unless
// the partition is gone or moved meanwhile.
func (c *Consumer) release(p *part, rest []*kgo.Record) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p.running = false
	if len(rest) > 0 && !p.gone && !p.moved {
		p.queue = append(rest, p.queue...)
		c.held += len(rest)
	}
	c.schedule(p)
	if p.moved && !p.gone {
		c.kickLocked() // the polling goroutine rewinds it now that it is idle
	}
	c.cond.Broadcast() // a callback or the polling goroutine may wait for it
}

// work is one worker: it handles batches until the workers stop.
func (c *Consumer) work(handle func(*part, []*kgo.Record) []*kgo.Record) {
	for {
		p, recs := c.next()
		if p == nil {
			return
		}
		c.release(p, handle(p, recs))
	}
}

// stopWorkers has idle workers return; busy ones return after their
// batch, which Run's context ending cuts short.
func (c *Consumer) stopWorkers() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopping = true
	c.cond.Broadcast()
}

// dropLocked drops p's queue.
func (c *Consumer) dropLocked(p *part) {
	c.held -= len(p.queue)
	p.queue = nil
	c.cond.Broadcast()
}

// idleLocked waits until no batch of p is in flight.
func (c *Consumer) idleLocked(p *part) {
	for p.running {
		c.cond.Wait()
	}
}

// giveUp marks the partitions gone, drops what was read ahead for them,
// waits for their batches in flight (lost: after cancelling them, for
// another member may be handling the partition already, and recording
// nothing of them) and stops tracking them. It returns them, with what
// their batches recorded.
func (c *Consumer) giveUp(ps map[string][]int32, lost bool) []*part {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*part
	for t, parts := range ps {
		for _, n := range parts {
			p := c.parts[topicPartition{t, n}]
			if p == nil {
				continue
			}
			p.gone = true
			c.dropLocked(p)
			if lost {
				p.lost = true
				p.cancel()
			}
			out = append(out, p)
		}
	}
	for _, p := range out {
		c.idleLocked(p)
		p.cancel()
		delete(c.parts, topicPartition{p.topic, p.partition})
	}
	return out
}

// markDone records that r and everything before it in its partition was
// handled (committed, a duplicate or dead-lettered): its offset goes to
// Kafka with the next commit.
func (c *Consumer) markDone(p *part, r *kgo.Record) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p.lost {
		return
	}
	p.done = r
	p.following = false // the record's offset is later
	lag := max(0, p.hwm-r.Offset-1)
	c.m.lag.WithLabelValues(c.cfg.Name, p.topic, itoa(p.partition)).Set(float64(lag))
	c.commitSoonLocked()
}

// markMoved records that a transaction of p found the database's position
// elsewhere than this member left it: its records are dropped until the
// polling goroutine, woken, rewinds it.
func (c *Consumer) markMoved(p *part) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p.gone {
		return
	}
	p.moved = true
	c.dropLocked(p)
	c.kickLocked()
}

// commitSoonLocked has the polling goroutine commit Kafka offsets within
// Config.CommitInterval of the last commit.
func (c *Consumer) commitSoonLocked() {
	if c.commitDue || c.commitTimer != nil {
		return
	}
	wait := c.cfg.CommitInterval - time.Since(c.lastCommit)
	if wait <= 0 {
		c.commitDue = true
		c.kickLocked()
		return
	}
	c.commitTimer = time.AfterFunc(wait, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.commitTimer = nil
		c.commitDue = true
		c.kickLocked()
	})
}

// kickLocked wakes the polling goroutine: work that needs rebalances
// blocked (a commit, a rewind) is waiting.
func (c *Consumer) kickLocked() {
	if c.wake != nil {
		c.wake()
	}
	c.cond.Broadcast()
}

// pendingLocked reports whether the polling goroutine has work to do
// with rebalances blocked.
func (c *Consumer) pendingLocked() bool {
	if c.commitDue || len(c.suspects) > 0 {
		return true
	}
	for _, p := range c.parts {
		if p.moved && !p.running {
			return true
		}
	}
	return false
}

// waitRoom waits until fewer than Config.MaxPollRecords records are
// read ahead (true), or work that needs rebalances blocked is pending, or
// ctx ends (false).
func (c *Consumer) waitRoom(ctx context.Context) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		if ctx.Err() != nil {
			return false
		}
		if c.held < c.cfg.MaxPollRecords {
			return true
		}
		if c.pendingLocked() {
			return false
		}
		c.cond.Wait()
	}
}

func itoa(n int32) string { return strconv.Itoa(int(n)) }
