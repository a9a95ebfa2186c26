package main

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/alecthomas/kong"

	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/relay"
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
	var c cli
	k, err := kong.New(&c, parserOptions()...)
	if err != nil {
		t.Fatal(err)
	}
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

// TestReadmeListsEveryFlag keeps the README's flag table complete.
func TestReadmeListsEveryFlag(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	for name := range runFlags(t) {
		if !strings.Contains(string(readme), "`--"+name+"`") && !strings.Contains(string(readme), "`--[no-]"+name+"`") {
			t.Errorf("README does not document --%s", name)
		}
	}
}

// readmeFlagRow matches a row of the README's flag table: the flag cell
// (one or more `--name`) and the default cell.
var readmeFlagRow = regexp.MustCompile("(?m)^\\| (`--[^|]+) \\| ([^|]+) \\|")

// computedDefaults are flags whose README default describes a value derived
// at run time (kong's default is empty).
var computedDefaults = map[string]string{"transactional-id": "`walrelay-<slot>`"}

// TestReadmeFlagDefaults keeps the default column of the README's flag table
// equal to the defaults the binary applies: `value` is kong's default
// verbatim, on/off a boolean, none or (required) no default.
func TestReadmeFlagDefaults(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]string{}
	for _, m := range readmeFlagRow.FindAllStringSubmatch(string(readme), -1) {
		for _, name := range regexp.MustCompile("`--(?:\\[no-\\])?([a-z0-9-]+)`").FindAllStringSubmatch(m[1], -1) {
			documented[name[1]] = strings.TrimSpace(m[2])
		}
	}
	if len(documented) < 20 {
		t.Fatalf("found only %d rows in the README's flag table", len(documented))
	}
	for _, f := range runFlagModels(t) {
		cell, ok := documented[f.Name]
		if !ok {
			continue // TestReadmeListsEveryFlag reports it
		}
		want := "`" + f.Default + "`"
		switch {
		case computedDefaults[f.Name] != "":
			want = computedDefaults[f.Name]
		case f.IsBool():
			want = "off"
			if f.Default == "true" {
				want = "on"
			}
		case f.Default == "" && f.Required:
			want = "(required)"
		case f.Default == "":
			want = "none"
		}
		if cell != want {
			t.Errorf("README gives --%s the default %s; the binary's default is %s", f.Name, cell, want)
		}
	}
}

// TestEveryFlagHasItsEnvironmentVariable checks the WALRELAY_* naming rule
// the README states.
func TestEveryFlagHasItsEnvironmentVariable(t *testing.T) {
	for name, env := range runFlags(t) {
		want := "WALRELAY_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
		if env != want {
			t.Errorf("--%s reads %q, want %q", name, env, want)
		}
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
// the README and `walrelay dev` on one table definition.
func TestOutboxDDLMatchesDeploy(t *testing.T) {
	want := outboxDDL("public.outbox")
	for _, f := range []string{"../../deploy/outbox.sql", "../../README.md"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), want) {
			t.Errorf("%s does not contain the outbox DDL walrelay dev uses:\n%s", f, want)
		}
	}
}

// TestReadmeListsMetricLabels keeps the README's metrics table naming every
// restart cause and heartbeat kind the relay counts.
func TestReadmeListsMetricLabels(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	row := func(metric string) string {
		for _, line := range strings.Split(string(readme), "\n") {
			if strings.HasPrefix(line, "| ") && strings.Contains(line, "`"+metric+"`") {
				return line
			}
		}
		t.Fatalf("README's metrics table has no row for %s", metric)
		return ""
	}
	causes := row("walrelay_stream_restarts_total{cause}")
	for _, c := range relay.RestartCauses() {
		if !strings.Contains(causes, "`"+string(c)+"`") {
			t.Errorf("README's row of walrelay_stream_restarts_total does not list the cause %s", c)
		}
	}
	kinds := row("walrelay_heartbeats_total{kind}")
	for _, k := range heartbeat.Kinds() {
		if !strings.Contains(kinds, "`"+string(k)+"`") {
			t.Errorf("README's row of walrelay_heartbeats_total does not list the kind %s", k)
		}
	}
}
