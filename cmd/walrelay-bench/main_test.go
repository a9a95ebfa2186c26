package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRelayBinary(t *testing.T) {
	dir := t.TempDir()
	onPath := filepath.Join(dir, "walrelay")
	if err := os.WriteFile(onPath, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}

	// The test binary's directory holds no walrelay: PATH decides.
	t.Setenv("PATH", dir)
	if got, err := relayBinary(""); err != nil || got != onPath {
		t.Errorf("relayBinary(\"\") with walrelay on PATH = %q, %v; want %q", got, err, onPath)
	}
	if got, err := relayBinary(onPath); err != nil || got != onPath {
		t.Errorf("relayBinary(%q) = %q, %v", onPath, got, err)
	}

	t.Setenv("PATH", t.TempDir())
	if _, err := relayBinary(""); err == nil || !strings.Contains(err.Error(), "--relay-binary") {
		t.Errorf("relayBinary(\"\") with no walrelay anywhere: %v, want an error naming --relay-binary", err)
	}
	missing := filepath.Join(dir, "nope")
	if _, err := relayBinary(missing); err == nil || !strings.Contains(err.Error(), "--relay-binary") {
		t.Errorf("relayBinary(%q): %v, want an error naming --relay-binary", missing, err)
	}
}
