package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// A PostgreSQL cluster's CPU time is its postmaster's process tree: the
// backends, walsenders, walreceiver, startup process and background workers
// are the postmaster's children. A child that exits is reaped by the
// postmaster, and the kernel then adds its CPU time to the postmaster's
// cutime and cstime: the sum of the postmaster's own time, its reaped
// children's and its live children's counts every process, those that
// started or ended between two readings included, without sampling.

// procStat is what the bench reads of /proc/<pid>/stat.
type procStat struct {
	ppid    int
	cpu     time.Duration // utime + stime
	started int64         // starttime, in ticks since boot: tells a reused pid apart
	reaped  time.Duration // cutime + cstime: the children it waited for
}

// parseStat parses the contents of /proc/<pid>/stat.
func parseStat(b []byte) (procStat, error) {
	// The command name may hold spaces and parentheses; fields resume
	// after its last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("no command name in %q", b)
	}
	// f[0] is field 3 (state): field n is f[n-3].
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return procStat{}, fmt.Errorf("%d fields after the command name, want at least 20", len(f))
	}
	var n [6]int64
	for j, field := range []int{4, 14, 15, 16, 17, 22} {
		v, err := strconv.ParseInt(f[field-3], 10, 64)
		if err != nil {
			return procStat{}, fmt.Errorf("field %d: %w", field, err)
		}
		n[j] = v
	}
	tick := func(v int64) time.Duration { return time.Duration(v) * time.Second / clockTicks }
	return procStat{ppid: int(n[0]), cpu: tick(n[1] + n[2]), reaped: tick(n[3] + n[4]), started: n[5]}, nil
}

func readStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	st, err := parseStat(b)
	if err != nil {
		return procStat{}, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return st, nil
}

// isWalsender reports whether a PostgreSQL process's /proc/<pid>/cmdline
// (its process title) is a walsender's: "postgres: walsender <user> …",
// or "postgres: <cluster_name>: walsender …".
func isWalsender(cmdline []byte) bool {
	f := strings.Fields(string(bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '})))
	if len(f) < 2 || f[0] != "postgres:" {
		return false
	}
	return f[1] == "walsender" || len(f) > 2 && strings.HasSuffix(f[1], ":") && f[2] == "walsender"
}

// childCPU is a live child's CPU time at a snapshot.
type childCPU struct {
	cpu       time.Duration
	walsender bool
	started   int64
}

// treeSnapshot is a postmaster's process tree's CPU time at one moment.
type treeSnapshot struct {
	own, reaped time.Duration // the postmaster's own, and its exited children's
	children    map[int]childCPU
}

// readTree reads the CPU time of root and its children from /proc. A child
// that exits between the listing and its reading is missed, and one reaped
// between its reading and root's is counted twice: both need an exit within
// microseconds of the snapshot.
func readTree(root int) (treeSnapshot, error) {
	s := treeSnapshot{children: map[int]childCPU{}}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return s, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == root {
			continue
		}
		st, err := readStat(pid)
		if err != nil || st.ppid != root {
			continue
		}
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		s.children[pid] = childCPU{cpu: st.cpu, walsender: isWalsender(cmd), started: st.started}
	}
	st, err := readStat(root)
	if err != nil {
		return s, fmt.Errorf("the postmaster: %w", err)
	}
	s.own, s.reaped = st.cpu, st.reaped
	return s, nil
}

// treeDelta is the CPU time the tree spent between snapshots a and b, and
// the part of it of the walsenders alive at b. A walsender that exited
// between the two counts in all only (its time is the postmaster's reaped
// time then, with no title to tell it apart).
func treeDelta(a, b treeSnapshot) (all, walsender time.Duration) {
	all = b.own - a.own + b.reaped - a.reaped
	for _, c := range b.children {
		all += c.cpu
	}
	for _, c := range a.children {
		all -= c.cpu
	}
	for pid, c := range b.children {
		if !c.walsender {
			continue
		}
		walsender += c.cpu
		if old, ok := a.children[pid]; ok && old.started == c.started {
			walsender -= old.cpu
		}
	}
	return all, walsender
}

// postmasterPID is the pid of the postmaster of conn's server: its
// backend's parent. The server must run on this machine.
func postmasterPID(ctx context.Context, conn *pgx.Conn) (int, error) {
	var backend int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		return 0, err
	}
	st, err := readStat(backend)
	if err != nil {
		return 0, fmt.Errorf("the server's backend %d is not a process of this machine: %w", backend, err)
	}
	return st.ppid, nil
}
