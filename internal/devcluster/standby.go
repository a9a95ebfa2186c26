package devcluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// StandbyOptions configures StartStandby.
type StandbyOptions struct {
	// Port to listen on; 0 picks a free one. The port of a primary that
	// was killed makes the new standby answer where it did, so that one
	// multi-host URL (MultiHostURL) stays valid across failovers.
	Port int
	// Slot is the physical replication slot made on the primary for the
	// standby (and its application_name there); default "standby_<port>".
	Slot string
	// SyncSlots (PostgreSQL 17 and later) sets sync_replication_slots = on
	// on the standby: it keeps copies of the primary's failover logical
	// slots, which survive its promotion. Default off.
	SyncSlots bool
	// SynchronizedStandbySlots (PostgreSQL 17 and later) sets the primary's
	// synchronized_standby_slots to Slot once the standby streams: the
	// primary's logical walsenders then send nothing this standby has not
	// received, so no consumer of a failover slot gets ahead of it. It
	// replaces what the setting named before. Default off.
	SynchronizedStandbySlots bool
	// Settings are extra postgresql.conf lines for the standby, applied
	// last.
	Settings map[string]string
	// KeepDir leaves the data directory behind on Close.
	KeepDir bool
}

// StartStandby starts a streaming physical standby of p, a running primary,
// and returns once the standby streams (p's pg_stat_replication says so,
// and so does the standby's pg_stat_wal_receiver).
//
// It makes the standby the way an operator does without pg_basebackup: a
// physical slot on p first (so p keeps the WAL from here on), then an
// online base backup with the low-level API in one session
// (pg_backup_start/pg_backup_stop, pg_start_backup/pg_stop_backup on 14)
// around a copy of p's data directory, then standby.signal, primary_conninfo
// (with dbname, which 17's slot synchronization needs), primary_slot_name
// and hot_standby_feedback = on.
func (p *Postgres) StartStandby(ctx context.Context, opts StandbyOptions) (*Postgres, error) {
	version, err := p.ServerVersionNum(ctx)
	if err != nil {
		return nil, fmt.Errorf("standby: read the primary's version: %w", err)
	}
	if (opts.SyncSlots || opts.SynchronizedStandbySlots) && version < 170000 {
		return nil, fmt.Errorf("standby: failover slots (sync_replication_slots, synchronized_standby_slots) need PostgreSQL 17 or later; the primary runs %d", version)
	}
	s, err := newPostgres(PostgresOptions{Port: opts.Port, Settings: opts.Settings, KeepDir: opts.KeepDir, BinDir: p.bin})
	if err != nil {
		return nil, err
	}
	s.Upstream = p
	s.Slot = opts.Slot
	if s.Slot == "" {
		s.Slot = "standby_" + strconv.Itoa(s.Port)
	}
	conn, err := pgx.Connect(ctx, p.URL("postgres"))
	if err != nil {
		s.cleanup()
		return nil, err
	}
	defer conn.Close(context.Background())
	// Reserved at once: p keeps every WAL segment from before the backup's
	// checkpoint until the standby has streamed it.
	if _, err := conn.Exec(ctx, "SELECT pg_create_physical_replication_slot($1, true)", s.Slot); err != nil {
		s.cleanup()
		return nil, fmt.Errorf("standby: create physical slot %q on the primary: %w", s.Slot, err)
	}
	fail := func(err error) (*Postgres, error) {
		s.cleanup()
		// The session's backup (if any) ends with it; the slot would keep
		// WAL for good.
		conn.Close(context.Background())
		if c, cerr := pgx.Connect(context.Background(), p.URL("postgres")); cerr == nil {
			_, _ = c.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", s.Slot)
			c.Close(context.Background())
		}
		return nil, err
	}
	// A standby of a standby (cascading) is copied from the primary at the
	// top of the chain and streams from p: a backup taken on a standby
	// refuses WAL written with full_page_writes = off, which devcluster's
	// servers write; the standby then streams from p what follows the
	// backup's start, which p has or will have replayed.
	src, bconn := p, conn
	if p.Upstream != nil {
		for src.Upstream != nil {
			src = src.Upstream
		}
		if bconn, err = pgx.Connect(ctx, src.URL("postgres")); err != nil {
			return fail(fmt.Errorf("standby: connect to the top of the chain: %w", err))
		}
		defer bconn.Close(context.Background())
	}
	if err := s.baseBackup(ctx, bconn, src, version); err != nil {
		return fail(fmt.Errorf("standby: base backup of %s: %w", src.dataDir(), err))
	}
	if err := s.configureStandby(p, version, opts); err != nil {
		return fail(err)
	}
	if os.Geteuid() == 0 {
		uid, gid, err := serverAccount()
		if err == nil {
			err = chownTree(s.Dir, uid, gid)
		}
		if err != nil {
			return fail(err)
		}
	}
	if err := s.Start(ctx); err != nil {
		return fail(fmt.Errorf("standby: %w", err))
	}
	if err := s.WaitStreaming(ctx); err != nil {
		_ = s.Stop()
		return fail(err)
	}
	if opts.SynchronizedStandbySlots {
		if err := p.SetSynchronizedStandbySlots(ctx, s.Slot); err != nil {
			_ = s.Stop()
			return fail(err)
		}
	}
	return s, nil
}

// configureStandby appends to s's postgresql.conf what makes it a standby
// of p (a server of version) and writes standby.signal.
func (s *Postgres) configureStandby(p *Postgres, version int, opts StandbyOptions) error {
	conf := map[string]string{
		"port":                    strconv.Itoa(s.Port),
		"unix_socket_directories": "'" + s.Dir + "'",
		"primary_conninfo":        fmt.Sprintf("'host=127.0.0.1 port=%d user=postgres dbname=postgres application_name=%s'", p.Port, s.Slot),
		"primary_slot_name":       "'" + s.Slot + "'",
		"hot_standby":             "on",
		"hot_standby_feedback":    "on",
		// Answers sooner to the primary, which waits for it with
		// synchronized_standby_slots.
		"wal_receiver_status_interval": "'1s'",
	}
	if version >= 170000 {
		// The primary's own setting names its standbys' slots, which do
		// not exist here: once promoted, this node would wait for them.
		conf["synchronized_standby_slots"] = "''"
		conf["sync_replication_slots"] = "off"
		if opts.SyncSlots {
			conf["sync_replication_slots"] = "on"
		}
	}
	for k, v := range opts.Settings {
		conf[k] = v
	}
	if err := s.appendConf("walrelay devcluster standby of port "+strconv.Itoa(p.Port), conf); err != nil {
		return err
	}
	signal := filepath.Join(s.dataDir(), "standby.signal")
	if err := os.WriteFile(signal, nil, 0o600); err != nil {
		return err
	}
	if os.Geteuid() == 0 {
		uid, gid, err := serverAccount()
		if err != nil {
			return err
		}
		return os.Chown(signal, uid, gid)
	}
	return nil
}

// Rejoin makes p, a primary stopped with Stop (a fast shutdown, as in a
// switchover, after which every standby has all of p's WAL), a standby of
// upstream, promoted from one of p's standbys, with p's own data directory:
// no new base backup and no pg_rewind, as an operator rejoins an old
// primary after a switchover. It makes p's physical slot on upstream,
// writes standby.signal and primary_conninfo, starts p and returns once it
// streams (with SynchronizedStandbySlots, once upstream's
// synchronized_standby_slots names it). p's replication slots stay as they
// were: a logical slot of p's is a slot of its own there (synced = false),
// which slot synchronization refuses to update; remove it first
// (RemoveSlot) to have a synchronized copy instead.
func (p *Postgres) Rejoin(ctx context.Context, upstream *Postgres, opts StandbyOptions) error {
	version, err := upstream.ServerVersionNum(ctx)
	if err != nil {
		return fmt.Errorf("rejoin: read the upstream's version: %w", err)
	}
	if (opts.SyncSlots || opts.SynchronizedStandbySlots) && version < 170000 {
		return fmt.Errorf("rejoin: failover slots (sync_replication_slots, synchronized_standby_slots) need PostgreSQL 17 or later; the upstream runs %d", version)
	}
	slot := opts.Slot
	if slot == "" {
		slot = "standby_" + strconv.Itoa(p.Port)
	}
	if err := upstream.withConn(ctx, func(c *pgx.Conn) error {
		// The upstream, a standby of p until its promotion, may have p's
		// slot from an earlier round: p takes it up again.
		_, err := c.Exec(ctx, "SELECT pg_create_physical_replication_slot($1, true) WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)", slot)
		return err
	}); err != nil {
		return fmt.Errorf("rejoin: create physical slot %q on the upstream: %w", slot, err)
	}
	p.Slot = slot
	if err := p.configureStandby(upstream, version, opts); err != nil {
		return fmt.Errorf("rejoin: %w", err)
	}
	if err := p.Start(ctx); err != nil {
		return fmt.Errorf("rejoin: %w", err)
	}
	p.Upstream = upstream
	if err := p.WaitStreaming(ctx); err != nil {
		return fmt.Errorf("rejoin: %w", err)
	}
	if opts.SynchronizedStandbySlots {
		return upstream.SetSynchronizedStandbySlots(ctx, slot)
	}
	return nil
}

// RemoveSlot removes the replication slot name from p, a stopped server,
// as an operator does before an old primary rejoins as a standby: its
// directory under pg_replslot. A standby cannot drop a slot slot
// synchronization made (synced = true, kept from an earlier promotion),
// and one of its own would be a stale copy until dropped.
func (p *Postgres) RemoveSlot(name string) error {
	if _, err := os.Stat(filepath.Join(p.dataDir(), "postmaster.pid")); err == nil {
		return fmt.Errorf("remove slot %q: the server on port %d runs; stop it first", name, p.Port)
	}
	return os.RemoveAll(filepath.Join(p.dataDir(), "pg_replslot", name))
}

// baseBackup copies src's data directory into s's between the start and
// the stop of a non-exclusive backup on conn, and writes the backup_label
// (and tablespace_map) the stop returns: recovery starts from the backup's
// checkpoint and replays the WAL the standby streams until the copy is
// consistent.
func (s *Postgres) baseBackup(ctx context.Context, conn *pgx.Conn, src *Postgres, version int) error {
	start, stop := "SELECT pg_backup_start($1, true)", "SELECT labelfile, spcmapfile FROM pg_backup_stop(false)"
	if version < 150000 {
		start, stop = "SELECT pg_start_backup($1, true, false)", "SELECT labelfile, spcmapfile FROM pg_stop_backup(false, false)"
	}
	if _, err := conn.Exec(ctx, start, "walrelay standby "+s.Slot); err != nil {
		return err
	}
	if err := copyDataDir(src.dataDir(), s.dataDir()); err != nil {
		return err
	}
	var label, spcmap string
	if err := conn.QueryRow(ctx, stop).Scan(&label, &spcmap); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(s.dataDir(), "backup_label"), []byte(label), 0o600); err != nil {
		return err
	}
	if spcmap != "" {
		return os.WriteFile(filepath.Join(s.dataDir(), "tablespace_map"), []byte(spcmap), 0o600)
	}
	return nil
}

// Directories whose contents a base backup leaves out (the server makes
// them anew, or the standby streams them: pg_wal), as pg_basebackup does.
var skipContents = map[string]bool{
	"pg_wal": true, "pg_replslot": true, "pg_dynshmem": true, "pg_notify": true,
	"pg_serial": true, "pg_snapshots": true, "pg_stat_tmp": true, "pg_subtrans": true,
}

// Files a base backup leaves out: the running server's, and what would
// make the copy something other than a standby of this backup.
var skipFiles = map[string]bool{
	"postmaster.pid": true, "postmaster.opts": true, "pg_internal.init": true,
	"backup_label": true, "tablespace_map": true, "standby.signal": true, "recovery.signal": true,
	"postgresql.auto.conf.tmp": true, "current_logfiles.tmp": true,
}

// copyDataDir copies a running server's data directory. Files change and
// vanish under it: the WAL replayed from the backup's start repairs what a
// torn copy holds (the server writes full pages while a backup runs), and
// a file gone is one the WAL drops too.
func copyDataDir(src, dst string) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		info, err := d.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		} else if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			if err := os.Mkdir(target, info.Mode().Perm()); err != nil {
				return err
			}
			if skipContents[filepath.ToSlash(rel)] {
				if rel == "pg_wal" {
					// Its subdirectories only (archive_status, 17's
					// summaries), which the server expects to find.
					subs, _ := os.ReadDir(path)
					for _, sub := range subs {
						if sub.IsDir() {
							if err := os.Mkdir(filepath.Join(target, sub.Name()), 0o700); err != nil {
								return err
							}
						}
					}
				}
				return fs.SkipDir
			}
			return nil
		case skipFiles[d.Name()] || strings.HasPrefix(d.Name(), "pgsql_tmp"):
			return nil
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(path)
			if err != nil {
				return err
			}
			return os.Symlink(link, target)
		default:
			return copyFile(path, target, info.Mode().Perm())
		}
	})
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func chownTree(dir string, uid, gid int) error {
	return filepath.WalkDir(dir, func(path string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(path, uid, gid)
	})
}

// WaitStreaming waits until the standby s streams from its upstream: the
// upstream's pg_stat_replication shows s's application_name streaming, and
// s's pg_stat_wal_receiver says streaming.
func (s *Postgres) WaitStreaming(ctx context.Context) error {
	if s.Upstream == nil {
		return errors.New("not a standby: no upstream to stream from")
	}
	err := WaitFor(60*time.Second, 50*time.Millisecond, func() (bool, error) {
		if ctx.Err() != nil {
			return true, nil
		}
		var sender, receiver string
		if err := s.Upstream.withConn(ctx, func(c *pgx.Conn) error {
			return c.QueryRow(ctx, "SELECT coalesce(max(state), 'absent') FROM pg_stat_replication WHERE application_name = $1", s.Slot).Scan(&sender)
		}); err != nil {
			return false, err
		}
		if err := s.withConn(ctx, func(c *pgx.Conn) error {
			return c.QueryRow(ctx, "SELECT coalesce(max(status), 'absent') FROM pg_stat_wal_receiver").Scan(&receiver)
		}); err != nil {
			return false, err
		}
		return sender == "streaming" && receiver == "streaming", fmt.Errorf("walsender on port %d: %s, wal receiver on port %d: %s", s.Upstream.Port, sender, s.Port, receiver)
	})
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("standby on port %d not streaming: %w\n%s", s.Port, err, s.tailLog())
	}
	return nil
}

// WaitReplayed waits until the standby s has replayed everything its
// upstream had written when it was called.
func (s *Postgres) WaitReplayed(ctx context.Context) error {
	if s.Upstream == nil {
		return errors.New("not a standby: no upstream to replay")
	}
	// An upstream that is a standby itself (cascading) has written
	// nothing: what it replayed is what s is to replay.
	var target string
	if err := s.Upstream.queryRow(ctx, "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END::text", &target); err != nil {
		return err
	}
	return WaitFor(60*time.Second, 20*time.Millisecond, func() (bool, error) {
		var done bool
		err := s.withConn(ctx, func(c *pgx.Conn) error {
			return c.QueryRow(ctx, "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", target).Scan(&done)
		})
		return done, err
	})
}

// SetSynchronizedStandbySlots sets synchronized_standby_slots (PostgreSQL
// 17 and later) on p to the physical slots named (none: the empty list)
// and waits until new sessions see it.
func (p *Postgres) SetSynchronizedStandbySlots(ctx context.Context, slots ...string) error {
	want := strings.Join(slots, ",")
	if err := p.appendConf("walrelay devcluster: synchronized_standby_slots", map[string]string{"synchronized_standby_slots": "'" + want + "'"}); err != nil {
		return err
	}
	var ok bool
	if err := p.queryRow(ctx, "SELECT pg_reload_conf()", &ok); err != nil {
		return err
	}
	// The postmaster rereads the file when it gets the signal; sessions
	// started after that see the new value.
	return WaitFor(30*time.Second, 20*time.Millisecond, func() (bool, error) {
		var got string
		err := p.queryRow(ctx, "SHOW synchronized_standby_slots", &got)
		return got == want, err
	})
}

// Kill ends the server as a machine failure would: SIGKILL to the
// postmaster and every process it started, at once, so that no backend
// outlives it to answer or send WAL. It returns once they are gone; the
// port is free then, and Start may start it again (a crash recovery).
// Close afterwards removes the directory.
func (p *Postgres) Kill() error {
	pid, err := p.postmasterPID()
	if err != nil {
		return err
	}
	// Stopped first, so it forks nothing between the listing of its
	// children and their end.
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return fmt.Errorf("kill postmaster %d: %w", pid, err)
	}
	procs := append(childrenOf(pid), pid)
	for _, c := range procs {
		_ = syscall.Kill(c, syscall.SIGKILL)
	}
	p.killed = true
	if err := WaitFor(30*time.Second, 10*time.Millisecond, func() (bool, error) {
		for _, c := range procs {
			if alive(c) {
				return false, fmt.Errorf("process %d still running", c)
			}
		}
		return true, nil
	}); err != nil {
		return err
	}
	// The dead postmaster stays a zombie until whatever adopted it reaps
	// it, and a new postmaster takes a zombie's PID in its lock files for a
	// running server: Start after Kill would refuse ("lock file already
	// exists"). Nothing of it runs, so the locks are stale; recovery is
	// still a crash recovery (pg_control says the server was running).
	for _, lock := range []string{filepath.Join(p.dataDir(), "postmaster.pid"), filepath.Join(p.Dir, ".s.PGSQL."+strconv.Itoa(p.Port)+".lock")} {
		if err := os.Remove(lock); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("kill: remove the stale lock file: %w", err)
		}
	}
	return nil
}

// postmasterPID reads the first line of postmaster.pid.
func (p *Postgres) postmasterPID() (int, error) {
	b, err := os.ReadFile(filepath.Join(p.dataDir(), "postmaster.pid"))
	if err != nil {
		return 0, fmt.Errorf("no running server on port %d: %w", p.Port, err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		return 0, fmt.Errorf("postmaster.pid: %q is no process id", line)
	}
	return pid, nil
}

// childrenOf lists the processes whose parent is pid, from /proc.
func childrenOf(pid int) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		c, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _, ok := procStat(c); ok && ppid == pid {
			out = append(out, c)
		}
	}
	return out
}

// alive reports whether pid runs: a zombie (waiting for a parent that may
// never reap it) does not.
func alive(pid int) bool {
	_, state, ok := procStat(pid)
	return ok && state != "Z" && state != "X"
}

// procStat reads the parent and state fields of /proc/<pid>/stat.
func procStat(pid int) (ppid int, state string, ok bool) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, "", false
	}
	// pid (comm) state ppid ...; comm may hold spaces and parentheses.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, "", false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, "", false
	}
	ppid, err = strconv.Atoi(f[1])
	return ppid, f[0], err == nil
}

// Promote promotes the standby p (pg_ctl promote) and waits until it
// accepts writes. It is a primary then: Upstream and Slot are cleared.
func (p *Postgres) Promote(ctx context.Context) error {
	if out, err := p.run(ctx, "pg_ctl", "promote", "-w", "-t", "60", "-D", p.dataDir()); err != nil {
		return fmt.Errorf("pg_ctl promote: %w\n%s\n%s", err, out, p.tailLog())
	}
	err := WaitFor(60*time.Second, 20*time.Millisecond, func() (bool, error) {
		// Assigning a transaction id fails during recovery.
		var xid string
		err := p.queryRow(ctx, "SELECT pg_current_xact_id()::text", &xid)
		return err == nil, err
	})
	if err != nil {
		return fmt.Errorf("promoted server on port %d does not accept writes: %w\n%s", p.Port, err, p.tailLog())
	}
	p.Upstream, p.Slot = nil, ""
	return nil
}

// MultiHostURL is a connection URL for database db as the superuser that
// names a server on each port of 127.0.0.1, with
// target_session_attrs=read-write: a client tries them in turn and keeps
// the one that accepts writes, so the URL follows the primary from port to
// port across failovers.
func MultiHostURL(db string, ports ...int) string {
	hosts := make([]string, len(ports))
	for i, p := range ports {
		hosts[i] = "127.0.0.1:" + strconv.Itoa(p)
	}
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write", strings.Join(hosts, ","), db)
}

// withConn runs fn on a new connection to p's postgres database.
func (p *Postgres) withConn(ctx context.Context, fn func(*pgx.Conn) error) error {
	conn, err := pgx.Connect(ctx, p.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return fn(conn)
}
