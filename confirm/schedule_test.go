package confirm

import (
	"testing"
	"time"

	"github.com/walrelay/walrelay/decoder"
)

// TestSchedule walks one Schedule through the cases that decide whether a
// status update goes out.
func TestSchedule(t *testing.T) {
	t0 := time.Unix(1000, 0)
	s := NewSchedule(10*time.Second, 100*time.Millisecond)
	steps := []struct {
		name  string
		at    time.Duration
		pos   decoder.LSN
		force bool
		due   bool
	}{
		{"first update is due at once", 0, 0, false, true},
		{"nothing new, before the interval", time.Second, 0, false, false},
		{"advanced, but within the minimum gap", 50 * time.Millisecond, 10, false, false},
		{"advanced, minimum gap passed", 150 * time.Millisecond, 10, false, true},
		{"server asked for a reply", 160 * time.Millisecond, 10, true, true},
		{"nothing new, interval not yet over", 5 * time.Second, 10, false, false},
		{"nothing new, interval over", 11 * time.Second, 10, false, true},
	}
	for _, st := range steps {
		now := t0.Add(st.at)
		if got := s.Due(now, st.pos, st.force); got != st.due {
			t.Fatalf("%s: Due = %v, want %v", st.name, got, st.due)
		}
		if st.due {
			s.Sent(now, st.pos)
			if s.Confirmed() != st.pos {
				t.Fatalf("%s: Confirmed = %v", st.name, s.Confirmed())
			}
		}
	}
}

// TestScheduleJitterStaysNearTheInterval: the periodic update is spread
// within ±10% of the interval so relays started together do not update in
// step, and never later than that.
func TestScheduleJitterStaysNearTheInterval(t *testing.T) {
	s := NewSchedule(10*time.Second, time.Millisecond)
	seen := map[time.Duration]bool{}
	for i := range 1000 {
		now := time.Unix(0, int64(i)*7_919_000)
		s.Sent(now, 1)
		d := s.Next().Sub(now)
		if d < 9*time.Second || d > 11*time.Second {
			t.Fatalf("next update after %s, want within 10%% of 10s", d)
		}
		seen[d] = true
		if !s.Pending(2) || s.Pending(1) {
			t.Fatal("Pending wrong")
		}
	}
	if len(seen) < 100 {
		t.Fatalf("only %d distinct delays: no jitter", len(seen))
	}
}
