package inbox

// Unit tests of the partitions' queues and workers (parts.go) with a fake
// batch handler: no database, no broker.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
)

// testConsumer is a Consumer with cfg's defaults and nothing to connect
// to, tracking the partitions 0 to n-1 of topic "t".
func testConsumer(t *testing.T, cfg Config, n int) *Consumer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c := &Consumer{cfg: cfg.WithDefaults(), log: zap.NewNop(), m: newMetrics(nil), parts: map[topicPartition]*part{}, runCtx: ctx}
	c.cond = sync.NewCond(&c.mu)
	c.mu.Lock()
	for i := range n {
		c.newPart("t", int32(i), 0, true)
	}
	c.mu.Unlock()
	return c
}

// records are offsets from..to-1 of partition p of "t", with a value of
// size bytes.
func records(p int32, from, to int64, size int) []*kgo.Record {
	var rs []*kgo.Record
	for o := from; o < to; o++ {
		rs = append(rs, &kgo.Record{Topic: "t", Partition: p, Offset: o, Value: make([]byte, size)})
	}
	return rs
}

// fetches is a poll's result holding recs, by partition.
func fetches(recs ...[]*kgo.Record) kgo.Fetches {
	ft := kgo.FetchTopic{Topic: "t"}
	for _, rs := range recs {
		ft.Partitions = append(ft.Partitions, kgo.FetchPartition{Partition: rs[0].Partition, Records: rs, HighWatermark: rs[len(rs)-1].Offset + 1})
	}
	return kgo.Fetches{{Topics: []kgo.FetchTopic{ft}}}
}

// startWorkers runs c's workers with handle until the test ends.
func startWorkers(t *testing.T, c *Consumer, handle func(*part, []*kgo.Record) []*kgo.Record) {
	var wg sync.WaitGroup
	for range c.cfg.Workers {
		wg.Go(func() { c.work(handle) })
	}
	t.Cleanup(func() {
		c.stopWorkers()
		wg.Wait()
	})
}

func (c *Consumer) partOf(n int32) *part {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.parts[topicPartition{"t", n}]
}

// waitUntil waits for cond, under c.mu, to hold.
func waitUntil(t *testing.T, c *Consumer, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c.mu.Lock()
		ok := cond()
		c.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond) // polling an observable condition
	}
}

// TestWorkersKeepEachPartitionInOrderAndRunPartitionsAtOnce: records of
// eight partitions, handled by four workers in batches of at most five:
// each partition's records in offset order, by one worker at a time, and
// the handler of one partition can wait for another's to start (the
// partitions run in parallel: one at a time, this would never return).
func TestWorkersKeepEachPartitionInOrderAndRunPartitionsAtOnce(t *testing.T) {
	c := testConsumer(t, Config{Workers: 4, MaxBatchRecords: 5}, 8)
	var mu sync.Mutex
	handled := map[int32][]int64{}
	inFlight := map[int32]bool{}
	var overlap []string
	oneStarted, more := make(chan struct{}), make(chan struct{})
	var once, zero sync.Once
	startWorkers(t, c, func(p *part, recs []*kgo.Record) []*kgo.Record {
		mu.Lock()
		if inFlight[p.partition] {
			overlap = append(overlap, fmt.Sprint(p.partition))
		}
		inFlight[p.partition] = true
		mu.Unlock()
		switch p.partition {
		case 0:
			zero.Do(func() {
				select {
				case <-oneStarted:
				case <-time.After(10 * time.Second):
					t.Error("partition 0's batch waited 10s for partition 1's to start: partitions are not handled at once")
				}
				<-more // its next records come, and the others go, while this batch runs
			})
		case 1:
			once.Do(func() { close(oneStarted) })
		}
		if len(recs) > 5 {
			t.Errorf("a batch of %d records, over MaxBatchRecords 5", len(recs))
		}
		mu.Lock()
		for _, r := range recs {
			handled[p.partition] = append(handled[p.partition], r.Offset)
		}
		inFlight[p.partition] = false
		mu.Unlock()
		c.markDone(p, recs[len(recs)-1])
		return nil
	})
	var all [][]*kgo.Record
	for p := range int32(8) {
		all = append(all, records(p, 0, 20, 10))
	}
	c.dispatch(fetches(all...), nil)
	waitUntil(t, c, "partition 0's first batch running", func() bool { return c.parts[topicPartition{"t", 0}].running })
	for p := range int32(8) {
		c.dispatch(fetches(records(p, 20, 40, 10)), nil)
	}
	// Free workers: one could take partition 0 again while its first
	// batch runs, if anything let it.
	waitUntil(t, c, "the other partitions handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for p := range int32(7) {
			n += len(handled[p+1])
		}
		return n == 7*40
	})
	close(more)
	waitUntil(t, c, "every record handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, hs := range handled {
			n += len(hs)
		}
		return n == 8*40
	})
	mu.Lock()
	defer mu.Unlock()
	for p := range int32(8) {
		if got := handled[p]; len(got) != 40 || !slices.IsSorted(got) {
			t.Errorf("partition %d handled %v, want offsets 0 to 39 in order", p, got)
		}
	}
	if len(overlap) > 0 {
		t.Errorf("partitions %v were handled by two workers at once", overlap)
	}
}

// TestBatchLen: a batch takes up to MaxBatchRecords records and
// MaxBatchBytes of keys and values, and always at least one record.
func TestBatchLen(t *testing.T) {
	rs := records(0, 0, 10, 100)
	for _, c := range []struct{ maxRecords, maxBytes, want int }{
		{500, 1 << 20, 10}, {3, 1 << 20, 3}, {500, 250, 2}, {500, 50, 1}, {1, 1 << 20, 1},
	} {
		if got := batchLen(rs, c.maxRecords, c.maxBytes); got != c.want {
			t.Errorf("batchLen(10 records of 100 bytes, %d, %d) = %d, want %d", c.maxRecords, c.maxBytes, got, c.want)
		}
	}
}

// TestCutBatchGoesBackToTheHead: the records a batch did not get to
// (MaxBatchTime ran out) are the partition's next, before those read
// since.
func TestCutBatchGoesBackToTheHead(t *testing.T) {
	c := testConsumer(t, Config{Workers: 1, MaxBatchRecords: 10}, 1)
	var mu sync.Mutex
	var handled []int64
	first := true
	release := make(chan struct{})
	startWorkers(t, c, func(p *part, recs []*kgo.Record) []*kgo.Record {
		mu.Lock()
		cut := first
		first = false
		mu.Unlock()
		if cut {
			<-release // meanwhile more records come
			recs, rest := recs[:3], recs[3:]
			mu.Lock()
			handled = append(handled, offsets(recs)...)
			mu.Unlock()
			return rest
		}
		mu.Lock()
		handled = append(handled, offsets(recs)...)
		mu.Unlock()
		c.markDone(p, recs[len(recs)-1])
		return nil
	})
	c.dispatch(fetches(records(0, 0, 10, 1)), nil)
	waitUntil(t, c, "the first batch running", func() bool { return c.parts[topicPartition{"t", 0}].running })
	c.dispatch(fetches(records(0, 10, 15, 1)), nil)
	close(release)
	waitUntil(t, c, "offset 14 handled", func() bool {
		p := c.parts[topicPartition{"t", 0}]
		return p.done != nil && p.done.Offset == 14
	})
	mu.Lock()
	defer mu.Unlock()
	if want := offsets(records(0, 0, 15, 1)); !slices.Equal(handled, want) {
		t.Errorf("handled %v, want %v", handled, want)
	}
}

func offsets(rs []*kgo.Record) []int64 {
	var os []int64
	for _, r := range rs {
		os = append(os, r.Offset)
	}
	return os
}

// TestRevokeWaitsForTheBatchInFlight: a revoke returns only after the
// partition's batch in flight, with that batch's offset to commit, drops
// what was read ahead for it, and starts no batch of it again.
func TestRevokeWaitsForTheBatchInFlight(t *testing.T) {
	c := testConsumer(t, Config{Workers: 2, MaxBatchRecords: 5}, 2)
	entered, release := make(chan struct{}), make(chan struct{})
	var mu sync.Mutex
	var after []int64 // partition 0's offsets handled after the revoke began
	revoking := false
	startWorkers(t, c, func(p *part, recs []*kgo.Record) []*kgo.Record {
		if p.partition == 0 {
			mu.Lock()
			if revoking {
				after = append(after, offsets(recs)...)
			}
			mu.Unlock()
			if recs[0].Offset == 0 {
				close(entered)
				<-release
			}
		}
		c.markDone(p, recs[len(recs)-1])
		return nil
	})
	var unblock sync.Once
	t.Cleanup(func() { unblock.Do(func() { close(release) }) }) // before the workers' cleanup
	c.dispatch(fetches(records(0, 0, 20, 1), records(1, 0, 20, 1)), nil)
	<-entered
	p0 := c.partOf(0)
	got := make(chan []*part, 1)
	mu.Lock()
	revoking = true
	mu.Unlock()
	go func() { got <- c.giveUp(map[string][]int32{"t": {0}}, false) }()
	waitUntil(t, c, "the revoke to mark partition 0 gone", func() bool { return p0.gone })
	select {
	case <-got:
		t.Fatal("the revoke returned while partition 0's batch was in flight")
	default:
	}
	unblock.Do(func() { close(release) })
	parts := <-got
	if len(parts) != 1 || parts[0].done == nil || parts[0].done.Offset != 4 {
		t.Fatalf("revoke returned %+v, want partition 0 with its first batch's last offset, 4, to commit", parts)
	}
	waitUntil(t, c, "partition 1 handled", func() bool {
		p := c.parts[topicPartition{"t", 1}]
		return p.done != nil && p.done.Offset == 19
	})
	mu.Lock()
	defer mu.Unlock()
	if len(after) > 0 || c.partOf(0) != nil {
		t.Errorf("after the revoke, partition 0's offsets %v were handled (tracked: %v)", after, c.partOf(0) != nil)
	}
	if c.held != 0 {
		t.Errorf("%d records still counted as read ahead", c.held)
	}
}

// TestLostCancelsTheBatchAndRecordsNothing: a lost partition's batch in
// flight is cancelled, and what it records is not committed for a
// partition another member owns now.
func TestLostCancelsTheBatchAndRecordsNothing(t *testing.T) {
	c := testConsumer(t, Config{Workers: 1}, 1)
	entered := make(chan struct{})
	startWorkers(t, c, func(p *part, recs []*kgo.Record) []*kgo.Record {
		close(entered)
		<-p.ctx.Done()
		c.markDone(p, recs[len(recs)-1]) // as a commit that went through anyway
		return nil
	})
	c.dispatch(fetches(records(0, 0, 3, 1)), nil)
	<-entered
	parts := c.giveUp(map[string][]int32{"t": {0}}, true)
	if len(parts) != 1 || parts[0].done != nil {
		t.Fatalf("lost returned %+v, want partition 0 with nothing to commit", parts)
	}
}

// TestMovedPartitionWaitsForItsRewind: a partition whose transaction
// found its position moved drops what was read ahead, takes no records
// until the polling goroutine rewound it, and wakes it once idle.
func TestMovedPartitionWaitsForItsRewind(t *testing.T) {
	c := testConsumer(t, Config{Workers: 1}, 1)
	woken := make(chan struct{}, 10)
	c.wake = func() { woken <- struct{}{} }
	var mu sync.Mutex
	var handled []int64
	startWorkers(t, c, func(p *part, recs []*kgo.Record) []*kgo.Record {
		mu.Lock()
		handled = append(handled, offsets(recs)...)
		first := len(handled) == len(recs)
		mu.Unlock()
		if first {
			c.markMoved(p)
		} else {
			c.markDone(p, recs[len(recs)-1])
		}
		return nil
	})
	c.dispatch(fetches(records(0, 0, 2, 1)), nil)
	waitUntil(t, c, "the partition moved and idle", func() bool {
		p := c.parts[topicPartition{"t", 0}]
		return p.moved && !p.running && c.pendingLocked()
	})
	<-woken
	c.dispatch(fetches(records(0, 2, 4, 1)), nil) // read from the position left behind
	p := c.partOf(0)
	c.mu.Lock()
	if len(p.queue) != 0 || c.held != 0 {
		t.Errorf("a moved partition kept %d records (%d read ahead in all)", len(p.queue), c.held)
	}
	// What rewinds does once it sought the database's position.
	p.moved = false
	c.schedule(p)
	c.mu.Unlock()
	c.dispatch(fetches(records(0, 0, 2, 1)), nil)
	waitUntil(t, c, "the records after the rewind handled", func() bool { return p.done != nil && p.done.Offset == 1 })
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(handled, []int64{0, 1, 0, 1}) {
		t.Errorf("handled %v, want 0 1 (moved), then 0 1 again after the rewind", handled)
	}
}

// TestWaitRoom: the polling goroutine reads ahead only while fewer than
// MaxPollRecords records wait, and is let through for pending work.
func TestWaitRoom(t *testing.T) {
	c := testConsumer(t, Config{MaxPollRecords: 5}, 1)
	c.dispatch(fetches(records(0, 0, 5, 1)), nil)
	room := make(chan bool, 1)
	go func() { room <- c.waitRoom(context.Background()) }()
	waitUntil(t, c, "five records waiting", func() bool { return c.held == 5 })
	select {
	case <-room:
		t.Fatal("waitRoom returned with MaxPollRecords waiting")
	default:
	}
	c.mu.Lock()
	c.commitDue = true
	c.kickLocked()
	c.mu.Unlock()
	if <-room {
		t.Error("waitRoom reported room with 5 of 5 records waiting; want false, for the pending commit")
	}
	c.mu.Lock()
	c.commitDue = false
	c.mu.Unlock()
	go func() { room <- c.waitRoom(context.Background()) }()
	p, recs := c.next()
	if p == nil || len(recs) != 5 || !<-room {
		t.Errorf("after a worker took %d records, waitRoom did not report room", len(recs))
	}
}

// TestUnhandledIDs: when a batch commits only its first records, the
// inbox rows it inserted for the others are taken out, except an id
// also handled earlier in the batch (a copy in the same batch).
func TestUnhandledIDs(t *testing.T) {
	items := []*item{{id: "a"}, {id: "b"}, {id: "a"}, {id: "c"}, {id: "d"}, {id: "c"}}
	fresh := map[string]bool{"a": true, "c": true, "d": true} // b was a duplicate
	if got := unhandled(items, 2, fresh); !slices.Equal(got, []string{"c", "d"}) {
		t.Errorf("unhandled after 2 = %v, want [c d]", got)
	}
	if got := distinctIDs(items); !slices.Equal(got, []string{"a", "b", "c", "d"}) {
		t.Errorf("distinctIDs = %v", got)
	}
}
