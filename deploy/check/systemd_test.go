package check

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/coreos/go-systemd/v22/unit"
	"k8s.io/apimachinery/pkg/api/resource"
)

const (
	unitFile    = "../systemd/walrelay.service"
	unitEnvFile = "../systemd/walrelay.env.example"
)

// unitOptions reads the unit: section.name → values (a directive may repeat).
func unitOptions(t *testing.T, path string) map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	opts, err := unit.DeserializeOptions(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	m := map[string][]string{}
	for _, o := range opts {
		k := o.Section + "." + o.Name
		m[k] = append(m[k], o.Value)
	}
	return m
}

func last(m map[string][]string, k string) string {
	if v := m[k]; len(v) > 0 {
		return v[len(v)-1]
	}
	return ""
}

// runDefault is a flag's default from `walrelay run --help` ("--flag=30s").
func runDefault(t *testing.T, flag string) string {
	t.Helper()
	out, err := exec.Command(walrelayBinary(t), "run", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("walrelay run --help: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`--` + regexp.QuoteMeta(flag) + `=(\S+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("walrelay run --help shows no default of --%s", flag)
	}
	return strings.Trim(string(m[1]), `"`)
}

// TestSystemdUnit checks what the unit promises: restarts on failure but
// not on the exit codes main.go defines as a restart's dead ends, a stop
// timeout longer than the relay's own, credentials that only root and the
// service read, the hardening, and GOMEMLIMIT under MemoryMax.
func TestSystemdUnit(t *testing.T) {
	u := unitOptions(t, unitFile)
	if got := last(u, "Service.Restart"); got != "on-failure" {
		t.Errorf("Restart=%s, want on-failure", got)
	}
	var codes []int
	for _, v := range u["Service.RestartPreventExitStatus"] {
		for _, f := range strings.Fields(v) {
			n, err := strconv.Atoi(f)
			if err != nil {
				t.Errorf("RestartPreventExitStatus=%s: %v", v, err)
			}
			codes = append(codes, n)
		}
	}
	sort.Ints(codes)
	if want := noRestartCodes(t); !slices.Equal(codes, want) {
		t.Errorf("RestartPreventExitStatus=%v; main.go's codes a restart cannot fix are %v", codes, want)
	}

	stop, err := time.ParseDuration(last(u, "Service.TimeoutStopSec"))
	if err != nil {
		t.Fatalf("TimeoutStopSec: %v", err)
	}
	shutdown, err := time.ParseDuration(runDefault(t, "shutdown-timeout"))
	if err != nil {
		t.Fatal(err)
	}
	if stop <= shutdown {
		t.Errorf("TimeoutStopSec=%s is not longer than --shutdown-timeout's default %s: systemd would kill a relay still confirming", stop, shutdown)
	}

	for k, want := range map[string]string{
		"Service.DynamicUser":             "yes",
		"Service.NoNewPrivileges":         "yes",
		"Service.ProtectSystem":           "strict",
		"Service.ProtectHome":             "yes",
		"Service.PrivateTmp":              "yes",
		"Service.PrivateDevices":          "yes",
		"Service.CapabilityBoundingSet":   "",
		"Service.RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
		"Service.EnvironmentFile":         "/etc/walrelay/walrelay.env",
	} {
		if _, ok := u[k]; !ok || last(u, k) != want {
			t.Errorf("%s=%q (set: %v), want %q", k, last(u, k), ok, want)
		}
	}
	// The PostgreSQL password reaches the relay as a credential: a file in
	// the service's own credentials directory, not the environment.
	cred := last(u, "Service.LoadCredential")
	name, _, ok := strings.Cut(cred, ":")
	if !ok || !slices.Contains(u["Service.Environment"], "PGPASSFILE=%d/"+name) {
		t.Errorf("LoadCredential=%s with Environment=%v: want PGPASSFILE=%%d/<credential>", cred, u["Service.Environment"])
	}

	var gomem string
	for _, e := range u["Service.Environment"] {
		if v, ok := strings.CutPrefix(e, "GOMEMLIMIT="); ok {
			gomem = v
		}
	}
	q, err := goMemLimit(gomem)
	if err != nil {
		t.Fatalf("GOMEMLIMIT=%q: %v", gomem, err)
	}
	max, err := resource.ParseQuantity(strings.TrimSuffix(last(u, "Service.MemoryMax"), "M") + "Mi")
	if err != nil || q.Cmp(max) >= 0 {
		t.Errorf("GOMEMLIMIT=%s is not under MemoryMax=%s (%v)", gomem, last(u, "Service.MemoryMax"), err)
	}
}

// TestSystemdEnvExample: every variable the example environment file
// names, set or commented out, is one `walrelay run` reads.
func TestSystemdEnvExample(t *testing.T) {
	vars := runEnvVars(t)
	f, err := os.Open(unitEnvFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	assign := regexp.MustCompile(`^#?(WALRELAY_[A-Z0-9_]+)=`)
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if m := assign.FindStringSubmatch(sc.Text()); m != nil {
			n++
			if !vars[m[1]] {
				t.Errorf("%s names %s, which no flag of `walrelay run` reads", unitEnvFile, m[1])
			}
		}
	}
	if n == 0 {
		t.Fatalf("%s names no WALRELAY_ variable", unitEnvFile)
	}
}

// TestSystemdAnalyze runs systemd-analyze verify on the unit (its only
// change: ExecStart points at a walrelay binary that exists, since verify
// checks it), failing on any complaint: verify exits 0 after a directive it
// ignores. Then systemd-analyze security's exposure score must stay "OK".
func TestSystemdAnalyze(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not found: `make deps-systemd` installs it (Debian's systemd package)")
	}
	src, err := os.ReadFile(unitFile)
	if err != nil {
		t.Fatal(err)
	}
	const execStart = "ExecStart=/usr/local/bin/walrelay "
	if !bytes.Contains(src, []byte(execStart)) {
		t.Fatalf("%s has no %q", unitFile, execStart)
	}
	path := filepath.Join(t.TempDir(), "walrelay.service")
	if err := os.WriteFile(path, bytes.Replace(src, []byte(execStart), []byte("ExecStart="+walrelayBinary(t)+" "), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(sa, "verify", "--man=no", path).CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}

	out, err = exec.Command(sa, "security", "--offline=yes", path).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze security --offline=yes: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`Overall exposure level for walrelay\.service: ([0-9.]+) (\S+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("systemd-analyze security printed no exposure level:\n%s", out)
	}
	t.Logf("systemd-analyze security: exposure %s %s", m[1], m[2])
	if score, _ := strconv.ParseFloat(string(m[1]), 64); score > 2.0 {
		t.Errorf("exposure level %s %s, want at most 2.0 (OK): a hardening directive was lost", m[1], m[2])
	}
}
