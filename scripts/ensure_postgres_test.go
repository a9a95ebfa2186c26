// Package scripts holds the tests of the shell scripts next to them; it has
// no Go code of its own.
package scripts

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// machine is a fake Debian machine for ensure-postgres: a PATH holding only
// stubs of id, sudo and apt-get (which record their arguments), and an empty
// stand-in for /usr/lib/postgresql.
type machine struct {
	t      *testing.T
	bin    string // the whole PATH
	root   string // WALRELAY_PG_ROOT
	log    string // one line per stub call
	dryRun bool
	chmod  string
	mkdir  string
}

type machineOpts struct {
	uid        string // what `id -u` prints
	sudo       string // "" none, "ok" passwordless, "password" asks (fails with -n)
	noAptGet   bool
	aptNoFiles bool // apt-get succeeds but installs nothing
	aptFails   bool // apt-get install fails with a message
}

func newMachine(t *testing.T, o machineOpts) *machine {
	t.Helper()
	dir := t.TempDir()
	m := &machine{t: t, bin: filepath.Join(dir, "bin"), root: filepath.Join(dir, "usr/lib/postgresql"), log: filepath.Join(dir, "calls.log")}
	for _, d := range []string{m.bin, m.root} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var err error
	if m.chmod, err = exec.LookPath("chmod"); err != nil {
		t.Fatal(err)
	}
	if m.mkdir, err = exec.LookPath("mkdir"); err != nil {
		t.Fatal(err)
	}
	env, err := exec.LookPath("env")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(env, filepath.Join(m.bin, "env")); err != nil {
		t.Fatal(err)
	}
	m.stub("id", `[ "$1" = -u ] && echo `+o.uid)
	switch o.sudo {
	case "ok":
		m.stub("sudo", `echo "sudo $*" >> `+m.log+`; [ "$1" = -n ] && shift; "$@"`)
	case "password":
		m.stub("sudo", `echo "sudo $*" >> `+m.log+`; echo "sudo: a password is required" >&2; exit 1`)
	}
	if !o.noAptGet {
		install := `if [ "$1" = install ]; then ` + m.mkdir + ` -p ` + m.root + `/15/bin` +
			`; for f in ` + m.root + `/15/bin/initdb ` + m.root + `/15/bin/pg_ctl ` + m.bin + `/pg_recvlogical; do echo '#!/bin/sh' > $f; ` + m.chmod + ` +x $f; done; fi`
		if o.aptNoFiles {
			install = ""
		}
		if o.aptFails {
			install = `if [ "$1" = install ]; then echo "E: Unable to locate package $4"; exit 100; fi`
		}
		m.stub("apt-get", `echo "DEBIAN_FRONTEND=$DEBIAN_FRONTEND apt-get $*" >> `+m.log+"\n"+install)
	}
	return m
}

func (m *machine) stub(name, body string) {
	m.t.Helper()
	if err := os.WriteFile(filepath.Join(m.bin, name), []byte("#!/bin/bash\n"+body+"\n"), 0o755); err != nil {
		m.t.Fatal(err)
	}
}

// installServer puts a server where Debian does, off PATH.
func (m *machine) installServer() {
	m.t.Helper()
	d := filepath.Join(m.root, "15", "bin")
	if err := os.MkdirAll(d, 0o755); err != nil {
		m.t.Fatal(err)
	}
	for _, n := range []string{"initdb", "pg_ctl"} {
		if err := os.WriteFile(filepath.Join(d, n), []byte("#!/bin/sh\n"), 0o755); err != nil {
			m.t.Fatal(err)
		}
	}
}

func (m *machine) installClient() {
	m.t.Helper()
	if err := os.WriteFile(filepath.Join(m.bin, "pg_recvlogical"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		m.t.Fatal(err)
	}
}

// run runs the script with only the fake PATH; bash itself is found first.
func (m *machine) run(args ...string) (stdout, stderr string, code int) {
	m.t.Helper()
	bash, err := exec.LookPath("bash")
	if err != nil {
		m.t.Fatal(err)
	}
	cmd := exec.Command(bash, append([]string{"ensure-postgres"}, args...)...)
	cmd.Env = []string{"PATH=" + m.bin, "WALRELAY_PG_ROOT=" + m.root}
	if m.dryRun {
		cmd.Env = append(cmd.Env, "WALRELAY_DRY_RUN=1")
	}
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		m.t.Fatal(err)
	}
	return o.String(), e.String(), code
}

func (m *machine) calls() []string {
	b, err := os.ReadFile(m.log)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		m.t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

func equal(a, b []string) bool { return strings.Join(a, "\n") == strings.Join(b, "\n") }

func TestEnsurePostgresDoesNothingWhenInstalledOffPath(t *testing.T) {
	m := newMachine(t, machineOpts{uid: "0"})
	m.installServer()
	m.installClient()
	out, errOut, code := m.run("--client")
	if code != 0 || out != "" || errOut != "" || m.calls() != nil {
		t.Fatalf("exit %d, stdout %q, stderr %q, calls %q; want a silent success", code, out, errOut, m.calls())
	}
}

func TestEnsurePostgresDryRunPrintsInstall(t *testing.T) {
	for _, tc := range []struct {
		name   string
		o      machineOpts
		args   []string
		server bool
		want   []string // printed commands
		calls  []string
	}{
		{name: "root", o: machineOpts{uid: "0"}, want: []string{
			"+ apt-get update -qq",
			"+ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql",
		}},
		{name: "passwordless sudo", o: machineOpts{uid: "1000", sudo: "ok"}, want: []string{
			"+ sudo -n apt-get update -qq",
			"+ sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql",
		}, calls: []string{"sudo -n true"}},
		{name: "client only", o: machineOpts{uid: "0"}, args: []string{"--client"}, server: true, want: []string{
			"+ apt-get update -qq",
			"+ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-client",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMachine(t, tc.o)
			m.dryRun = true
			if tc.server {
				m.installServer()
			}
			out, errOut, code := m.run(tc.args...)
			if code != 0 {
				t.Fatalf("exit %d, stderr %q", code, errOut)
			}
			var printed []string
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "+ ") {
					printed = append(printed, l)
				}
			}
			if !equal(printed, tc.want) {
				t.Errorf("printed commands:\n%s\nwant:\n%s\n(stdout %q)", strings.Join(printed, "\n"), strings.Join(tc.want, "\n"), out)
			}
			if !equal(m.calls(), tc.calls) {
				t.Errorf("dry run called %q, want %q", m.calls(), tc.calls)
			}
		})
	}
}

// TestEnsurePostgresRefusesWithOneLine: a user who can neither be root nor
// use sudo without a password gets exactly one line naming the command.
func TestEnsurePostgresRefusesWithOneLine(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    machineOpts
		dry  bool
		want string
	}{
		{"sudo asks for a password", machineOpts{uid: "1000", sudo: "password"}, false, "run `sudo apt-get update && sudo apt-get install -y postgresql`, then `make demo` again"},
		{"sudo asks for a password, dry run", machineOpts{uid: "1000", sudo: "password"}, true, "run `sudo apt-get update && sudo apt-get install -y postgresql`, then `make demo` again"},
		{"no sudo", machineOpts{uid: "1000"}, false, "run `sudo apt-get update && sudo apt-get install -y postgresql`, then `make demo` again"},
		{"no apt-get", machineOpts{uid: "0", noAptGet: true}, false, "put the directory holding initdb and pg_ctl on PATH"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMachine(t, tc.o)
			m.dryRun = tc.dry
			out, errOut, code := m.run("--retry", "make demo")
			if code == 0 {
				t.Fatalf("exit 0 (stdout %q, stderr %q); want a refusal", out, errOut)
			}
			lines := strings.Split(strings.TrimRight(errOut, "\n"), "\n")
			if out != "" || len(lines) != 1 || !strings.Contains(lines[0], tc.want) {
				t.Fatalf("stdout %q, stderr %q; want one stderr line naming %q", out, errOut, tc.want)
			}
			for _, c := range m.calls() {
				if strings.Contains(c, "apt-get") {
					t.Fatalf("refusal ran %q", c)
				}
			}
		})
	}
}

// TestEnsurePostgresInstalls takes the real path against stub apt-get and
// sudo: update, then a noninteractive install, then the binaries are
// looked for again.
func TestEnsurePostgresInstalls(t *testing.T) {
	for _, tc := range []struct {
		name  string
		o     machineOpts
		calls []string
	}{
		{"root", machineOpts{uid: "0"}, []string{
			"DEBIAN_FRONTEND= apt-get update -qq",
			"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql",
		}},
		{"passwordless sudo", machineOpts{uid: "1000", sudo: "ok"}, []string{
			"sudo -n true",
			"sudo -n apt-get update -qq",
			"DEBIAN_FRONTEND= apt-get update -qq",
			"sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql",
			"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMachine(t, tc.o)
			out, errOut, code := m.run("--client")
			if code != 0 {
				t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			if !equal(m.calls(), tc.calls) {
				t.Fatalf("calls:\n%s\nwant:\n%s", strings.Join(m.calls(), "\n"), strings.Join(tc.calls, "\n"))
			}
			if !strings.Contains(out, "installing postgresql") {
				t.Errorf("stdout %q does not say what it installs", out)
			}
			// Run again: now a no-op.
			if out, errOut, code := m.run("--client"); code != 0 || out != "" || errOut != "" {
				t.Fatalf("second run: exit %d, stdout %q, stderr %q; want a silent success", code, out, errOut)
			}
		})
	}
}

func TestEnsurePostgresFailsWhenInstallLeavesNoServer(t *testing.T) {
	m := newMachine(t, machineOpts{uid: "0", aptNoFiles: true})
	out, errOut, code := m.run()
	if code == 0 {
		t.Fatalf("exit 0 (stdout %q); want failure when initdb is still missing", out)
	}
	if lines := strings.Split(strings.TrimRight(errOut, "\n"), "\n"); len(lines) != 1 || !strings.Contains(errOut, "initdb") {
		t.Fatalf("stderr %q; want one line about initdb", errOut)
	}
}

// TestEnsurePostgresShowsFailedInstall: apt-get's output is hidden while it
// works and shown when it fails, with the command that failed.
func TestEnsurePostgresShowsFailedInstall(t *testing.T) {
	m := newMachine(t, machineOpts{uid: "0", aptFails: true})
	out, errOut, code := m.run()
	if code == 0 {
		t.Fatalf("exit 0 (stdout %q); want failure", out)
	}
	for _, want := range []string{"E: Unable to locate package postgresql", "failed: env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr %q does not contain %q", errOut, want)
		}
	}
}
