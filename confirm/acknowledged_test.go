package confirm

import (
	"testing"
	"time"

	"github.com/walrelay/walrelay/decoder"
)

// TestAcknowledgedIsWhatKafkaAllowsTheClearanceAside: what a stopping
// session asks the publication watch to vouch for is the newest position
// Kafka's acknowledgements allow, past the clearance; the process
// remembers it (Progress.Acked) though nothing confirmed it. The stream
// confirms its start before any update, and Position keeps the commit time
// of the newest confirmable transaction, for the lag, even where the
// clearance holds the position back.
func TestAcknowledgedIsWhatKafkaAllowsTheClearanceAside(t *testing.T) {
	c, clear, prog := newConfirmer(100)
	if got := c.Confirmed(); got != 100 {
		t.Fatalf("confirmed %s before any update, want the start 0/64", got)
	}
	commit := time.Unix(1000, 0)
	a := c.Begin(commit)
	a.Add()
	c.Commit(a, 200)
	if got := c.Acknowledged(); got != 100 {
		t.Fatalf("acknowledged %s before Kafka acked, want the start", got)
	}
	a.Ack()
	if got := c.Acknowledged(); got != 200 {
		t.Fatalf("acknowledged %s, want 0/C8 though nothing is vouched for", got)
	}
	if prog.Acked() != 200 || prog.Confirmed() != 0 {
		t.Fatalf("progress: acked %s, confirmed %s; want 0/C8 acked, nothing confirmed", prog.Acked(), prog.Confirmed())
	}
	if lsn, _ := c.Due(commit, true); lsn != 100 || clear.Wanted() != 200 {
		t.Fatalf("confirmable %s, watch asked for %s: want the start, and the watch asked for 0/C8", lsn, clear.Wanted())
	}
	if p := c.Position(); p.LSN != 100 || !p.CommitTime.Equal(commit) {
		t.Fatalf("position %+v, want 0/64 with the acknowledged transaction's commit time", p)
	}
}

// TestWatermarkConfirmedAndOldestCommit: Confirmed is the watermark the
// last Advance computed (an ack since moves it only at the next Advance);
// OldestCommit is the commit time of the oldest transaction waiting,
// markers aside, and zero once nothing waits.
func TestWatermarkConfirmedAndOldestCommit(t *testing.T) {
	w := NewWatermark(10)
	t1, t2 := time.Unix(1000, 0), time.Unix(2000, 0)
	a := w.Begin(t1)
	a.Add()
	w.Commit(a, 100)
	w.Marker(150)
	b := w.Begin(t2)
	b.Add()
	w.Commit(b, 200)
	if got := w.OldestCommit(); !got.Equal(t1) {
		t.Fatalf("oldest commit %v, want the first transaction's %v", got, t1)
	}
	a.Ack()
	if got := w.Confirmed(); got.LSN != 10 {
		t.Fatalf("confirmed %s before Advance, want 0/A", got.LSN)
	}
	if got := w.Advance(); got.LSN != 150 || w.Confirmed() != got {
		t.Fatalf("advanced to %+v, Confirmed %+v: want 0/96 both", got, w.Confirmed())
	}
	if got := w.OldestCommit(); !got.Equal(t2) {
		t.Fatalf("oldest commit %v, want the second transaction's %v", got, t2)
	}
	b.Ack()
	w.Advance()
	if got := w.OldestCommit(); !got.IsZero() || w.Confirmed().LSN != decoder.LSN(200) {
		t.Fatalf("nothing waits: oldest commit %v, confirmed %s; want zero, 0/C8", got, w.Confirmed().LSN)
	}
}
