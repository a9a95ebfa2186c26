package router

import (
	"testing"

	"github.com/walrelay/walrelay/metrics"
)

// A full gate wakes its waiter once a quarter of the window is free, not
// at each release: the sender is handed room in chunks.
func TestGateWakesAtAQuarterFree(t *testing.T) {
	for _, tc := range []struct {
		name           string
		events, bytes  int64
		size           int
		releasesBefore int // releases that must not wake the waiter
	}{
		{"by events", 8, 1 << 20, 10, 1},    // wakes at 6 of 8
		{"by bytes", 1000, 800, 100, 1},     // full at 800 bytes, wakes at 600
		{"window of one", 1, 1 << 20, 1, 0}, // wakes at 0
	} {
		t.Run(tc.name, func(t *testing.T) {
			var g gate
			g.init(tc.events, tc.bytes, metrics.NewUnregistered())
			n := 0
			for g.wait() == nil {
				g.acquire(tc.size)
				n++
			}
			wait := g.wait()
			for i := range tc.releasesBefore {
				g.release(tc.size)
				select {
				case <-wait:
					t.Fatalf("woken after %d release(s) of %d in flight, before a quarter of the window was free", i+1, n)
				default:
				}
			}
			g.release(tc.size)
			select {
			case <-wait:
			default:
				t.Fatalf("not woken after %d releases of %d in flight", tc.releasesBefore+1, n)
			}
		})
	}
}
