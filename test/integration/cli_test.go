package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// cliResult is what one run of the walrelay binary left behind.
type cliResult struct {
	stdout, stderr string
	code           int
	took           time.Duration
}

// output is everything the process wrote.
func (r cliResult) output() string { return r.stdout + r.stderr }

// runCLI runs the binary to its end (killed after timeout, which fails the
// test) and returns its exit code and what it wrote on each stream.
func (e *env) runCLI(timeout time.Duration, env []string, args ...string) cliResult {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(e.ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, binPath, args...)
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	r := cliResult{stdout: stdout.String(), stderr: stderr.String(), took: time.Since(start)}
	e.t.Logf("walrelay %s\n-- exit after %s: %v\n-- stdout:\n%s-- stderr:\n%s", strings.Join(args, " "), r.took.Round(time.Millisecond), err, r.stdout, r.stderr)
	var exitErr *exec.ExitError
	switch {
	case ctx.Err() != nil:
		e.t.Fatalf("walrelay %s still running after %s", args[0], timeout)
	case errors.As(err, &exitErr):
		r.code = exitErr.ExitCode()
	case err != nil:
		e.t.Fatal(err)
	}
	return r
}

// slotCount counts the replication slots of the test's database.
func (e *env) slotCount() int {
	e.t.Helper()
	var n int
	c := e.conn()
	if err := c.QueryRow(e.ctx, "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()").Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// TestCLINotAKafkaBroker points --brokers at PostgreSQL's port: the relay
// must say the endpoint is not a Kafka broker and exit at once, not retry
// until --startup-timeout and end with franz-go's "invalid large response
// size".
func TestCLINotAKafkaBroker(t *testing.T) {
	e := newEnv(t)
	u, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	args := withFlag(e.args(), "--brokers", u.Host)
	args = withFlag(args, "--startup-timeout", "60s")
	r := e.runCLI(90*time.Second, nil, args...)
	if r.code != 2 {
		t.Errorf("exit code %d, want 2", r.code)
	}
	if r.took > 25*time.Second {
		t.Errorf("took %s with --startup-timeout 60s: a configuration error must not be retried", r.took)
	}
	if !strings.Contains(r.stderr, "did not answer as a Kafka broker") {
		t.Errorf("stderr does not say the endpoint is not a Kafka broker")
	}
}

// TestCLIPostgresCredentialsExitAtOnce runs the binary with a wrong
// password (SQLSTATE 28P01) and as a role pg_hba.conf rejects (28000) on a
// cluster that requires SCRAM for the role: both exit at once with code 2,
// and no output stream holds the password.
func TestCLIPostgresCredentialsExitAtOnce(t *testing.T) {
	if pgCluster == nil {
		t.Skip("needs a PostgreSQL cluster of its own; skipped against an external PostgreSQL")
	}
	// The devcluster trusts every local connection, where any password
	// passes: give this cluster an hba file that asks walrelay_pw for
	// SCRAM and rejects walrelay_nohba.
	// The server runs as the postgres user: the file must be readable by
	// it, which t.TempDir's 0700 parent is not.
	dir, err := os.MkdirTemp("", "walrelay-hba-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	hba := filepath.Join(dir, "pg_hba.conf")
	if err := os.WriteFile(hba, []byte(strings.Join([]string{
		"local all all trust",
		"host all walrelay_pw 127.0.0.1/32 scram-sha-256",
		"host replication walrelay_pw 127.0.0.1/32 scram-sha-256",
		"host all walrelay_nohba 127.0.0.1/32 reject",
		"host replication walrelay_nohba 127.0.0.1/32 reject",
		"host all all 127.0.0.1/32 trust",
		"host replication all 127.0.0.1/32 trust",
		"",
	}, "\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	e, pg := newClusterEnv(t, map[string]string{"hba_file": "'" + hba + "'"})
	const right, wrong = "Right-pw-4711", "Wrong-pw-0815"
	e.exec(fmt.Sprintf("CREATE ROLE walrelay_pw LOGIN REPLICATION PASSWORD '%s'", right))
	e.exec(fmt.Sprintf("CREATE ROLE walrelay_nohba LOGIN REPLICATION PASSWORD '%s'", right))
	roleURL := func(user, pw string) string {
		return fmt.Sprintf("postgres://%s:%s@127.0.0.1:%d/%s?sslmode=disable", user, pw, pg.Port, e.name)
	}
	// The hba file is in force: the right password connects.
	if c, err := pgx.Connect(e.ctx, roleURL("walrelay_pw", right)); err != nil {
		t.Fatalf("the right password does not connect: %v", err)
	} else {
		c.Close(context.Background())
	}
	for _, tc := range []struct{ name, url, sqlstate string }{
		{"wrong password", roleURL("walrelay_pw", wrong), "28P01"},
		{"no pg_hba entry", roleURL("walrelay_nohba", wrong), "28000"},
	} {
		{
			args := withFlag(e.args(), "--pg-url", tc.url)
			args = withFlag(args, "--startup-timeout", "60s")
			r := e.runCLI(90*time.Second, nil, args...)
			if r.code != 2 {
				t.Errorf("%s: exit code %d, want 2", tc.name, r.code)
			}
			if r.took > 20*time.Second {
				t.Errorf("%s: took %s with --startup-timeout 60s: a credential error must not be retried", tc.name, r.took)
			}
			if !strings.Contains(r.stderr, tc.sqlstate) {
				t.Errorf("%s: stderr does not name SQLSTATE %s", tc.name, tc.sqlstate)
			}
			for _, cmd := range [][]string{args, {"status", "--pg-url", tc.url}, {"setup", "--pg-url", tc.url}, {"drop", "--pg-url", tc.url}} {
				out := r.output()
				if cmd[0] != "run" {
					out = e.runCLI(60*time.Second, nil, cmd...).output()
				}
				if strings.Contains(out, wrong) || strings.Contains(out, right) {
					t.Errorf("%s: walrelay %s printed the password", tc.name, cmd[0])
				}
			}
		}
	}
}

// TestCLIEmptyPGURL refuses --pg-url "" in every command, like a missing
// flag, instead of dialling a Unix socket as the OS user.
func TestCLIEmptyPGURL(t *testing.T) {
	e := newEnv(t)
	for _, cmd := range []string{"run", "status", "setup", "drop"} {
		args := []string{cmd, "--pg-url", ""}
		if cmd == "run" {
			args = withFlag(e.args(), "--pg-url", "")
		}
		r := e.runCLI(60*time.Second, nil, args...)
		if r.code != 80 {
			t.Errorf("walrelay %s --pg-url \"\": exit code %d, want 80", cmd, r.code)
		}
		if !strings.Contains(r.stderr, "--pg-url") {
			t.Errorf("walrelay %s --pg-url \"\": stderr does not name --pg-url", cmd)
		}
	}
}

// TestCLIBadSlotNameRefusedEverywhere passes a slot name that would alter
// the replication command ('inj TEMPORARY') to every command: each must
// refuse it as a malformed flag (exit 80) and create nothing.
func TestCLIBadSlotNameRefusedEverywhere(t *testing.T) {
	e := newEnv(t)
	const bad = "inj TEMPORARY"
	for _, cmd := range []string{"run", "status", "setup", "drop"} {
		args := []string{cmd, "--pg-url", e.url, "--slot", bad}
		switch cmd {
		case "run":
			args = withFlag(e.args(), "--slot", bad)
		case "setup":
			args = append(args, "--publication", e.name)
		}
		r := e.runCLI(60*time.Second, nil, args...)
		if r.code != 80 {
			t.Errorf("walrelay %s --slot %q: exit code %d, want 80", cmd, bad, r.code)
		}
		if !strings.Contains(r.stderr, "slot name") {
			t.Errorf("walrelay %s --slot %q: stderr does not explain the slot name rule", cmd, bad)
		}
	}
	var pubs int
	if err := e.conn().QueryRow(e.ctx, "SELECT count(*) FROM pg_publication").Scan(&pubs); err != nil {
		t.Fatal(err)
	}
	if n := e.slotCount(); n != 0 || pubs != 0 {
		t.Errorf("after the refusals: %d slots, %d publications; want none", n, pubs)
	}
}

// TestCLIExitCodes checks the exit code rule docs/reference/exit-codes.md states: malformed
// flags and configuration, whether kong or walrelay finds them, exit 80; a
// database that refuses the setup exits 2.
func TestCLIExitCodes(t *testing.T) {
	e := newEnv(t)
	for _, tc := range []struct {
		name string
		env  []string
		args []string
		code int
	}{
		{"unknown flag", nil, append(e.args(), "--no-such-flag"), 80},
		{"bad enum", nil, withFlag(e.args(), "--on-invalid", "explode"), 80},
		{"bad duration", nil, withFlag(e.args(), "--linger", "soon"), 80},
		{"bad duration in the environment", []string{"WALRELAY_LINGER=soon"}, e.args(), 80},
		{"bad slot name", nil, withFlag(e.args(), "--slot", "Bad-Slot"), 80},
		{"bad header column", nil, withFlag(e.args(), "--header-column", "=x"), 80},
		{"bad table", nil, withFlag(e.args(), "--table", "a.b.c"), 80},
		{"bad topic template", nil, withFlag(e.args(), "--topic-template", "bad topic {aggregate_type}"), 80},
		{"exactly-once commit interval over half the timeout", nil,
			append(withFlag(e.args(), "--txn-max-interval", "40s"), "--delivery", "exactly-once"), 80},
		{"setup with a bad table", nil, []string{"setup", "--pg-url", e.url, "--table", "a.b.c"}, 80},
		{"setup refusal: outbox table missing", nil, append(withFlag(e.args(), "--table", "public.no_such_outbox"), "--startup-timeout", "30s"), 2},
	} {
		r := e.runCLI(60*time.Second, tc.env, tc.args...)
		if r.code != tc.code {
			t.Errorf("%s: exit code %d, want %d", tc.name, r.code, tc.code)
		}
	}
}

// TestCLIStatusInactiveSlot: a slot no relay reads is not silently "ok".
// status warns about it, and --require-active makes it exit 1.
func TestCLIStatusInactiveSlot(t *testing.T) {
	e := newEnv(t)
	r := e.runCLI(60*time.Second, nil, "setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name)
	if r.code != 0 {
		t.Fatalf("setup: exit code %d", r.code)
	}
	// The test's URL (sslmode=disable over TCP) is what run warns about at
	// start; every command that connects says it too (status on stderr,
	// keeping stdout to the slot's figures).
	const plaintext = "sslmode=disable may connect in plaintext"
	if !strings.Contains(r.output(), plaintext) {
		t.Errorf("setup with sslmode=disable does not warn about it")
	}
	r = e.runCLI(60*time.Second, nil, "status", "--pg-url", e.url, "--slot", e.name)
	if r.code != 0 {
		t.Errorf("status of an idle slot: exit code %d, want 0 without --require-active", r.code)
	}
	if !strings.Contains(r.stderr, plaintext) || strings.Contains(r.stdout, plaintext) {
		t.Errorf("status with sslmode=disable: the warning should be on stderr only (stderr %q)", r.stderr)
	}
	if !strings.Contains(r.stdout, "no relay is streaming from this slot") {
		t.Errorf("status does not warn that no relay streams from the slot")
	}
	r = e.runCLI(60*time.Second, nil, "status", "--pg-url", e.url, "--slot", e.name, "--json")
	if !strings.Contains(r.stdout, `"warnings": [`) || !strings.Contains(r.stdout, "no relay is streaming") {
		t.Errorf("status --json does not carry the warning")
	}
	r = e.runCLI(60*time.Second, nil, "status", "--pg-url", e.url, "--slot", e.name, "--require-active")
	if r.code != 1 || !strings.Contains(r.stdout, "UNHEALTHY") {
		t.Errorf("status --require-active of an idle slot: exit code %d, want 1 and UNHEALTHY", r.code)
	}

	// With a relay streaming, --require-active is satisfied.
	e.runBinary(e.args()...)
	e.waitFor("the relay streams", 60*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	r = e.runCLI(60*time.Second, nil, "status", "--pg-url", e.url, "--slot", e.name, "--require-active")
	if r.code != 0 || strings.Contains(r.stdout, "no relay is streaming") {
		t.Errorf("status --require-active of a streamed slot: exit code %d, want 0 and no warning", r.code)
	}
}

// TestCLIDropPendingRows: drop refuses a slot that still holds committed,
// unpublished outbox rows unless --force, and says what it discards.
func TestCLIDropPendingRows(t *testing.T) {
	e := newEnv(t)
	setup := []string{"setup", "--pg-url", e.url, "--slot", e.name, "--publication", e.name}
	drop := []string{"drop", "--pg-url", e.url, "--slot", e.name, "--publication", e.name}
	if r := e.runCLI(60*time.Second, nil, setup...); r.code != 0 {
		t.Fatalf("setup: exit code %d", r.code)
	}
	// Nothing pending: drop needs no --force.
	if r := e.runCLI(60*time.Second, nil, drop...); r.code != 0 || !strings.Contains(r.stdout, "dropped slot") {
		t.Fatalf("drop of a slot without pending rows: exit code %d", r.code)
	} else if !strings.Contains(r.output(), "sslmode=disable may connect in plaintext") {
		t.Errorf("drop with sslmode=disable does not warn about it")
	}

	if r := e.runCLI(60*time.Second, nil, setup...); r.code != 0 {
		t.Fatalf("setup: exit code %d", r.code)
	}
	e.exec("INSERT INTO outbox (aggregate_type, aggregate_id, payload) SELECT 'order', g::text, '{}' FROM generate_series(1, 3) g")
	r := e.runCLI(60*time.Second, nil, drop...)
	if r.code != 2 {
		t.Errorf("drop with 3 pending rows: exit code %d, want 2", r.code)
	}
	if !strings.Contains(r.stderr, "3 outbox rows") || !strings.Contains(r.stderr, "--force") {
		t.Errorf("drop does not say that 3 outbox rows are pending and --force drops anyway")
	}
	if e.slotCount() != 1 {
		t.Fatal("drop without --force dropped the slot")
	}
	r = e.runCLI(60*time.Second, nil, append(drop, "--force")...)
	if r.code != 0 || !strings.Contains(r.stdout, "dropped slot") || !strings.Contains(r.stdout, "3 outbox rows") {
		t.Errorf("drop --force: exit code %d; want 0, the slot dropped and the 3 discarded rows named", r.code)
	}
	if e.slotCount() != 0 {
		t.Error("drop --force left the slot")
	}
}
