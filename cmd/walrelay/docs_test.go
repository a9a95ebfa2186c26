package main

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/alecthomas/kong"

	"github.com/walrelay/walrelay/test/refdoc"
)

// runFlags returns the flags of `walrelay run` with their environment
// variables, from the same kong model the binary parses with.
func runFlags(t *testing.T) map[string]string {
	t.Helper()
	flags := map[string]string{}
	for _, f := range runFlagModels(t) {
		env := ""
		if len(f.Envs) > 0 {
			env = f.Envs[0]
		}
		flags[f.Name] = env
	}
	return flags
}

// runFlagModels returns kong's model of each flag of `walrelay run`.
func runFlagModels(t *testing.T) []*kong.Flag {
	t.Helper()
	k := model(t)
	var flags []*kong.Flag
	for _, n := range k.Model.Children {
		if n.Name != "run" {
			continue
		}
		for _, g := range n.AllFlags(true) {
			for _, f := range g {
				if f.Name == "help" || f.Name == "version" {
					continue
				}
				flags = append(flags, f)
			}
		}
	}
	if len(flags) < 20 {
		t.Fatalf("found only %d flags of walrelay run", len(flags))
	}
	return flags
}

// TestEveryFlagHasItsEnvironmentVariable checks the WALRELAY_* naming rule
// docs/reference/walrelay.md states, for every flag of every command but
// --help and --version.
func TestEveryFlagHasItsEnvironmentVariable(t *testing.T) {
	k := model(t)
	nodes := append([]*kong.Node{k.Model.Node}, refdoc.Commands(k.Model)...)
	n := 0
	for _, node := range nodes {
		for _, f := range node.Flags {
			if f.Name == "help" || f.Name == "version" {
				continue
			}
			n++
			want := "WALRELAY_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
			if len(f.Envs) != 1 || f.Envs[0] != want {
				t.Errorf("walrelay %s --%s reads %q, want %q", node.Path(), f.Name, f.Envs, want)
			}
		}
	}
	if n < 100 {
		t.Fatalf("found only %d flags in walrelay's commands", n)
	}
}

// TestComposeUsesRealVariables catches a docker-compose.yml that sets an
// environment variable walrelay does not read.
func TestComposeUsesRealVariables(t *testing.T) {
	compose, err := os.ReadFile("../../docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, env := range runFlags(t) {
		known[env] = true
	}
	found := regexp.MustCompile(`(?m)^\s+(WALRELAY_[A-Z_]+):`).FindAllStringSubmatch(string(compose), -1)
	if len(found) < 2 {
		t.Fatalf("found %d WALRELAY_ variables in docker-compose.yml", len(found))
	}
	for _, m := range found {
		if !known[m[1]] {
			t.Errorf("docker-compose.yml sets %s, which walrelay run does not read", m[1])
		}
	}
}

// TestOutboxDDLMatchesDeploy keeps deploy/outbox.sql (used by compose),
// the pages that show the table (the README's and getting-started's first
// step, outbox-table.md) and `walrelay dev` on one table definition.
func TestOutboxDDLMatchesDeploy(t *testing.T) {
	want := outboxDDL("public.outbox")
	for _, f := range []string{"../../deploy/outbox.sql", "../../README.md", "../../docs/getting-started.md", "../../docs/outbox-table.md"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), want) {
			t.Errorf("%s does not contain the outbox DDL walrelay dev uses:\n%s", f, want)
		}
	}
}
