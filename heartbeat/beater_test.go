package heartbeat

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// A heartbeat failing at every beat (its server gone) is one WARN, then
// one every FailureWarnEvery, and one INFO when it works again: not a
// line per beat.
func TestFailStreakLogsOnceAWhile(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	log := zap.New(core)
	var f failStreak
	start := time.Unix(0, 0)
	err := errors.New("connection refused")
	for i := range 20 {
		f.failed(log, "heartbeat WAL nudge failed", start.Add(time.Duration(i)*500*time.Millisecond), err)
	}
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 1 {
		t.Fatalf("%d WARN lines for 20 failures in 10 s, want 1", n)
	}
	f.failed(log, "heartbeat WAL nudge failed", start.Add(FailureWarnEvery+time.Second), err)
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 2 {
		t.Fatalf("%d WARN lines after %v of failures, want 2", n, FailureWarnEvery)
	}
	f.worked(log, "heartbeat WAL nudge works again")
	info := logs.FilterLevelExact(zapcore.InfoLevel).All()
	if len(info) != 1 || info[0].ContextMap()["failures_in_a_row"] != int64(21) {
		t.Fatalf("after the streak: %+v, want one INFO counting 21 failures", info)
	}
	f.worked(log, "heartbeat WAL nudge works again")
	if n := logs.FilterLevelExact(zapcore.InfoLevel).Len(); n != 1 {
		t.Fatalf("a beat that works after one that worked logged again")
	}
}
