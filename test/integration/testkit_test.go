package integration

// testkit_test.go: the helpers test/testkit holds for the tests of several
// packages, under the names this package's tests call them by.

import (
	"testing"

	"github.com/walrelay/walrelay/test/testkit"
)

// needApache skips tests of what only Apache Kafka shows.
func needApache(t *testing.T) {
	t.Helper()
	testkit.NeedApache(t, apache != nil)
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string { return testkit.LastLines(s, n) }
