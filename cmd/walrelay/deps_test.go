package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDaemonDoesNotLinkTheBenchmark keeps the benchmark and its JVM
// harnesses (Apache Kafka, Debezium, the Maven classpath) out of the
// daemon's binary: they belong to cmd/walrelay-bench.
func TestDaemonDoesNotLinkTheBenchmark(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, pkg := range []string{"test/bench", "test/kafkacluster", "test/debezium", "test/mavencp", "test/schemaregistry"} {
		for _, dep := range strings.Fields(string(out)) {
			if dep == "github.com/walrelay/walrelay/"+pkg {
				t.Errorf("cmd/walrelay links %s: only cmd/walrelay-bench and the tests may", pkg)
			}
		}
	}
}
