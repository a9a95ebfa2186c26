package check

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"sync"
	"testing"
)

const (
	repoRoot = "../.."
	mainFile = "../../cmd/walrelay/main.go"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// TestMain removes the walrelay binary walrelayBinary built, if it did.
func TestMain(m *testing.M) {
	code := m.Run()
	if binPath != "" {
		os.RemoveAll(filepath.Dir(binPath))
	}
	os.Exit(code)
}

// walrelayBinary is the walrelay binary the deploy checks run: $WALRELAY_BIN
// (the Makefile passes the one `make build` made), else one built here.
func walrelayBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("WALRELAY_BIN"); p != "" {
		abs, err := filepath.Abs(p)
		if err != nil {
			t.Fatal(err)
		}
		return abs
	}
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "walrelay-check-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "walrelay")
		cmd := exec.Command("go", "build", "-o", binPath, "./cmd/walrelay")
		cmd.Dir = repoRoot
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = &buildError{out: string(out), err: err}
		}
	})
	if binErr != nil {
		t.Fatalf("build walrelay: %v", binErr)
	}
	return binPath
}

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return e.err.Error() + "\n" + e.out }

// exitCodes reads cmd/walrelay/main.go's exit* constants (exitFailed = 2,
// ...), the codes the deploy assets must agree with.
func exitCodes(t *testing.T) map[string]int {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), mainFile, nil, 0)
	if err != nil {
		t.Fatalf("parse %s: %v", mainFile, err)
	}
	codes := map[string]int{}
	ast.Inspect(f, func(n ast.Node) bool {
		vs, ok := n.(*ast.ValueSpec)
		if !ok || len(vs.Names) != 1 || len(vs.Values) != 1 {
			return true
		}
		lit, ok := vs.Values[0].(*ast.BasicLit)
		if !ok || lit.Kind != token.INT {
			return true
		}
		if name := vs.Names[0].Name; len(name) > 4 && name[:4] == "exit" {
			v, _ := strconv.Atoi(lit.Value)
			codes[name] = v
		}
		return true
	})
	for _, name := range []string{"exitFailed", "exitFenced", "exitUsage"} {
		if _, ok := codes[name]; !ok {
			t.Fatalf("%s defines no %s constant: has it moved? The exit-code checks would be vacuous", mainFile, name)
		}
	}
	return codes
}

// noRestartCodes are the exit codes of `walrelay run` that a restart
// cannot fix: refused or failed (2), fenced (3), bad configuration (80).
func noRestartCodes(t *testing.T) []int {
	c := exitCodes(t)
	codes := []int{c["exitFailed"], c["exitFenced"], c["exitUsage"]}
	sort.Ints(codes)
	return codes
}

var envRef = regexp.MustCompile(`\$(WALRELAY_[A-Z0-9_]+)`)

// runEnvVars are the WALRELAY_* variables `walrelay run` reads, from its
// help (kong prints each flag's variable): the authority on which names
// exist, since kong ignores a variable that names no flag.
func runEnvVars(t *testing.T) map[string]bool {
	t.Helper()
	out, err := exec.Command(walrelayBinary(t), "run", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("walrelay run --help: %v\n%s", err, out)
	}
	vars := map[string]bool{}
	for _, m := range envRef.FindAllStringSubmatch(string(out), -1) {
		vars[m[1]] = true
	}
	if !vars["WALRELAY_PG_URL"] || !vars["WALRELAY_BROKERS"] {
		t.Fatalf("walrelay run --help names no WALRELAY_PG_URL or WALRELAY_BROKERS: has its format changed?\n%s", out)
	}
	return vars
}
