package devcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// Versions are the PostgreSQL major versions of the version matrix, oldest
// first: those scripts/ensure-pg-versions installs (`make
// deps-pg-versions`) and `make test-pg` runs the integration suite on.
var Versions = []int{14, 15, 16, 17, 18}

// VersionsRootEnv names the environment variable that replaces
// VersionsRoot's default, read by scripts/ensure-pg-versions too.
const VersionsRootEnv = "WALRELAY_PG_CACHE"

// TestPGEnv names the environment variable that picks the server the tests
// start: a major version of Versions, or "local" (the default) for the
// server BinDir finds.
const TestPGEnv = "WALRELAY_TEST_PG"

// VersionsRoot is where the matrix's servers are installed, one
// <major>/bin per version: $WALRELAY_PG_CACHE, else
// /var/cache/walrelay/postgresql for root (the tests run PostgreSQL as the
// postgres user then, and it cannot enter /root), else
// walrelay/postgresql under the user's cache directory ($XDG_CACHE_HOME or
// ~/.cache). scripts/ensure-pg-versions computes the same.
func VersionsRoot() string {
	if r := os.Getenv(VersionsRootEnv); r != "" {
		return r
	}
	if os.Geteuid() == 0 {
		return "/var/cache/walrelay/postgresql"
	}
	dir, err := os.UserCacheDir()
	if err != nil {
		dir = filepath.Join(os.TempDir(), "walrelay-cache")
	}
	return filepath.Join(dir, "walrelay", "postgresql")
}

// InstalledBinDir is the bin directory of major version major of the
// matrix under VersionsRoot. Its error is one line naming the command that
// installs it.
func InstalledBinDir(major int) (string, error) {
	known := false
	for _, v := range Versions {
		known = known || v == major
	}
	if !known {
		return "", fmt.Errorf("PostgreSQL %d is not in the version matrix %v", major, Versions)
	}
	dir := filepath.Join(VersionsRoot(), strconv.Itoa(major), "bin")
	if !hasServer(dir) || !isExecutable(filepath.Join(dir, "postgres")) {
		return "", fmt.Errorf("PostgreSQL %d is not installed in %s: run `make deps-pg-versions` (or scripts/ensure-pg-versions %d)", major, dir, major)
	}
	return dir, nil
}

// TestBinDir is the bin directory of the server WALRELAY_TEST_PG picks:
// "" for local (StartPostgres then uses BinDir), or InstalledBinDir of the
// major version it names. Its error is one line.
func TestBinDir() (string, error) {
	switch v := os.Getenv(TestPGEnv); v {
	case "", "local":
		return "", nil
	default:
		major, err := strconv.Atoi(v)
		if err != nil {
			return "", fmt.Errorf("%s=%q: use local (the default) or a major version of %v", TestPGEnv, v, Versions)
		}
		return InstalledBinDir(major)
	}
}

// ServerVersionNum is the running server's server_version_num (170010 for
// 17.10).
func (p *Postgres) ServerVersionNum(ctx context.Context) (int, error) {
	var n int
	err := p.queryRow(ctx, "SELECT current_setting('server_version_num')::int", &n)
	return n, err
}

// ServerVersion is the running server's server_version ("17.10").
func (p *Postgres) ServerVersion(ctx context.Context) (string, error) {
	var s string
	err := p.queryRow(ctx, "SHOW server_version", &s)
	return s, err
}

// Major is the running server's major version (17).
func (p *Postgres) Major(ctx context.Context) (int, error) {
	n, err := p.ServerVersionNum(ctx)
	return n / 10000, err
}
