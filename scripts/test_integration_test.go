package scripts

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A verbose log of a real go test run, of a package with a passing test
// that logs, a test whose subtests run in parallel, a failing test and a
// skipped one: what scripts/test-integration summarises of each process.
const fakeSuite = `package fake

import (
	"testing"
	"time"
)

func TestNoisy(t *testing.T) { t.Log("noise of a passing test") }

func TestParallelParts(t *testing.T) {
	for _, n := range []string{"a", "b"} {
		t.Run(n, func(t *testing.T) {
			t.Parallel()
			time.Sleep(700 * time.Millisecond) // a duration to report, not a wait for anything
		})
	}
}

func TestBroken(t *testing.T) {
	t.Run("part", func(t *testing.T) { t.Error("what broke") })
}

func TestSkipped(t *testing.T) { t.Skip("noise of a skipped test") }
`

func verboseLog(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for name, body := range map[string]string{"go.mod": "module fake\n\ngo 1.22\n", "fake_test.go": fakeSuite} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("go", "test", "-c", "-o", "fake.test", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the fake suite: %v\n%s", err, out)
	}
	out, err := exec.Command(filepath.Join(dir, "fake.test"), "-test.v").CombinedOutput()
	if err == nil {
		t.Fatalf("the fake suite passed; it has a failing test:\n%s", out)
	}
	log := filepath.Join(dir, "v.log")
	if err := os.WriteFile(log, out, 0o644); err != nil {
		t.Fatal(err)
	}
	return log
}

func summary(t *testing.T, flag, log string) string {
	t.Helper()
	out, err := exec.Command("./test-integration", flag, log).CombinedOutput()
	if err != nil {
		t.Fatalf("test-integration %s: %v\n%s", flag, err, out)
	}
	return string(out)
}

// TestIntegrationProcessSummaries: a passing process names its slowest
// tests, a test of parallel subtests by its longest part (its own line
// says 0.00s); a failing process prints the failure's output and only
// the result lines of the tests that passed or were skipped.
func TestIntegrationProcessSummaries(t *testing.T) {
	log := verboseLog(t)

	slow := summary(t, "--slowest", log)
	if !strings.HasPrefix(slow, "TestParallelParts 1s") {
		t.Errorf("--slowest said %q, want TestParallelParts first, at its subtests' 0.7 s", slow)
	}
	if strings.Contains(slow, "TestBroken") {
		t.Errorf("--slowest said %q: it names a failed test", slow)
	}

	failed := summary(t, "--failed", log)
	for _, want := range []string{"what broke", "--- FAIL: TestBroken", "--- PASS: TestNoisy", "--- SKIP: TestSkipped", "--- PASS: TestParallelParts"} {
		if !strings.Contains(failed, want) {
			t.Errorf("--failed lacks %q:\n%s", want, failed)
		}
	}
	for _, noise := range []string{"noise of a passing test", "noise of a skipped test"} {
		if strings.Contains(failed, noise) {
			t.Errorf("--failed prints %q, what a test that did not fail logged:\n%s", noise, failed)
		}
	}
}
