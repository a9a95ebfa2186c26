package integration

// testkit_test.go: the helpers test/testkit and test/testdb hold for the
// tests of several packages, under the names this package's tests call
// them by.

import (
	"context"
	"testing"

	"github.com/walrelay/walrelay/test/testdb"
	"github.com/walrelay/walrelay/test/testkit"
)

// testDatabase creates the test's database (its name, the slot's and the
// topic prefix) on the server of adminURL; its slots are dropped when the
// test ends.
func testDatabase(t *testing.T, ctx context.Context, adminURL string) (name, url string) {
	t.Helper()
	return testdb.Create(t, ctx, adminURL, "w", 40)
}

// needApache skips tests of what only Apache Kafka shows.
func needApache(t *testing.T) {
	t.Helper()
	testkit.NeedApache(t, apache != nil)
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string { return testkit.LastLines(s, n) }
