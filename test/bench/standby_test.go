package bench

import (
	"math"
	"testing"
)

func TestCompareLegs(t *testing.T) {
	primary := Result{Scenario: "standby", Params: "rate=2000/s delivery=at-least-once read=primary", Metrics: map[string]float64{
		"primary_cpu_us_per_event": 200, "standby_cpu_us_per_event": 80, "p50_ms": 5, "p99_ms": 20,
	}}
	standby := Result{Scenario: "standby", Params: "rate=2000/s delivery=at-least-once read=standby", Metrics: map[string]float64{
		"primary_cpu_us_per_event": 150, "standby_cpu_us_per_event": 140, "p50_ms": 6, "p99_ms": 23,
	}}
	got := compareLegs(primary, standby)
	if got.Params != "rate=2000/s delivery=at-least-once standby against primary" {
		t.Errorf("params %q", got.Params)
	}
	for k, want := range map[string]float64{
		"primary_cpu_ratio": 0.75, "primary_cpu_us_saved": 50, "both_cpu_ratio": 290.0 / 280, "added_p50_ms": 1, "added_p99_ms": 3,
	} {
		if v, ok := got.Metrics[k]; !ok || math.Abs(v-want) > 1e-9 {
			t.Errorf("%s = %v (present %v), want %v", k, v, ok, want)
		}
	}
}
