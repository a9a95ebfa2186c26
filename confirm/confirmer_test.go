package confirm

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/walrelay/walrelay/decoder"
)

func newConfirmer(start decoder.LSN) (*Confirmer, *Clearance, *Progress) {
	clear, prog := NewClearance(), &Progress{}
	return New(Config{Start: start, Every: 10 * time.Second, MinGap: 100 * time.Millisecond, Clearance: clear, Progress: prog}), clear, prog
}

// TestConfirmerGates takes one input at a time and checks what each lets
// through: nothing past an unacknowledged event, nothing past the
// clearance (but the start, confirmed already), markers behind data.
func TestConfirmerGates(t *testing.T) {
	c, clear, prog := newConfirmer(100)
	now := time.Unix(1000, 0)
	due := func(want decoder.LSN) {
		t.Helper()
		got, _ := c.Due(now, true)
		if got != want {
			t.Fatalf("confirmable %s, want %s", got, want)
		}
		c.Sent(now, got)
		if prog.Confirmed() != got || c.Confirmed() != got {
			t.Fatalf("progress says %s, stream %s, want %s", prog.Confirmed(), c.Confirmed(), got)
		}
	}
	due(100) // the start, though nothing is vouched for
	if clear.Behind() {
		t.Fatal("asked the watch to vouch for the start")
	}

	a := c.Begin(now)
	a.Add()
	c.Commit(a, 200)
	due(100) // committed, not acknowledged
	a.Ack()
	due(100) // acknowledged, not vouched for
	if !clear.Behind() {
		t.Fatal("did not ask the watch to vouch for 200")
	}
	select {
	case <-clear.Wake():
	default:
		t.Fatal("did not wake the watch")
	}
	clear.Vouch(150)
	due(150) // vouched for part of the way
	clear.Vouch(1000)
	due(200)

	c.Marker(300) // a keepalive with nothing in flight
	due(300)
	b := c.Begin(now)
	b.Add()
	c.Marker(350) // inside b: waits for it
	due(300)
	c.Commit(b, 400)
	c.Marker(450) // after b, before its ack
	due(300)
	b.Ack()
	due(450)
	if c.InFlight() != 0 || !c.OldestCommit().IsZero() {
		t.Fatalf("%d in flight, oldest commit %v, want none", c.InFlight(), c.OldestCommit())
	}
}

// TestConfirmerSchedule: Due says an update is due at once when forced,
// at the minimum gap after the position moved, at the interval otherwise.
func TestConfirmerSchedule(t *testing.T) {
	c, clear, _ := newConfirmer(10)
	clear.Vouch(1 << 40)
	t0 := time.Unix(1000, 0)
	if _, due := c.Due(t0, false); !due {
		t.Fatal("the first update is not due at once")
	}
	c.Sent(t0, 10)
	c.Marker(20)
	if lsn, due := c.Due(t0.Add(50*time.Millisecond), false); due || lsn != 20 || !c.Pending() {
		t.Fatalf("within the minimum gap: %s due %v pending %v, want 0/14 not due, pending", lsn, due, c.Pending())
	}
	if _, due := c.Due(t0.Add(150*time.Millisecond), false); !due {
		t.Fatal("moved and past the minimum gap: not due")
	}
	c.Sent(t0.Add(150*time.Millisecond), 20)
	if _, due := c.Due(t0.Add(time.Second), false); due {
		t.Fatal("nothing new before the interval: due")
	}
	if _, due := c.Due(t0.Add(time.Second), true); !due {
		t.Fatal("forced: not due")
	}
	if next := c.Next(); next.Before(t0.Add(9 * time.Second)) {
		t.Fatalf("next periodic update at %v", next)
	}
}

// TestProgressResume: the next stream starts after what this process had
// acknowledged and was cleared, never before the slot; after a failover
// at the slot, forgetting both.
func TestProgressResume(t *testing.T) {
	c, clear, prog := newConfirmer(100)
	tx := c.Begin(time.Now())
	tx.Add()
	c.Commit(tx, 500)
	tx.Ack()
	c.Due(time.Now(), true) // acknowledged 500, cleared nothing
	if got := prog.Resume(100, clear, false); got != 100 {
		t.Fatalf("resume at %s, want the slot's 0/64: 500 was not cleared", got)
	}
	clear.Vouch(400)
	if got := prog.Resume(100, clear, false); got != 400 {
		t.Fatalf("resume at %s, want 0/190, as far as cleared", got)
	}
	clear.Vouch(900)
	if got := prog.Resume(100, clear, false); got != 500 {
		t.Fatalf("resume at %s, want 0/1F4, what was acknowledged", got)
	}
	if got := prog.Resume(700, clear, false); got != 700 {
		t.Fatalf("resume at %s, want the slot's 0/2BC, ahead", got)
	}
	if got := prog.Resume(200, clear, true); got != 200 || clear.Upto() != 0 {
		t.Fatalf("after a failover: resume at %s, cleared %s; want the slot's 0/C8 and nothing cleared", got, clear.Upto())
	}
	if got := prog.Resume(100, clear, false); got != 100 {
		t.Fatalf("after a failover the old acknowledgements count: resume at %s", got)
	}
}

// TestConfirmerInterleavings runs random interleavings of every input
// (transactions begun, events added and acknowledged in any order,
// commits, markers inside and between transactions, the watch vouching
// for any position) and checks after each step that the position never
// reaches a transaction not yet complete, never passes the clearance
// beyond the start, never moves back; and that once everything is
// acknowledged and vouched for, it reaches the newest position.
func TestConfirmerInterleavings(t *testing.T) {
	type txn struct {
		t            *Txn
		begin        decoder.LSN // a position after everything before it
		added, acked int
		committed    bool
		idx          int
	}
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 7))
		const start = 1000
		c, clear, _ := newConfirmer(start)
		var (
			txns []*txn
			open *txn
			pos  decoder.LSN = start
			last decoder.LSN
			now  = time.Unix(0, 0)
		)
		next := func() decoder.LSN { pos += decoder.LSN(1 + rng.IntN(50)); return pos }
		check := func(step int) {
			now = now.Add(time.Second)
			got, _ := c.Due(now, true)
			c.Sent(now, got)
			if got < last {
				t.Fatalf("seed %d step %d: moved back from %s to %s", seed, step, last, got)
			}
			last = got
			if got > start && got > clear.Upto() {
				t.Fatalf("seed %d step %d: confirmable %s past the clearance %s and the start", seed, step, got, clear.Upto())
			}
			for _, x := range txns {
				if !x.committed || x.acked < x.added {
					if got >= x.begin {
						t.Fatalf("seed %d step %d: confirmable %s reaches transaction %d (begun at %s, %d of %d acked, committed %v)",
							seed, step, got, x.idx, x.begin, x.acked, x.added, x.committed)
					}
					break
				}
			}
		}
		for step := range 200 {
			switch op := rng.IntN(7); {
			case op == 0 && open == nil:
				open = &txn{begin: next(), idx: len(txns)}
				open.t = c.Begin(now)
				txns = append(txns, open)
			case op == 1 && open != nil:
				open.t.Add()
				open.added++
			case op == 2:
				var waiting []*txn
				for _, x := range txns {
					if x.acked < x.added {
						waiting = append(waiting, x)
					}
				}
				if len(waiting) > 0 {
					x := waiting[rng.IntN(len(waiting))]
					x.t.Ack()
					x.acked++
				}
			case op == 3 && open != nil:
				c.Commit(open.t, next())
				open.committed = true
				open = nil
			case op == 4:
				c.Marker(next())
			case op == 5:
				clear.Vouch(decoder.LSN(rng.IntN(int(pos) + 1)))
			}
			check(step)
		}
		// Everything acknowledged, committed and vouched for: the newest
		// position is confirmable.
		if open != nil {
			c.Commit(open.t, next())
			open.committed = true
		}
		for _, x := range txns {
			for ; x.acked < x.added; x.acked++ {
				x.t.Ack()
			}
		}
		clear.Vouch(pos)
		check(-1)
		if last != pos {
			t.Fatalf("seed %d: everything done, confirmable %s, want the newest position %s", seed, last, pos)
		}
	}
}
