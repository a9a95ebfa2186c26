package bench

import (
	"strings"
	"testing"
)

// A compared relay's drains must reach its own rows and ratios only: a
// summary that mixed them with the build under test's would report one
// build's speed under the other's name.
func TestDrainSummaryKeepsTheComparedRelayApart(t *testing.T) {
	b := &bencher{cfg: Config{Events: 1000, PayloadBytes: 200, Deliveries: []string{"at-least-once", "exactly-once"}, ValueFormats: []string{"asis"}}}
	b.cfg.CompareArgs = []string{"--txn-producers=2"}
	relays := b.relayRuns()
	if len(relays) != 2 || relays[1].label == "" || relays[1].args[0] != "--txn-producers=2" {
		t.Fatalf("relayRuns() = %+v; want the build under test, then the compared one with its flag", relays)
	}
	run := func(rate float64) Result {
		return Result{Scenario: "drain", Metrics: map[string]float64{"relay_events_per_s": rate}}
	}
	const compare = " relay=compare"
	byMode := map[string][]Result{
		"at-least-once":           {run(100), run(100)},
		"exactly-once":            {run(50), run(50)},
		"at-least-once" + compare: {run(100), run(100)},
		"exactly-once" + compare:  {run(80), run(80)},
	}
	ratio := func(label string) (float64, int) {
		var r float64
		var n int
		for _, row := range b.drainSummary(byMode, 1, &broker{name: "store"}, label) {
			n++
			if v, ok := row.Metrics["eos_ratio"]; ok {
				if !strings.HasSuffix(row.Params, "exactly-once/at-least-once"+label) {
					t.Errorf("ratio row %q lacks the label %q", row.Params, label)
				}
				r = v
			}
		}
		return r, n
	}
	if r, n := ratio(""); r != 0.5 || n != 7 {
		t.Errorf("build under test: eos_ratio %v over %d rows; want 0.5 over 7 (2 runs and a median per mode, and the ratio)", r, n)
	}
	if r, _ := ratio(compare); r != 0.8 {
		t.Errorf("compared relay: eos_ratio %v; want 0.8, its own drains'", r)
	}
}
