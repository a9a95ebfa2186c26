package integration

// Tests of odd schemas, odd endpoints and operator mistakes (issue 21):
// each is either refused at once, before anything is created, with one
// line naming the fix, or streamed without stalling (rows that cannot
// become records are dead-lettered).

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/source"
)

// useDatabase moves the test to a database of its own created with
// encoding enc (locale C, which takes any encoding), holding the same
// outbox table.
func (e *env) useDatabase(enc string) {
	e.t.Helper()
	admin, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	defer admin.Close(context.Background())
	db := e.name + "_" + strings.ToLower(enc)
	if _, err := admin.Exec(e.ctx, fmt.Sprintf("CREATE DATABASE %s ENCODING %s LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
		pgx.Identifier{db}.Sanitize(), quoteLit(enc))); err != nil {
		e.t.Fatal(err)
	}
	u, err := url.Parse(e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	u.Path = "/" + db
	e.url = u.String()
	e.exec(`CREATE TABLE outbox (
		id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
		aggregate_type text,
		aggregate_id text,
		type text,
		payload jsonb,
		seq bigint
	)`)
}

func quoteLit(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// publicationExists reports whether the test's publication exists.
func (e *env) publicationExists() bool {
	e.t.Helper()
	var n int
	if err := e.conn().QueryRow(e.ctx, `SELECT count(*) FROM pg_publication WHERE pubname = $1`, e.name).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n > 0
}

// brokerTopics lists the topics on the test's broker.
func (e *env) brokerTopics() kadm.TopicDetails {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	td, err := kadm.NewClient(cl).ListTopics(e.ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	return td
}

// TestOddStartupRefusals: what can never stream is refused at the first
// start, at once (no retry until --startup-timeout), with exit 2 and one
// line naming the fix, and before anything is created: no publication, no
// slot, no record of the rows already in the table.
func TestOddStartupRefusals(t *testing.T) {
	const startup = 60 * time.Second
	type tc struct {
		name string
		// prepare sets the case up and returns the arguments; it may
		// move e to another server (a standby, a pooler).
		prepare func(t *testing.T, e *env) []string
		want    []string
		// own: the test needs a PostgreSQL cluster of its own, with these
		// settings.
		own map[string]string
	}
	run := func(e *env, more ...string) []string {
		return withFlag(append(e.args(), more...), "--startup-timeout", startup.String())
	}
	cases := []tc{
		{
			// Issue 21, case 1: binary mode cannot render an array.
			name: "binary with a text[] aggregate id",
			prepare: func(t *testing.T, e *env) []string {
				e.exec(`ALTER TABLE outbox ALTER COLUMN aggregate_id TYPE text[] USING ARRAY[aggregate_id]`)
				return run(e, "--binary")
			},
			want: []string{"--binary", `column "aggregate_id"`, "text[]", "without --binary"},
		},
		{
			// Case 3: SQL_ASCII text has no encoding to convert from.
			name: "SQL_ASCII database",
			prepare: func(t *testing.T, e *env) []string {
				e.useDatabase("SQL_ASCII")
				e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('a', 'caf' || chr(233), 'T', '{}')`)
				return withFlag(run(e), "--pg-url", e.url)
			},
			want: []string{"SQL_ASCII", "UTF-8", "ENCODING 'UTF8'"},
		},
		{
			// Case 4: pgoutput (before 18) leaves generated columns out.
			name: "generated aggregate_type",
			prepare: func(t *testing.T, e *env) []string {
				e.exec(`ALTER TABLE outbox DROP COLUMN aggregate_type`)
				e.exec(`ALTER TABLE outbox ADD COLUMN aggregate_type text GENERATED ALWAYS AS (payload->>'kind') STORED`)
				e.exec(`INSERT INTO outbox (aggregate_id, type, payload) VALUES ('1', 'T', '{"kind": "order"}')`)
				return run(e)
			},
			want: []string{`column "aggregate_type"`, "generated column", "DROP EXPRESSION", "--column-"},
		},
		{
			// Case 8: a view cannot be added to a publication.
			name: "a view as --table",
			prepare: func(t *testing.T, e *env) []string {
				e.exec(`CREATE VIEW outbox_v AS SELECT * FROM outbox`)
				return run(e, "--table", "public.outbox_v")
			},
			want: []string{"outbox_v", "is a view", "--table", "pg_get_viewdef"},
		},
		{
			// Case 8: the initial snapshot needs two free slots.
			name: "one free replication slot for the snapshot",
			own:  map[string]string{"max_replication_slots": "2"},
			prepare: func(t *testing.T, e *env) []string {
				e.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, e.name+"_other")
				e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('a', '1', 'T', '{}')`)
				return run(e)
			},
			want: []string{"max_replication_slots is 2", "needs 2 free", "--snapshot never", e2eSlotHint},
		},
		{
			// Case 7: a hot standby, as a read-replica endpoint.
			name: "hot standby as --pg-url",
			own:  map[string]string{},
			prepare: func(t *testing.T, e *env) []string {
				e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('a', '1', 'T', '{}')`)
				standby := startStandby(t, e)
				return withFlag(run(e), "--pg-url", standby)
			},
			want: []string{"hot standby", "pg_is_in_recovery", "point --pg-url at the primary"},
		},
		{
			// Case 6: pgbouncer in transaction pooling mode.
			name: "pgbouncer as --pg-url",
			prepare: func(t *testing.T, e *env) []string {
				e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('a', '1', 'T', '{}')`)
				pooled := startPgbouncer(t, e.url)
				return withFlag(run(e), "--pg-url", pooled)
			},
			want: []string{"connection pooler", "unsupported startup parameter", "bypassing the pooler"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var e *env
			if c.own != nil {
				e, _ = newClusterEnv(t, c.own)
			} else {
				e = newEnv(t)
			}
			args := c.prepare(t, e)
			// Half the startup timeout: a start that retries is cut off
			// long before it would give up by itself.
			out, code, elapsed, exited := runBounded(t, startup/2, nil, args...)
			final := finalLines(out)
			t.Logf("exit %d after %s: %s", code, elapsed.Round(time.Millisecond), final)
			if !exited {
				t.Errorf("walrelay did not refuse at once: still running after %s of --startup-timeout %s (stopped with SIGTERM)", startup/2, startup)
			}
			if code != 2 {
				t.Errorf("exit code %d, want 2", code)
			}
			if strings.Contains(out, "relay restarting") {
				t.Errorf("walrelay retried before refusing:\n%s", out)
			}
			if strings.Count(final, "\n") > 0 {
				t.Errorf("the error spans several lines, want one:\n%s", final)
			}
			for _, w := range c.want {
				if !strings.Contains(final, w) {
					t.Errorf("the error lacks %q: %q", w, final)
				}
			}
			if e.publicationExists() {
				t.Errorf("publication %s was created before the refusal", e.name)
			}
			var record *string
			if err := e.conn().QueryRow(e.ctx, "SELECT to_regclass($1)::text", pgx.Identifier{source.DefaultRecordSchema, source.RecordTableName}.Sanitize()).Scan(&record); err != nil || record != nil {
				t.Errorf("walrelay's record table %v was created before the refusal (%v)", record, err)
			}
			if _, err := e.slotInfoErr(); err == nil {
				t.Errorf("slot %s was created before the refusal", e.name)
			}
			if td := e.brokerTopics(); td.Has(e.topic("a")) || td.Has(e.topic("order")) {
				t.Errorf("rows were published before the refusal: topics %v", td.Names())
			}
		})
	}
}

// e2eSlotHint is what the free-slot refusal says to do with slots nothing
// reads.
const e2eSlotHint = "walrelay drop --slot"

// startStandby makes a hot standby of e's own cluster with pg_basebackup
// (-R writes standby.signal and primary_conninfo), starts it on a port of
// its own until the test ends, and returns the URL of e's database on it.
// It stays in this file until internal/devcluster has a standby helper.
func startStandby(t *testing.T, e *env) string {
	t.Helper()
	bin, err := devcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	// initdb may be a link into the server's own directory (a PATH entry
	// such as /usr/local/bin), which holds pg_basebackup too.
	if initdb, err := filepath.EvalSymlinks(filepath.Join(bin, "initdb")); err == nil {
		bin = filepath.Dir(initdb)
	}
	if _, err := os.Stat(filepath.Join(bin, "pg_basebackup")); err != nil {
		t.Skipf("no pg_basebackup next to initdb in %s: install Debian's postgresql package (make deps)", bin)
	}
	primary, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "walrelay-standby-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	data := filepath.Join(dir, "data")
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	asPostgres(t, dir)
	pgRun(t, bin, "pg_basebackup", "-D", data, "-R", "-X", "stream", "-c", "fast",
		"-h", primary.Hostname(), "-p", primary.Port(), "-U", "postgres")
	// The copy listens on its own port and socket directory.
	conf := fmt.Sprintf("\nport = %d\nunix_socket_directories = '%s'\nhot_standby = on\n", port, dir)
	f, err := os.OpenFile(filepath.Join(data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(conf); err != nil {
		t.Fatal(err)
	}
	f.Close()
	pgRun(t, bin, "pg_ctl", "start", "-w", "-t", "60", "-D", data, "-l", filepath.Join(dir, "standby.log"))
	t.Cleanup(func() { _ = pgRunErr(bin, "pg_ctl", "stop", "-w", "-m", "immediate", "-D", data) })
	su := *primary
	su.Host = net.JoinHostPort(primary.Hostname(), strconv.Itoa(port))
	standby := su.String()
	c, err := pgx.Connect(e.ctx, standby)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	var inRecovery bool
	if err := c.QueryRow(e.ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil || !inRecovery {
		t.Fatalf("the copy is not a standby: pg_is_in_recovery() = %v, %v", inRecovery, err)
	}
	return standby
}

// asPostgres gives dir to the postgres user when the test runs as root:
// PostgreSQL and pgbouncer run as that user then (they refuse root).
func asPostgres(t *testing.T, dir string) {
	t.Helper()
	if os.Geteuid() != 0 {
		return
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		t.Skip("running as root needs a postgres user to run servers as")
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		t.Fatal(err)
	}
}

// serverCommand runs name from bin (or a full path when bin is empty), as
// the postgres user when the test runs as root.
func serverCommand(bin, name string, args ...string) *exec.Cmd {
	path := name
	if bin != "" {
		path = filepath.Join(bin, name)
	}
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	}
	return exec.Command(path, args...)
}

func pgRun(t *testing.T, bin, name string, args ...string) {
	t.Helper()
	if out, err := serverCommand(bin, name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

func pgRunErr(bin, name string, args ...string) error {
	return serverCommand(bin, name, args...).Run()
}

// startPgbouncer starts pgbouncer (transaction pooling, trusting the
// postgres user) in front of the server of target until the test ends,
// and returns target's URL through it. It skips the test when pgbouncer
// is not installed (make deps-pgbouncer installs it).
func startPgbouncer(t *testing.T, target string) string {
	t.Helper()
	path, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr != nil {
			t.Skip("pgbouncer is not installed: run `make deps-pgbouncer` (apt-get install pgbouncer)")
		}
		path = "/usr/sbin/pgbouncer"
	}
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "walrelay-pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
pidfile = %s
`, u.Hostname(), u.Port(), port, filepath.Join(dir, "users.txt"), filepath.Join(dir, "pgbouncer.pid"))
	for name, content := range map[string]string{"pgbouncer.ini": ini, "users.txt": `"postgres" ""` + "\n"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	asPostgres(t, dir)
	cmd := serverCommand("", path, filepath.Join(dir, "pgbouncer.ini"))
	w := &testWriter{t: t, prefix: "pgbouncer: "}
	cmd.Stdout, cmd.Stderr = w, w
	// A group of its own: runuser waits for pgbouncer as its child, and
	// both are ended together.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.done.Store(true)
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
	u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	pooled := u.String()
	if err := devcluster.WaitFor(30*time.Second, 50*time.Millisecond, func() (bool, error) {
		c, err := pgx.Connect(context.Background(), pooled)
		if err != nil {
			return false, err
		}
		c.Close(context.Background())
		return true, nil
	}); err != nil {
		t.Fatalf("pgbouncer did not accept connections: %v", err)
	}
	return pooled
}
