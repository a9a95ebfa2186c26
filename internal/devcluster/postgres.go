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
}

// Postgres is a running throwaway cluster. Its superuser is "postgres" with
// trust authentication on 127.0.0.1.
type Postgres struct {
	Dir  string // parent of the data directory, the socket and the log
	Port int
	bin  string
	opts PostgresOptions
}

// BinDir finds the directory holding initdb and pg_ctl: PATH first, then
// Debian's /usr/lib/postgresql/<version>/bin (newest version).
func BinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if _, err := exec.LookPath("pg_ctl"); err == nil {
			return filepath.Dir(p), nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or in /usr/lib/postgresql/*/bin: install the postgresql package")
}

func versionOf(dir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return v
}

// StartPostgres initialises and starts a cluster in a new temporary
// directory.
func StartPostgres(ctx context.Context, opts PostgresOptions) (*Postgres, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "walrelay-pg-")
	if err != nil {
		return nil, err
	}
	p := &Postgres{Dir: dir, Port: opts.Port, bin: bin, opts: opts}
	if p.Port == 0 {
		if p.Port, err = FreePort(); err != nil {
			return nil, err
		}
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

func (p *Postgres) dataDir() string { return filepath.Join(p.Dir, "data") }

// LogFile is the server's log.
func (p *Postgres) LogFile() string { return filepath.Join(p.Dir, "postgres.log") }

func (p *Postgres) init(ctx context.Context) error {
	if err := os.Chmod(p.Dir, 0o755); err != nil {
		return err
	}
	if os.Geteuid() == 0 {
		// The server refuses to run as root; the directory must belong to
		// the account it runs as.
		u, err := user.Lookup("postgres")
		if err != nil {
			return fmt.Errorf("running as root needs a postgres user to start PostgreSQL as: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(p.Dir, uid, gid); err != nil {
			return err
		}
	}
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
	keys := make([]string, 0, len(conf))
	for k := range conf {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b bytes.Buffer
	b.WriteString("\n# walrelay devcluster\n")
	for _, k := range keys {
		fmt.Fprintf(&b, "%s = %s\n", k, conf[k])
	}
	f, err := os.OpenFile(filepath.Join(p.dataDir(), "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = f.Write(b.Bytes())
	return err
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
	return nil
}

// Stop stops the server (fast mode: disconnects clients).
func (p *Postgres) Stop() error {
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
