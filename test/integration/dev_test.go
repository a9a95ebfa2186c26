package integration

import (
	"bytes"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestDevDemo runs `walrelay dev --demo 10`: it starts its own PostgreSQL
// and broker, prints ten published records and exits 0.
func TestDevDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(binPath, "dev", "--demo", "10", "--timeout", "90s")
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("walrelay dev --demo 10: %v\nstdout:\n%s\nstderr:\n%s", err, &stdout, &stderr)
		}
	case <-time.After(3 * time.Minute):
		_ = cmd.Process.Kill()
		t.Fatalf("walrelay dev --demo 10 did not finish\nstdout:\n%s\nstderr:\n%s", &stdout, &stderr)
	}
	var records int
	ids := map[string]bool{}
	for _, line := range strings.Split(stdout.String(), "\n") {
		if !strings.HasPrefix(line, "topic=outbox.event.") {
			continue
		}
		records++
		for _, f := range []string{"partition=", "offset=", "key=", `headers={id="`, "type=", "value="} {
			if !strings.Contains(line, f) {
				t.Errorf("record line lacks %s: %s", f, line)
			}
		}
		i := strings.Index(line, `id="`)
		ids[line[i:i+40]] = true
	}
	if records != 10 || len(ids) != 10 {
		t.Fatalf("printed %d records with %d distinct ids, want 10\n%s", records, len(ids), &stdout)
	}
	if !strings.Contains(stdout.String(), "demo: 10 of 10 events published and confirmed") {
		t.Fatalf("no confirmation line in output:\n%s", &stdout)
	}
	if !strings.Contains(stdout.String(), "psql \"postgres://") {
		t.Errorf("no psql connection string in output:\n%s", &stdout)
	}
}
