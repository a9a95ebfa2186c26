package holds

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/metrics"
)

func newBoard(t *testing.T) (*Board, *prometheus.Registry, *observer.ObservedLogs, *time.Time) {
	t.Helper()
	reg := prometheus.NewRegistry()
	core, logs := observer.New(zapcore.DebugLevel)
	b := New(zap.New(core), metrics.New(reg))
	now := time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)
	b.now = func() time.Time { return now }
	return b, reg, logs, &now
}

func exposed(t *testing.T, reg *prometheus.Registry) string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, mf := range mfs {
		if mf.GetName() != "walrelay_delivery_held" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var dep, reason string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "dependency":
					dep = l.GetValue()
				case "reason":
					reason = l.GetValue()
				}
			}
			if m.GetGauge().GetValue() != 0 || reason != "" {
				lines = append(lines, fmt.Sprintf("%s/%s=%g", dep, reason, m.GetGauge().GetValue()))
			}
		}
	}
	return strings.Join(lines, " ")
}

func TestBoardReportsEveryHoldOnceAndItsEnd(t *testing.T) {
	b, reg, logs, now := newBoard(t)
	if err := b.Err(); err != nil {
		t.Fatalf("a new board holds: %v", err)
	}
	// Every dependency is exported at 0 from the start, so that an alert
	// sees the series.
	if n := testutil.CollectAndCount(reg, "walrelay_delivery_held"); n != len(Dependencies()) {
		t.Fatalf("%d series before any hold, want one per dependency (%d)", n, len(Dependencies()))
	}

	reg1 := b.Condition(SchemaRegistry)
	reg1.Hold("Unreachable", "subject a-value: dial tcp: connection refused")
	*now = now.Add(5 * time.Second)
	reg1.Hold("Unreachable", "subject a-value: dial tcp: connection refused (retry 2)")
	if got := logs.FilterMessageSnippet("delivery held by schema_registry").Len(); got != 1 {
		t.Fatalf("%d WARNs for one hold reported twice with one reason, want 1", got)
	}
	err := b.Err()
	var held *HeldError
	if !errors.As(err, &held) || len(held.Holds) != 1 {
		t.Fatalf("Err = %v, want one hold", err)
	}
	if h := held.Holds[0]; h.Reason != "Unreachable" || !strings.HasSuffix(h.Message, "(retry 2)") || h.Since != now.Add(-5*time.Second) {
		t.Fatalf("hold = %+v: want the newest message and the first report's time", h)
	}
	if !strings.Contains(err.Error(), "schema_registry (Unreachable for 5s)") {
		t.Fatalf("readiness says %q: want the dependency, the reason and how long", err)
	}
	if got := exposed(t, reg); got != "schema_registry/Unreachable=1" {
		t.Fatalf("exposed %q", got)
	}

	// A second part holds another dependency; then the first changes its
	// reason, which is a new hold.
	kafka := b.Condition(Kafka)
	*now = now.Add(time.Second)
	kafka.Hold("NotAcknowledging", "5000 events in flight, none acknowledged for 10s")
	*now = now.Add(time.Second)
	reg1.Hold("NotAnswering", "subject a-value: no answer for 2s")
	if got := exposed(t, reg); got != "kafka/NotAcknowledging=1 schema_registry/NotAnswering=1" && got != "schema_registry/NotAnswering=1 kafka/NotAcknowledging=1" {
		t.Fatalf("exposed %q", got)
	}
	if hs := b.Holds(); len(hs) != 2 || hs[0].Dependency != Kafka {
		t.Fatalf("holds %+v: want both, oldest (kafka's) first", hs)
	}
	if got := logs.FilterField(zap.String("previous_reason", "Unreachable")).Len(); got != 1 {
		t.Fatalf("a changed reason logged %d times with the previous one, want 1", got)
	}

	// Two parts on one dependency: one clearing leaves the other's hold.
	kafka2 := b.Condition(Kafka)
	kafka2.Hold("Unreachable", "dial tcp 10.0.0.1:9092: connection refused")
	kafka.Clear()
	if got := exposed(t, reg); !strings.Contains(got, "kafka/Unreachable=1") || strings.Contains(got, "NotAcknowledging") {
		t.Fatalf("exposed %q after one of two kafka holds cleared", got)
	}
	kafka2.Clear()
	reg1.Clear()
	reg1.Clear() // clearing twice logs once
	if err := b.Err(); err != nil {
		t.Fatalf("all cleared, Err = %v", err)
	}
	if got := exposed(t, reg); got != "" {
		t.Fatalf("exposed %q after every hold cleared", got)
	}
	if got := logs.FilterMessageSnippet("no longer holds delivery").Len(); got != 3 {
		t.Fatalf("%d end-of-hold lines for three holds ended, want 3", got)
	}
	for _, e := range logs.All() {
		if e.Level != zapcore.WarnLevel {
			t.Fatalf("%q at %s: starts and ends are both WARN", e.Message, e.Level)
		}
	}
}

func TestNilBoardAndConditionHoldNothing(t *testing.T) {
	var b *Board
	c := b.Condition(Kafka)
	c.Hold("Unreachable", "x")
	c.Clear()
	if c.Held() || b.Err() != nil || b.Holds() != nil {
		t.Fatal("a nil board or condition held something")
	}
}
