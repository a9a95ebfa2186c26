package integration

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestBenchSmoke runs every scenario of walrelay-bench at a tiny size so
// the benchmark cannot rot: it must finish, and every metric the README,
// docs/architecture.md and BENCHMARKS.md report must be there and positive. walrelay-bench is built
// next to the suite's walrelay binary, where it finds the relay to measure
// by default (as bin/walrelay-bench finds bin/walrelay).
func TestBenchSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	if _, err := exec.LookPath("pg_recvlogical"); err != nil {
		t.Skip("pg_recvlogical not installed")
	}
	benchPath := filepath.Join(filepath.Dir(binPath), "walrelay-bench")
	build := exec.Command("go", "build", "-o", benchPath, "github.com/walrelay/walrelay/cmd/walrelay-bench")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		t.Fatalf("build walrelay-bench: %v", err)
	}
	out, err := exec.Command(benchPath, "--json", "--scenario", "drain,latency,big,idle,tracing", "--events", "2000", "--txn-size", "1,50",
		"--broker", "discard,store", "--rate", "300", "--duration", "2s", "--big-rows", "3000", "--idle", "2s").Output()
	if err != nil {
		t.Fatalf("walrelay-bench: %v\n%s", err, out)
	}
	var results []struct {
		Scenario string             `json:"scenario"`
		Params   string             `json:"params"`
		Metrics  map[string]float64 `json:"metrics"`
		Notes    string             `json:"notes"`
	}
	if err := json.Unmarshal(out, &results); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	want := map[string][]string{
		"drain":   {"recv_events_per_s", "relay_events_per_s", "ratio", "recv_mb_per_s", "relay_mb_per_s", "recv_walsender_us_per_event", "relay_walsender_us_per_event", "relay_cpu_us_per_event"},
		"latency": {"p50_ms", "p99_ms", "max_ms", "achieved_rate", "events", "relay_cpu_percent"},
		"big":     {"drain_s", "peak_rss_mb", "relay_events_per_s"},
		"idle":    {},
		"tracing": {"relay_events_per_s", "relay_cpu_us_per_event"},
	}
	count := map[string]int{}
	for _, r := range results {
		count[r.Scenario]++
		if r.Scenario == "tracing" {
			if strings.HasSuffix(r.Params, "against off") {
				continue
			}
			// Every event's span exported with every trace sampled; none off.
			want := map[string]float64{"tracing=off": 0, "tracing=sampled-1.0": 1}
			for mode, spans := range want {
				if strings.HasSuffix(r.Params, mode) && r.Metrics["spans_per_event"] != spans {
					t.Errorf("tracing %s: %v spans per event, want %v", r.Params, r.Metrics["spans_per_event"], spans)
				}
			}
		}
		for _, m := range want[r.Scenario] {
			v, ok := r.Metrics[m]
			// CPU times tick in 10 ms: at this size they may read 0.
			cpu := strings.Contains(m, "_us_per_event")
			if !ok || v < 0 || v == 0 && !cpu {
				t.Errorf("%s %s: %s = %v", r.Scenario, r.Params, m, v)
			}
		}
		if r.Scenario == "idle" {
			if _, ok := r.Metrics["cpu_percent"]; !ok {
				t.Errorf("idle: no cpu_percent")
			}
		}
		if r.Notes != "" && r.Scenario == "latency" {
			t.Errorf("latency: %s", r.Notes)
		}
	}
	if count["drain"] != 4 || count["latency"] != 1 || count["big"] != 1 || count["idle"] != 1 || count["tracing"] != 10 {
		t.Fatalf("results per scenario %v, want drain 4 (2 txn sizes × 2 brokers), latency 1, big 1, idle 1, tracing 10 (2 txn sizes × 3 modes, and 2 comparisons)\n%s", count, out)
	}
}
