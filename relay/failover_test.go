package relay

import (
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/metrics"
)

// TestFailoverLineLoggedOnChange: the slot watch reads the failover state
// every poll; its line is logged when what it says changes (a standby's
// copy gone stale after a switchover), not at every poll because the stale
// copy's distance from the primary grew.
func TestFailoverLineLoggedOnChange(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	r, err := New(validConfig(), zap.New(core), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	good := doctor.Copy{Standby: "postgres@b:5432/app", SyncSlots: true, Exists: true, Synced: true, ConfirmedLSN: 0x1000, PrimaryConfirmed: 0x2000}
	f := doctor.Failover{Name: "walrelay", Supported: true, Slot: true, StandbySlots: []string{"sb"}, Standbys: 1, Checked: true, Copies: []doctor.Copy{good}}
	stale := func(ahead decoder.LSN) doctor.Failover {
		g, c := f, good
		c.Synced, c.PrimaryConfirmed = false, c.ConfirmedLSN+ahead
		g.Copies = []doctor.Copy{c}
		return g
	}
	for i, step := range []struct {
		f      doctor.Failover
		logged bool
		level  zapcore.Level
	}{
		{f, true, zapcore.InfoLevel},
		{f, false, 0},
		{stale(0x10), true, zapcore.WarnLevel},
		{stale(0x2000), false, 0}, // only the distance changed
		{stale(0x3000000), false, 0},
		{f, true, zapcore.InfoLevel},
	} {
		r.guard.recordFailover(step.f)
		got := logs.TakeAll()
		if (len(got) == 1) != step.logged || len(got) > 1 {
			t.Fatalf("step %d: logged %d lines, want logged=%v: %v", i, len(got), step.logged, got)
		}
		if step.logged && got[0].Level != step.level {
			t.Errorf("step %d: logged at %s, want %s: %s", i, got[0].Level, step.level, got[0].Message)
		}
	}
}
