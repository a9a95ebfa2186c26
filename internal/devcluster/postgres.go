// Package devcluster starts throwaway infrastructure for `walrelay dev`, the
// integration tests and the benchmark: a PostgreSQL cluster from the local
// server binaries (initdb into a temporary directory, wal_level=logical,
// run as the postgres user when the caller is root, because PostgreSQL
// refuses to run as root) and an in-process Kafka-protocol broker (kfake).
package devcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresOptions configures StartPostgres.
type PostgresOptions struct {
	// Settings are extra postgresql.conf lines, name → value (quoted as
	// needed by the caller), applied after walrelay's defaults.
	Settings map[string]string
	// Port to listen on; 0 picks a free one.
	Port int
	// KeepDir leaves the data directory behind on Stop, for debugging.
	KeepDir bool
	// BinDir is the directory holding initdb, pg_ctl and postgres; empty
	// (the default) means the one BinDir finds. InstalledBinDir names a
	// version of the matrix.
	BinDir string
}

// Postgres is a running throwaway cluster. Its superuser is "postgres" with
// trust authentication on 127.0.0.1.
type Postgres struct {
	Dir  string // parent of the data directory, the socket and the log
	Port int
	bin  string
	opts PostgresOptions
	// Slot is, on a standby, its physical replication slot on Upstream.
	Slot string
	// Upstream is, on a standby, the server it streams from.
	Upstream *Postgres
	killed   bool // Kill ran: nothing to stop
}

// DefaultRoot is where Debian and Ubuntu's postgresql package puts the
// server binaries, one <version>/bin per major version, off PATH.
const DefaultRoot = "/usr/lib/postgresql"

// RootEnv names the environment variable that replaces DefaultRoot (a list
// like PATH), for servers installed elsewhere in the same layout and for
// trying `walrelay dev` as if none were installed.
const RootEnv = "WALRELAY_PG_ROOT"

// BinDir finds the directory holding initdb and pg_ctl: the first PATH entry
// holding both, else the newest <root>/<version>/bin holding both. Its error
// is one line naming the command that installs them.
func BinDir() (string, error) {
	roots := []string{DefaultRoot}
	if r := os.Getenv(RootEnv); r != "" {
		roots = filepath.SplitList(r)
	}
	return findBinDir(os.Getenv("PATH"), roots)
}

// findBinDir is BinDir with PATH and the roots passed in, so tests can lay
// out a machine of their own. Both binaries must be in one directory:
// StartPostgres runs them from there.
func findBinDir(pathList string, roots []string) (string, error) {
	for _, d := range filepath.SplitList(pathList) {
		if d != "" && hasServer(d) {
			return d, nil
		}
	}
	var dirs []string
	for _, r := range roots {
		ds, _ := filepath.Glob(filepath.Join(r, "*", "bin"))
		for _, d := range ds {
			if _, ok := majorMinor(d); ok {
				dirs = append(dirs, d)
			}
		}
	}
	sort.Slice(dirs, func(i, j int) bool {
		a, _ := majorMinor(dirs[i])
		b, _ := majorMinor(dirs[j])
		return a[0] > b[0] || a[0] == b[0] && a[1] > b[1]
	})
	for _, d := range dirs {
		if hasServer(d) {
			return d, nil
		}
	}
	where := make([]string, len(roots))
	for i, r := range roots {
		where[i] = filepath.Join(r, "<version>", "bin")
	}
	return "", fmt.Errorf("PostgreSQL server not found (initdb and pg_ctl neither on PATH nor in %s): run `%s` (Debian, Ubuntu), or put the directory holding initdb and pg_ctl on PATH",
		strings.Join(where, " or "), installCommand())
}

// installCommand is the command that installs the server on Debian and
// Ubuntu, for this user: root runs apt-get itself (minimal images have no
// sudo), anyone else through sudo. The update comes first because fresh
// images ship without package lists.
func installCommand() string {
	if os.Geteuid() == 0 {
		return "apt-get update && apt-get install -y postgresql"
	}
	return "sudo apt-get update && sudo apt-get install -y postgresql"
}

// hasServer reports whether dir holds executable initdb and pg_ctl.
func hasServer(dir string) bool {
	return isExecutable(filepath.Join(dir, "initdb")) && isExecutable(filepath.Join(dir, "pg_ctl"))
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// majorMinor parses the version directory of <root>/<version>/bin: "16"
// and "9.6" (releases before 10 had two-part major versions).
func majorMinor(binDir string) ([2]int, bool) {
	var v [2]int
	parts := strings.Split(filepath.Base(filepath.Dir(binDir)), ".")
	if len(parts) > 2 {
		return v, false
	}
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 {
			return v, false
		}
		v[i] = n
	}
	return v, true
}

// StartPostgres initialises and starts a cluster in a new temporary
// directory.
func StartPostgres(ctx context.Context, opts PostgresOptions) (*Postgres, error) {
	p, err := newPostgres(opts)
	if err != nil {
		return nil, err
	}
	if err := p.init(ctx); err != nil {
		p.cleanup()
		return nil, err
	}
	if err := p.Start(ctx); err != nil {
		p.cleanup()
		return nil, err
	}
	return p, nil
}

// newPostgres makes the directory of a new cluster, owned by the account
// the server runs as, and picks its binaries and port.
func newPostgres(opts PostgresOptions) (*Postgres, error) {
	bin := opts.BinDir
	if bin == "" {
		var err error
		if bin, err = BinDir(); err != nil {
			return nil, err
		}
	}
	dir, err := os.MkdirTemp("", "walrelay-pg-")
	if err != nil {
		return nil, err
	}
	p := &Postgres{Dir: dir, Port: opts.Port, bin: bin, opts: opts}
	if p.Port == 0 {
		if p.Port, err = FreePort(); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	if err := os.Chmod(p.Dir, 0o755); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if os.Geteuid() == 0 {
		// The server refuses to run as root; the directory must belong to
		// the account it runs as.
		uid, gid, err := serverAccount()
		if err == nil {
			err = os.Chown(p.Dir, uid, gid)
		}
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	return p, nil
}

// serverAccount is the postgres user's uid and gid, whom the server runs as
// when the caller is root.
func serverAccount() (uid, gid int, err error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return 0, 0, fmt.Errorf("running as root needs a postgres user to start PostgreSQL as: %w", err)
	}
	uid, _ = strconv.Atoi(u.Uid)
	gid, _ = strconv.Atoi(u.Gid)
	return uid, gid, nil
}

// BinDir is the directory of the binaries this cluster runs.
func (p *Postgres) BinDir() string { return p.bin }

func (p *Postgres) dataDir() string { return filepath.Join(p.Dir, "data") }

// LogFile is the server's log.
func (p *Postgres) LogFile() string { return filepath.Join(p.Dir, "postgres.log") }

func (p *Postgres) init(ctx context.Context) error {
	if out, err := p.run(ctx, "initdb", "-D", p.dataDir(), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync", "--locale=C"); err != nil {
		return fmt.Errorf("initdb: %w\n%s", err, out)
	}
	conf := map[string]string{
		"listen_addresses":        "'127.0.0.1'",
		"port":                    strconv.Itoa(p.Port),
		"unix_socket_directories": "'" + p.Dir + "'",
		"wal_level":               "logical",
		"max_wal_senders":         "20",
		"max_replication_slots":   "20",
		"max_connections":         "200",
		"fsync":                   "off", // a throwaway cluster survives process crashes, not OS crashes
		"full_page_writes":        "off",
		"shared_buffers":          "128MB",
		"max_wal_size":            "1GB",
		"log_min_messages":        "warning",
		"log_line_prefix":         "'%m [%p] %a '",
	}
	for k, v := range p.opts.Settings {
		conf[k] = v
	}
	return p.appendConf("walrelay devcluster", conf)
}

// appendConf appends settings to postgresql.conf under a comment: a later
// line wins over an earlier one, so this overrides what the file set.
func (p *Postgres) appendConf(comment string, conf map[string]string) error {
	keys := make([]string, 0, len(conf))
	for k := range conf {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b bytes.Buffer
	fmt.Fprintf(&b, "\n# %s\n", comment)
	for _, k := range keys {
		fmt.Fprintf(&b, "%s = %s\n", k, conf[k])
	}
	f, err := os.OpenFile(filepath.Join(p.dataDir(), "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.Write(b.Bytes()); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// run runs a PostgreSQL binary, as the postgres user when we are root.
func (p *Postgres) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	path := filepath.Join(p.bin, name)
	var cmd *exec.Cmd
	if os.Geteuid() == 0 {
		cmd = exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	} else {
		cmd = exec.CommandContext(ctx, path, args...)
	}
	cmd.Dir = p.Dir
	return cmd.CombinedOutput()
}

// Start starts the server and waits until it accepts connections.
func (p *Postgres) Start(ctx context.Context) error {
	out, err := p.run(ctx, "pg_ctl", "start", "-w", "-t", "60", "-D", p.dataDir(), "-l", p.LogFile())
	if err != nil {
		return fmt.Errorf("pg_ctl start: %w\n%s\n%s", err, out, p.tailLog())
	}
	p.killed = false
	return nil
}

// Stop stops the server (fast mode: disconnects clients). After Kill there
// is nothing to stop.
func (p *Postgres) Stop() error {
	if p.killed {
		return nil
	}
	out, err := p.run(context.Background(), "pg_ctl", "stop", "-w", "-m", "fast", "-D", p.dataDir())
	if err != nil {
		return fmt.Errorf("pg_ctl stop: %w\n%s", err, out)
	}
	return nil
}

// Restart is pg_ctl restart -m fast: every connection is cut.
func (p *Postgres) Restart(ctx context.Context) error {
	out, err := p.run(ctx, "pg_ctl", "restart", "-w", "-t", "60", "-m", "fast", "-D", p.dataDir(), "-l", p.LogFile())
	if err != nil {
		return fmt.Errorf("pg_ctl restart: %w\n%s\n%s", err, out, p.tailLog())
	}
	return nil
}

// Close stops the server and removes its directory.
func (p *Postgres) Close() error {
	err := p.Stop()
	p.cleanup()
	return err
}

func (p *Postgres) cleanup() {
	if !p.opts.KeepDir {
		os.RemoveAll(p.Dir)
	}
}

func (p *Postgres) tailLog() string {
	b, _ := os.ReadFile(p.LogFile())
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// queryRow runs one query on the postgres database and scans its row.
func (p *Postgres) queryRow(ctx context.Context, sql string, dest ...any) error {
	conn, err := pgx.Connect(ctx, p.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(ctx, sql).Scan(dest...)
}

// URL is a connection URL for database db as the superuser.
func (p *Postgres) URL(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", p.Port, db)
}

// CreateDatabase creates db (if it does not exist) and returns its URL.
func (p *Postgres) CreateDatabase(ctx context.Context, db string) (string, error) {
	return CreateDatabase(ctx, p.URL("postgres"), db)
}

// CreateDatabase creates database db on the server of adminURL, if missing,
// and returns adminURL pointing at it.
func CreateDatabase(ctx context.Context, adminURL, db string) (string, error) {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.Background())
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", db).Scan(&exists); err != nil {
		return "", err
	}
	if !exists {
		if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{db}.Sanitize()); err != nil {
			return "", err
		}
	}
	return withDatabase(adminURL, db), nil
}

// withDatabase points a connection URL (or key=value DSN) at database db.
func withDatabase(conn, db string) string {
	if u, err := url.Parse(conn); err == nil && u.Scheme != "" {
		u.Path = "/" + db
		return u.String()
	}
	return conn + " dbname=" + db
}

// FreePort returns a TCP port that was free a moment ago on 127.0.0.1.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// WaitFor polls cond every interval until it returns true or timeout
// passes; it returns cond's last error when it never held.
func WaitFor(timeout, interval time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		last = err
		if time.Now().After(deadline) {
			if last == nil {
				last = errors.New("condition not met")
			}
			return fmt.Errorf("after %s: %w", timeout, last)
		}
		time.Sleep(interval)
	}
}
