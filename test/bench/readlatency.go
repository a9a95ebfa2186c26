package bench

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// commitReader is the consumer both latency scenarios measure with: it
// reads a topic read_committed from its start and keeps, for each record
// stamped at measureFrom or later, the time from its stamp (the commit, or
// the event's due time) to the fetch that returned it.
type commitReader struct {
	cl     *kgo.Client
	cancel context.CancelFunc
	done   chan struct{}
	stop   sync.Once
	seen   atomic.Int64
	mu     sync.Mutex
	lat    []time.Duration
}

// readCommits starts reading topic. Records stamped before ignoreBefore
// (warm-up records) are not counted at all; those before measureFrom are
// counted in Seen but not measured.
func readCommits(ctx context.Context, addrs []string, topic string, measureFrom, ignoreBefore time.Time) (*commitReader, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(10*time.Millisecond),
		kgo.MetadataMinAge(100*time.Millisecond), kgo.MetadataMaxAge(time.Second))
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithCancel(ctx)
	c := &commitReader{cl: cl, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		for cctx.Err() == nil {
			fs := cl.PollFetches(cctx)
			now := time.Now()
			fs.EachRecord(func(r *kgo.Record) {
				if r.Timestamp.Before(ignoreBefore) {
					return
				}
				c.seen.Add(1)
				if r.Timestamp.Before(measureFrom) {
					return
				}
				c.mu.Lock()
				c.lat = append(c.lat, now.Sub(r.Timestamp))
				c.mu.Unlock()
			})
		}
	}()
	return c, nil
}

// Seen is how many records (warm-up ones aside) were read so far.
func (c *commitReader) Seen() int64 { return c.seen.Load() }

// WaitFor waits until n records were read or timeout passed.
func (c *commitReader) WaitFor(n int64, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for c.seen.Load() < n && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
}

// Stop ends the reading (once; later calls only return) and returns the
// latencies measured, sorted.
func (c *commitReader) Stop() []time.Duration {
	c.stop.Do(func() {
		c.cancel()
		<-c.done
		c.cl.Close()
	})
	c.mu.Lock()
	defer c.mu.Unlock()
	slices.Sort(c.lat)
	return c.lat
}
