package devcluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestInstalledBinDir(t *testing.T) {
	root := t.TempDir()
	t.Setenv(VersionsRootEnv, root)
	if got := VersionsRoot(); got != root {
		t.Fatalf("VersionsRoot() = %q with %s=%q", got, VersionsRootEnv, root)
	}
	want := stubBins(t, filepath.Join(root, "17", "bin"), "initdb", "pg_ctl", "postgres")
	// 16 lacks the server itself: initdb and pg_ctl alone start nothing.
	stubBins(t, filepath.Join(root, "16", "bin"), "initdb", "pg_ctl")

	if got, err := InstalledBinDir(17); err != nil || got != want {
		t.Fatalf("InstalledBinDir(17) = %q, %v; want %q", got, err, want)
	}
	for _, major := range []int{16, 18} {
		_, err := InstalledBinDir(major)
		if err == nil {
			t.Fatalf("InstalledBinDir(%d) found a server where there is none", major)
		}
		msg := err.Error()
		if strings.Contains(msg, "\n") || !strings.Contains(msg, "make deps-pg-versions") || !strings.Contains(msg, filepath.Join(root, "")) {
			t.Errorf("InstalledBinDir(%d) error %q: want one line naming %s and make deps-pg-versions", major, msg, root)
		}
	}
	if _, err := InstalledBinDir(13); err == nil || !strings.Contains(err.Error(), "not in the version matrix") {
		t.Errorf("InstalledBinDir(13) = %v, want a refusal: 13 is not in the matrix", err)
	}
}

func TestTestBinDirSwitch(t *testing.T) {
	root := t.TempDir()
	t.Setenv(VersionsRootEnv, root)
	want := stubBins(t, filepath.Join(root, "14", "bin"), "initdb", "pg_ctl", "postgres")
	for v, wantDir := range map[string]string{"": "", "local": "", "14": want} {
		t.Setenv(TestPGEnv, v)
		if got, err := TestBinDir(); err != nil || got != wantDir {
			t.Errorf("%s=%q: TestBinDir() = %q, %v; want %q", TestPGEnv, v, got, err, wantDir)
		}
	}
	for _, v := range []string{"debian", "15"} {
		t.Setenv(TestPGEnv, v)
		if _, err := TestBinDir(); err == nil || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s=%q: TestBinDir() error %v, want one line", TestPGEnv, v, err)
		}
	}
}

func TestVersionsRootDefault(t *testing.T) {
	t.Setenv(VersionsRootEnv, "")
	cache := t.TempDir()
	t.Setenv("XDG_CACHE_HOME", cache)
	want := filepath.Join(cache, "walrelay", "postgresql")
	if os.Geteuid() == 0 {
		// The postgres user runs the server and cannot enter /root.
		want = "/var/cache/walrelay/postgresql"
	}
	if got := VersionsRoot(); got != want {
		t.Fatalf("VersionsRoot() = %q, want %q", got, want)
	}
}
