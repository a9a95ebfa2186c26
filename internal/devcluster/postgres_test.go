package devcluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// stubBins creates dir with an executable stub for each name, the way a
// package puts the server binaries somewhere.
func stubBins(t *testing.T, dir string, names ...string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// TestBinDirFindsDebianLayoutOffPath is the machine a new user has after
// `apt-get install postgresql`: initdb and pg_ctl only under
// /usr/lib/postgresql/<version>/bin, nothing on PATH.
func TestBinDirFindsDebianLayoutOffPath(t *testing.T) {
	root := filepath.Join(t.TempDir(), "usr", "lib", "postgresql")
	want := stubBins(t, filepath.Join(root, "15", "bin"), "initdb", "pg_ctl", "postgres")
	emptyPath := t.TempDir()

	got, err := findBinDir(emptyPath, []string{root})
	if err != nil {
		t.Fatalf("findBinDir: %v", err)
	}
	if got != want {
		t.Fatalf("findBinDir = %q, want %q", got, want)
	}

	// The exported entry point, with the root from the environment (as in
	// `WALRELAY_PG_ROOT=... walrelay dev`).
	t.Setenv("PATH", emptyPath)
	t.Setenv(RootEnv, root)
	if got, err := BinDir(); err != nil || got != want {
		t.Fatalf("BinDir() = %q, %v; want %q", got, err, want)
	}
}

func TestBinDirPicksNewestCompleteVersion(t *testing.T) {
	root := t.TempDir()
	stubBins(t, filepath.Join(root, "9.6", "bin"), "initdb", "pg_ctl")
	stubBins(t, filepath.Join(root, "14", "bin"), "initdb", "pg_ctl")
	want := stubBins(t, filepath.Join(root, "16", "bin"), "initdb", "pg_ctl")
	// Newer, but only the client half is installed: no server to start.
	stubBins(t, filepath.Join(root, "17", "bin"), "pg_recvlogical", "initdb")
	stubBins(t, filepath.Join(root, "common", "bin"), "initdb", "pg_ctl")

	got, err := findBinDir(t.TempDir(), []string{filepath.Join(t.TempDir(), "absent"), root})
	if err != nil {
		t.Fatalf("findBinDir: %v", err)
	}
	if got != want {
		t.Fatalf("findBinDir = %q, want %q (newest version with both initdb and pg_ctl)", got, want)
	}
}

func TestBinDirPrefersPathWithBothBinaries(t *testing.T) {
	root := t.TempDir()
	stubBins(t, filepath.Join(root, "15", "bin"), "initdb", "pg_ctl")
	onlyInitdb := stubBins(t, t.TempDir(), "initdb")
	onlyPgCtl := stubBins(t, t.TempDir(), "pg_ctl")
	notExec := t.TempDir()
	for _, n := range []string{"initdb", "pg_ctl"} {
		if err := os.WriteFile(filepath.Join(notExec, n), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	both := stubBins(t, t.TempDir(), "initdb", "pg_ctl")

	path := strings.Join([]string{onlyInitdb, onlyPgCtl, notExec, both}, string(os.PathListSeparator))
	got, err := findBinDir(path, []string{root})
	if err != nil {
		t.Fatalf("findBinDir: %v", err)
	}
	if got != both {
		t.Fatalf("findBinDir = %q, want the PATH entry holding both binaries %q", got, both)
	}

	// A split installation on PATH is not used: StartPostgres runs both
	// from one directory.
	path = strings.Join([]string{onlyInitdb, onlyPgCtl}, string(os.PathListSeparator))
	if got, err := findBinDir(path, []string{root}); err != nil || got != filepath.Join(root, "15", "bin") {
		t.Fatalf("findBinDir with initdb and pg_ctl in different PATH entries = %q, %v; want the root's", got, err)
	}
}

// TestBinDirNotFoundSaysWhatToRun: the error is the one line `walrelay dev`
// prints, and it must name the command that fixes it.
func TestBinDirNotFoundSaysWhatToRun(t *testing.T) {
	root := t.TempDir()
	stubBins(t, filepath.Join(root, "15", "bin"), "pg_recvlogical", "psql")

	_, err := findBinDir(t.TempDir(), []string{root, filepath.Join(t.TempDir(), "absent")})
	if err == nil {
		t.Fatal("findBinDir found a server where there is none")
	}
	msg := err.Error()
	if strings.Contains(msg, "\n") {
		t.Fatalf("error is not one line: %q", msg)
	}
	if want := "apt-get update && apt-get install -y postgresql"; !strings.Contains(installCommand(), want) {
		t.Errorf("installCommand() = %q, want it to contain %q", installCommand(), want)
	}
	for _, want := range []string{"initdb", "pg_ctl", root, "run `" + installCommand() + "`", "PATH"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not mention %q", msg, want)
		}
	}
}
