package integration

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestBenchInboxSmoke runs walrelay-bench's inbox scenario at a tiny size
// (its own cluster and kfake, the consumer built from this tree, no
// compared build), so that it cannot rot: every figure BENCHMARKS.md
// reports of it must be there and positive. About 20 s, most of it
// building the consumer and starting PostgreSQL.
func TestBenchInboxSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	benchPath := filepath.Join(filepath.Dir(binPath), "walrelay-bench")
	build := exec.Command("go", "build", "-o", benchPath, "github.com/walrelay/walrelay/cmd/walrelay-bench")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		t.Fatalf("build walrelay-bench: %v", err)
	}
	cmd := exec.Command(benchPath, "--json", "--scenario", "inbox", "--inbox-partitions", "2", "--inbox-events", "3000",
		"--inbox-rate", "200", "--duration", "2s")
	cmd.Stderr = &testWriter{t: t, prefix: "walrelay-bench: "}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("walrelay-bench: %v\n%s", err, out)
	}
	var results []struct {
		Scenario string             `json:"scenario"`
		Metrics  map[string]float64 `json:"metrics"`
	}
	if err := json.Unmarshal(out, &results); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	want := map[string][]string{
		"inbox":         {"effects_per_s", "floor_effects_per_s", "floor_savepoint_effects_per_s", "floor_ratio", "cpu_us_per_effect"},
		"inbox-latency": {"p50_ms", "p99_ms", "events"},
	}
	count := map[string]int{}
	for _, r := range results {
		count[r.Scenario]++
		for _, m := range want[r.Scenario] {
			if v := r.Metrics[m]; v <= 0 {
				t.Errorf("%s: %s = %v", r.Scenario, m, v)
			}
		}
	}
	if count["inbox"] != 1 || count["inbox-latency"] != 1 {
		t.Fatalf("results per scenario %v, want inbox 1 and inbox-latency 1\n%s", count, out)
	}
}
