// Package testkit holds the few helpers that the tests of several packages
// share, so that each is written once: a kfake cluster for a test, the
// skip of a test that needs Apache Kafka, the last lines of an output.
package testkit

import (
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"
)

// Kfake starts an in-process one-broker kfake cluster with opts, closed
// when the test ends.
func Kfake(t testing.TB, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// NeedApache skips t unless Apache Kafka runs for it (running): the JVMs
// are too slow for `make test`, so those tests run only when asked.
func NeedApache(t testing.TB, running bool) {
	t.Helper()
	if !running {
		t.Skip("needs Apache Kafka: run with WALRELAY_TEST_KAFKA=apache (make test-kafka)")
	}
}

// LastLines returns the last n lines of s.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
