package relay

import (
	"testing"
	"time"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// TestWALRate: the slot watch's WAL rate is unknown after one poll,
// averages over at most rateWindow of polls, and starts again on a server
// whose WAL position is behind the last one (a failover).
func TestWALRate(t *testing.T) {
	var w slotWatch
	at := func(s int, lsn decoder.LSN) (float64, bool) {
		return w.rate(slot.Info{Now: time.Unix(int64(s), 0), CurrentLSN: lsn})
	}
	if _, ok := at(0, 0); ok {
		t.Error("rate known after one poll")
	}
	if r, ok := at(10, 10<<20); !ok || r != 1<<20 {
		t.Errorf("rate after 10 MiB in 10s: %v, %v; want 1 MiB/s", r, ok)
	}
	// Ten minutes at 2 MiB/s: the first polls leave the window.
	lsn := decoder.LSN(10 << 20)
	for s := 20; s <= 610; s += 10 {
		lsn += 20 << 20
		at(s, lsn)
	}
	if r, _ := at(620, lsn+20<<20); r != 2<<20 {
		t.Errorf("rate over the last 5 minutes at 2 MiB/s: %v", r)
	}
	if first := w.samples[0].at; time.Unix(620, 0).Sub(first) > rateWindow+10*time.Second {
		t.Errorf("oldest sample %s is older than the window", first)
	}
	if _, ok := at(630, 1<<20); ok {
		t.Error("rate known right after the WAL position went back")
	}
	if r, ok := at(640, 2<<20); !ok || r != float64(1<<20)/10 {
		t.Errorf("rate on the new server: %v, %v", r, ok)
	}
}
