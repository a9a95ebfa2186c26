package confirm

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/walrelay/walrelay/decoder"
)

// step is one action in a scripted scenario. Transactions are referred to by
// their index in Begin order.
type step struct {
	begin  int         // Begin a transaction with begin-1 events (Add each)
	ack    int         // Ack one event of transaction ack-1 (0: no ack)
	commit int         // Commit transaction commit-1 at LSN 100*(commit)
	marker decoder.LSN // queue a keepalive marker
	want   decoder.LSN // expected watermark after Advance (checked when nonzero)
}

func TestWatermark(t *testing.T) {
	tests := []struct {
		name  string
		start decoder.LSN
		steps []step
	}{
		{
			name:  "single transaction waits for commit and ack",
			start: 10,
			steps: []step{
				{begin: 2, want: 10},
				{ack: 1, want: 10},       // acked but not committed
				{commit: 1, want: 100},   // now complete
				{marker: 150, want: 150}, // nothing in flight: marker at once
			},
		},
		{
			name:  "acks out of order never jump a gap",
			start: 1,
			steps: []step{
				{begin: 3}, {commit: 1},
				{begin: 2}, {commit: 2},
				{begin: 2}, {commit: 3},
				{ack: 3, want: 1}, // third done, first not
				{ack: 2, want: 1}, // second done, first not
				{ack: 1, want: 1}, // first half done
				{ack: 1, want: 300},
			},
		},
		{
			name:  "transactions without events complete at commit",
			start: 5,
			steps: []step{
				{begin: 1}, {commit: 1, want: 100},
				{begin: 2}, {commit: 2},
				{begin: 1}, {commit: 3, want: 100}, // behind the unacked one
				{ack: 2, want: 300},
			},
		},
		{
			name:  "marker waits behind in-flight events",
			start: 1,
			steps: []step{
				{begin: 2}, {commit: 1},
				{marker: 500, want: 1},
				{marker: 600, want: 1}, // collapses with the previous marker
				{ack: 1, want: 600},
			},
		},
		{
			name:  "marker inside an open transaction waits for its commit",
			start: 1,
			steps: []step{
				{begin: 2}, {ack: 1},
				{marker: 50, want: 1},
				{commit: 1, want: 100},
			},
		},
		{
			name:  "watermark never moves backwards",
			start: 1000,
			steps: []step{
				{marker: 10, want: 1000},
				{begin: 2}, {commit: 1}, {ack: 1, want: 1000},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := NewWatermark(tc.start)
			var txns []*Txn
			for i, s := range tc.steps {
				switch {
				case s.begin > 0:
					x := tr.Begin(time.Unix(int64(len(txns)+1), 0))
					for range s.begin - 1 {
						x.Add()
					}
					txns = append(txns, x)
				case s.ack > 0:
					txns[s.ack-1].Ack()
				case s.commit > 0:
					tr.Commit(txns[s.commit-1], decoder.LSN(100*s.commit))
				case s.marker > 0:
					tr.Marker(s.marker)
				}
				got := tr.Advance()
				if s.want != 0 && got.LSN != s.want {
					t.Fatalf("step %d %+v: watermark %v, want %v", i, s, got.LSN, s.want)
				}
			}
		})
	}
}

func TestCommitTimeFollowsWatermark(t *testing.T) {
	tr := NewWatermark(1)
	a := tr.Begin(time.Unix(100, 0))
	a.Add()
	tr.Commit(a, 10)
	b := tr.Begin(time.Unix(200, 0))
	tr.Commit(b, 20)
	if got := tr.Advance(); !got.CommitTime.IsZero() || got.LSN != 1 {
		t.Fatalf("before ack: %+v", got)
	}
	a.Ack()
	tr.Marker(30)
	got := tr.Advance()
	if got.LSN != 30 || !got.CommitTime.Equal(time.Unix(200, 0)) {
		t.Fatalf("after ack: %+v, want LSN 30 and the commit time of the last transaction", got)
	}
	if tr.InFlight() != 0 {
		t.Fatalf("InFlight = %d, want 0", tr.InFlight())
	}
}

func TestOnCompleteOncePerTransactionWithEvents(t *testing.T) {
	var n atomic.Int32
	tr := NewWatermark(1, OnComplete(func(time.Time) { n.Add(1) }))
	a := tr.Begin(time.Unix(1, 0))
	a.Add()
	a.Add()
	a.Ack()
	tr.Commit(a, 10) // one still pending
	a.Ack()          // completes here
	b := tr.Begin(time.Unix(2, 0))
	tr.Commit(b, 20) // no events: not reported
	c := tr.Begin(time.Unix(3, 0))
	c.Add()
	c.Ack()
	tr.Commit(c, 30) // completes at commit
	if got := n.Load(); got != 2 {
		t.Fatalf("OnComplete called %d times, want 2", got)
	}
}

func TestAckMoreThanAddPanics(t *testing.T) {
	tr := NewWatermark(1)
	a := tr.Begin(time.Unix(1, 0))
	tr.Commit(a, 10)
	defer func() {
		if recover() == nil {
			t.Fatal("extra Ack did not panic")
		}
	}()
	a.Ack()
}

// TestManyInFlightConcurrentAcks acks thousands of events from many
// goroutines in random order while the owner keeps advancing, and checks the
// watermark never passes a transaction with an unacknowledged event.
func TestManyInFlightConcurrentAcks(t *testing.T) {
	const txns = 2000
	tr := NewWatermark(0)
	type ev struct {
		txn *Txn
		idx int
	}
	var events []ev
	ends := make([]decoder.LSN, txns)
	for i := range txns {
		x := tr.Begin(time.Unix(int64(i+1), 0))
		n := i % 4 // some transactions have no events
		for range n {
			x.Add()
			events = append(events, ev{x, i})
		}
		ends[i] = decoder.LSN(10 * (i + 1))
		tr.Commit(x, ends[i])
	}
	rand.Shuffle(len(events), func(i, j int) { events[i], events[j] = events[j], events[i] })

	// acked[i] counts acks of transaction i; the owner checks that every
	// transaction at or below the watermark is fully acked.
	acked := make([]atomic.Int32, txns)
	var wg sync.WaitGroup
	ch := make(chan ev)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for e := range ch {
				acked[e.idx].Add(1)
				e.txn.Ack()
			}
		}()
	}
	done := make(chan struct{})
	go func() {
		for _, e := range events {
			ch <- e
		}
		close(ch)
		wg.Wait()
		close(done)
	}()
	check := func() {
		w := tr.Advance().LSN
		for i := range txns {
			if ends[i] > w {
				break
			}
			if got, want := int(acked[i].Load()), i%4; got != want {
				t.Fatalf("watermark %v passed transaction %d with %d of %d events acked", w, i, got, want)
			}
		}
	}
	for {
		select {
		case <-done:
			check()
			if got := tr.Advance().LSN; got != ends[txns-1] {
				t.Fatalf("final watermark %v, want %v", got, ends[txns-1])
			}
			return
		default:
			check()
		}
	}
}

func BenchmarkTrackOneEventTxn(b *testing.B) {
	tr := NewWatermark(0)
	b.ReportAllocs()
	for i := range b.N {
		x := tr.Begin(time.Unix(1, 0))
		x.Add()
		tr.Commit(x, decoder.LSN(i+1))
		x.Ack()
		if i%64 == 0 {
			tr.Advance()
		}
	}
}
