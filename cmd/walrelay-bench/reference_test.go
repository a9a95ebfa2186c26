package main

// reference_test.go writes docs/reference/walrelay-bench.md from the kong
// model the binary parses with and its exit code constants; TestReference
// fails while the committed page differs. `make docs` rewrites it.

import (
	"fmt"
	"strings"
	"testing"

	"github.com/alecthomas/kong"

	"github.com/walrelay/walrelay/test/refdoc"
)

func TestReference(t *testing.T) {
	var c benchCmd
	k, err := kong.New(&c, parserOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	codes, err := refdoc.Consts(".", "", "exit")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"exitFailed": exitFailed, "exitSetup": exitSetup, "exitUsage": exitUsage}
	if len(codes) != len(want) {
		t.Errorf("main.go declares %d exit* constants, this test knows %d", len(codes), len(want))
	}

	var b strings.Builder
	b.WriteString("# walrelay-bench: flags\n\n")
	b.WriteString(refdoc.Generated("the command line walrelay-bench parses (kong's model, cmd/walrelay-bench)"))
	fmt.Fprintf(&b, "\n%s\n\nThe figures it measured and the commands that reproduce them: [BENCHMARKS.md](../../BENCHMARKS.md).\n"+
		"`make build-bench` builds it beside `bin/walrelay`, the relay it measures.\n\n", k.Model.Help)
	b.WriteString("Every flag but `--help` can be set by an environment variable instead: `WALRELAY_` and the flag's\n" +
		"name in upper case, `_` for `-`; a list takes commas. A flag given on the command line wins.\n\n")
	b.WriteString(refdoc.FlagTable(refdoc.Flags(k.Model.Node)))
	b.WriteString("\n## Exit codes\n\n| code | meaning |\n| --- | --- |\n| 0 | Every measurement ran. |\n")
	for _, c := range codes {
		if v, ok := want[c.Name]; !ok || fmt.Sprint(v) != c.Value {
			t.Errorf("main.go's %s = %s, want %v", c.Name, c.Value, v)
		}
		fmt.Fprintf(&b, "| %s | %s |\n", c.Value, refdoc.Cell(c.Doc))
	}
	refdoc.Check(t, "../../docs/reference/walrelay-bench.md", []byte(b.String()))
}

// TestEveryFlagHasItsEnvironmentVariable checks the WALRELAY_* naming rule
// docs/reference/walrelay-bench.md states.
func TestEveryFlagHasItsEnvironmentVariable(t *testing.T) {
	var c benchCmd
	k, err := kong.New(&c, parserOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	flags := refdoc.Flags(k.Model.Node)
	if len(flags) < 10 {
		t.Fatalf("found only %d flags of walrelay-bench", len(flags))
	}
	for _, f := range k.Model.Flags {
		if f.Name == "help" {
			continue
		}
		want := "WALRELAY_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if len(f.Envs) != 1 || f.Envs[0] != want {
			t.Errorf("--%s reads %q, want %q", f.Name, f.Envs, want)
		}
	}
}
