package integration

// Patroni and walrelay: the two things Patroni does to a logical slot,
// done here as Patroni does them, without Patroni. With the slot named
// under slots: in its dynamic configuration, Patroni keeps a copy on each
// replica: it reads the slot's state file on the primary
// (pg_read_binary_file), writes it into the replica's pg_replslot with the
// replica stopped, starts it, and moves the copy forward with
// pg_replication_slot_advance to where the primary's slot was at its last
// loop. Without slots: (or ignore_slots) it drops every slot it does not
// know once no client streams from it: the slot walrelay setup just
// created, before walrelay run. docs/operating.md, running under Patroni,
// says what was seen with Patroni itself.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/slot"
)

// copySlotAsPatroni copies the primary's logical slot name to the standby
// as Patroni does: the state file read on the primary, written into the
// stopped standby's pg_replslot, the standby started again.
func (rs *replicaSet) copySlotAsPatroni(db, name string) {
	rs.t.Helper()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, rs.primary.URL(db))
	if err != nil {
		rs.t.Fatal(err)
	}
	var state []byte
	err = c.QueryRow(ctx, `SELECT pg_read_binary_file('pg_replslot/' || $1 || '/state')`, name).Scan(&state)
	c.Close(ctx)
	if err != nil {
		rs.t.Fatalf("read the slot's state file on the primary: %v", err)
	}
	if err := rs.standby.Stop(); err != nil {
		rs.t.Fatal(err)
	}
	dir := filepath.Join(rs.standby.Dir, "data", "pg_replslot", name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		rs.t.Fatal(err)
	}
	file := filepath.Join(dir, "state")
	if err := os.WriteFile(file, state, 0o600); err != nil {
		rs.t.Fatal(err)
	}
	if os.Geteuid() == 0 { // the server runs as postgres (devcluster)
		u, err := user.Lookup("postgres")
		if err != nil {
			rs.t.Fatal(err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		for _, p := range []string{dir, file} {
			if err := os.Chown(p, uid, gid); err != nil {
				rs.t.Fatal(err)
			}
		}
	}
	if err := rs.standby.Start(ctx); err != nil {
		rs.t.Fatal(err)
	}
	if err := rs.standby.WaitStreaming(ctx); err != nil {
		rs.t.Fatal(err)
	}
}

// copyAdvancer moves the standby's copy of a slot forward every interval
// to where the primary's slot was at the previous round, no further than
// the standby replayed: Patroni's loop, which publishes the primary's
// confirmed_flush_lsn in its DCS and advances the replicas' copies to it.
type copyAdvancer struct {
	stop     chan struct{}
	wg       sync.WaitGroup
	mu       sync.Mutex
	advanced int
	lastErr  error
}

func (rs *replicaSet) advanceCopy(db, name string, interval time.Duration) *copyAdvancer {
	a := &copyAdvancer{stop: make(chan struct{})}
	primaryURL, standbyURL := rs.primary.URL(db), rs.standby.URL(db)
	a.wg.Go(func() {
		ctx := context.Background()
		var published string // the primary's position at the previous round
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-a.stop:
				return
			case <-t.C:
			}
			err := func() error {
				if published != "" {
					s, err := pgx.Connect(ctx, standbyURL)
					if err != nil {
						return err
					}
					defer s.Close(ctx)
					if _, err := s.Exec(ctx, `SELECT pg_replication_slot_advance($1, least($2::pg_lsn, pg_last_wal_replay_lsn()))
						FROM pg_replication_slots WHERE slot_name = $1 AND confirmed_flush_lsn < $2::pg_lsn`, name, published); err != nil {
						return err
					}
				}
				p, err := pgx.Connect(ctx, primaryURL)
				if err != nil {
					return err
				}
				defer p.Close(ctx)
				return p.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, name).Scan(&published)
			}()
			a.mu.Lock()
			if err == nil {
				a.advanced++
			}
			a.lastErr = err
			a.mu.Unlock()
		}
	})
	return a
}

func (a *copyAdvancer) halt() (rounds int, err error) {
	select {
	case <-a.stop:
	default:
		close(a.stop)
	}
	a.wg.Wait()
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.advanced, a.lastErr
}

// confirmedOn is the confirmed position of slot name on the server of url.
func confirmedOn(t *testing.T, url, name string) decoder.LSN {
	t.Helper()
	c, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	var s string
	if err := c.QueryRow(context.Background(), `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, name).Scan(&s); err != nil {
		t.Fatalf("the confirmed position of slot %s: %v", name, err)
	}
	lsn, err := slot.ParseLSN(s)
	if err != nil {
		t.Fatal(err)
	}
	return lsn
}

// TestPatroniSlotCopyCarriesOn: a primary and a standby with a copy of the
// relay's slot kept as Patroni keeps it for a slot under slots: (on 17+
// the slot is not a failover slot, as Patroni's is not). Given both
// nodes' URLs, the relay's failover line (INFO, not WARN) and status say a
// failover keeps the slot and how far the copy lags, never that it loses
// it; status on the standby says it holds a copy. Then the primary is
// killed and the standby promoted under writers: the relay goes on from
// the copy, every committed id delivered, the duplicates those of the
// WAL the copy lagged.
func TestPatroniSlotCopyCarriesOn(t *testing.T) {
	rs := startReplicaSet(t, replicaSetOptions{})
	e := rs.newEnv()
	c := e.consume()
	primaryURL, standbyURL := rs.primary.URL(e.name), rs.standby.URL(e.name)
	nodes := []string{"--standby-url", primaryURL, "--standby-url", standbyURL}
	args := append(withFlag(e.args(), "--slot-poll-interval", "1s"), "--no-failover-slot")
	args = append(args, nodes...)
	p := startProc(t, nil, args...)
	e.waitSlotActive(p)
	conn := e.conn()
	first := e.insertRows(conn, 20, "first")
	c.waitAll(first, time.Minute)

	rs.copySlotAsPatroni(e.name, e.name)
	adv := rs.advanceCopy(e.name, e.name, 500*time.Millisecond)
	defer func() { _, _ = adv.halt() }() // halted below; again when the test fails first
	const keeps = "keeps a copy of the slot that slot synchronization did not make"
	var out string
	e.waitFor("status saying the standby's copy keeps the slot", time.Minute, func() (bool, error) {
		out, _ = runOutput(t, append([]string{"status", "--pg-url", e.url, "--slot", e.name}, nodes...)...)
		return strings.Contains(out, keeps), fmt.Errorf("status said:\n%s", out)
	})
	for _, w := range []string{"standby postgres@127.0.0.1:" + strconv.Itoa(rs.standby.Port), "a failover to it keeps the slot and resumes from the copy's position",
		"Kafka can hold events of the old primary's last transactions that the new primary does not have"} {
		if !strings.Contains(out, w) {
			t.Errorf("status lacks %q:\n%s", w, out)
		}
	}
	if strings.Contains(out, "loses the slot") {
		t.Errorf("status says a failover loses the slot though the standby keeps a copy:\n%s", out)
	}
	e.waitFor("the relay's failover line naming the copy", time.Minute, func() (bool, error) {
		line := logLine(p.out.String(), keeps)
		return line != "", errors.New("no failover line naming the copy yet")
	})
	if line := logLine(p.out.String(), keeps); !strings.Contains(line, `"level":"info"`) {
		t.Errorf("the failover line naming a copy that keeps the slot is not at INFO: %s", line)
	}
	if out, _ := runOutput(t, "status", "--pg-url", standbyURL, "--slot", e.name); !strings.Contains(out, "this server is a standby, and this standby "+keeps) {
		t.Errorf("status on the standby does not say it keeps a copy:\n%s", out)
	}

	fw := e.startFailoverWriters(2, 5*time.Millisecond)
	defer fw.halt()
	n := len(distinctIDs(c.records()))
	e.waitFor("records before the failover", 2*time.Minute, func() (bool, error) {
		got := len(distinctIDs(c.records()))
		return got >= n+200, fmt.Errorf("%d ids read", got)
	})
	rounds, advErr := adv.halt()
	if rounds == 0 {
		t.Fatalf("the copy was never advanced: %v", advErr)
	}
	copyAt, primaryAt := confirmedOn(t, standbyURL, e.name), confirmedOn(t, primaryURL, e.name)
	rs.failover(nil)
	n = len(distinctIDs(c.records()))
	e.waitFor("records after the failover", 2*time.Minute, func() (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("the relay exited: %s", finalLines(p.out.String()))
		default:
		}
		got := len(distinctIDs(c.records()))
		return got > n, fmt.Errorf("%d ids read", got)
	})
	fw.halt()
	committed := e.committedIDs()
	var all []string
	for id := range committed {
		all = append(all, id)
	}
	e.waitFor("every committed id delivered", 2*time.Minute, func() (bool, error) {
		m := missingIDs(c, all)
		return len(m) == 0, fmt.Errorf("%d committed ids not read", len(m))
	})
	// Not checkSurvivingHistory: before PostgreSQL 17 nothing holds
	// decoding back until the standby has the WAL, so events of the last
	// transactions the killed primary committed and the standby never
	// received can be in Kafka (status says so: asserted above).
	dups, phantoms := 0, 0
	for _, id := range first { // committed before the writers' table
		committed[id] = true
	}
	for id, n := range distinctIDs(c.records()) {
		if !committed[id] {
			phantoms++
		}
		dups += n - 1
	}
	if inv := orderInversions(c.records()); inv > 0 {
		t.Errorf("%d records out of per-key order", inv)
	}
	// The promoted standby's slot is the copy: the relay resumed from the
	// copy's last position and sent the events after it again.
	resumed := logLine(p.out.String(), "behind what this process had acknowledged on the old timeline")
	if !strings.Contains(resumed, `"slot_confirmed_lsn":"`+copyAt.String()+`"`) || dups == 0 {
		t.Errorf("the relay did not resume from the copy's position %s, sending the events after it again (%d duplicates): %s", copyAt, dups, resumed)
	}
	t.Logf("a copy kept as Patroni keeps it (advanced %d times): confirmed at %s when the primary's was at %s (%d bytes behind); kill -9 failover: %d committed, 0 lost, %d duplicates, %d delivered of transactions the promoted standby never received",
		rounds, copyAt, primaryAt, int64(primaryAt-copyAt), len(committed), dups, phantoms)
}

// TestSlotNeverStreamedRefusal: a slot walrelay setup created and that is
// gone before walrelay run (Patroni without slots: or ignore_slots drops
// it within its loop) is refused as one no relay streamed from, naming
// Patroni's settings and log line, not a failover under a running relay;
// once a relay streamed from it, the refusal says so. A record table of
// an older walrelay gains the column that tells them apart, its rows
// counting as streamed from (not known).
func TestSlotNeverStreamedRefusal(t *testing.T) {
	e := newEnv(t)
	c := e.consume()
	if out, code := runOutput(t, e.setupArgs()...); code != 0 {
		t.Fatalf("setup exit %d:\n%s", code, out)
	}
	e.exec(`SELECT pg_drop_replication_slot($1)`, e.name) // as Patroni does
	run := withFlag(e.args(), "--startup-timeout", "5s")
	const never, streamed = "no relay ever streamed from it", "is gone, though walrelay streamed from it"
	refusedWith(t, run, `replication slot "`+e.name+`" is gone`, never, "Dropped unknown replication slot", "slots: {"+e.name+":", "ignore_slots: [{name: "+e.name+"}]", "may be missing", "--accept-gap")
	out, code := runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
	if code != 2 || !strings.Contains(out, never) || strings.Contains(out, streamed) {
		t.Errorf("status of the slot never streamed from: exit %d, want 2 saying %q:\n%s", code, never, out)
	}

	// The way on, then a relay that streams: the record says so, and the
	// refusal once the slot is gone again says walrelay streamed from it.
	if out, code := runOutput(t, e.setupArgs("--accept-gap")...); code != 0 {
		t.Fatalf("setup --accept-gap exit %d:\n%s", code, out)
	}
	p := startProc(t, nil, e.args()...)
	e.waitSlotActive(p)
	ids := e.insertRows(e.conn(), 5, "streamed")
	c.waitAll(ids, time.Minute)
	var marked bool
	rc := e.conn()
	e.waitFor("the record saying a relay streamed from the slot", 30*time.Second, func() (bool, error) {
		err := rc.QueryRow(e.ctx, `SELECT streamed_at IS NOT NULL FROM walrelay.slots WHERE slot_name = $1`, e.name).Scan(&marked)
		return marked, err
	})
	stopProc(t, p)
	// Its walsender ends a moment after the relay: the slot is released
	// then, and Patroni (or anyone) can drop it.
	e.waitFor("the slot released", 30*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && !i.Active, err
	})
	e.exec(`SELECT pg_drop_replication_slot($1)`, e.name)
	out, _, _, _ = runBounded(t, 30*time.Second, nil, run...)
	if final := finalLines(out); !strings.Contains(final, streamed) || strings.Contains(final, never) || !strings.Contains(final, "Dropped unknown replication slot") {
		t.Errorf("the refusal of a slot a relay streamed from does not say so, or names no Patroni: %s", final)
	}

	// A record table without the column (an older walrelay's): setup adds
	// it, the row already there counting as streamed from; a new slot's
	// row as never streamed from.
	e.exec(`ALTER TABLE walrelay.slots DROP COLUMN streamed_at`)
	other := e.name + "_b"
	if out, code := runOutput(t, "setup", "--pg-url", e.url, "--slot", other, "--publication", e.name); code != 0 {
		t.Fatalf("setup of a second slot exit %d:\n%s", code, out)
	}
	rows, err := rc.Query(e.ctx, `SELECT slot_name, coalesce(streamed_at::text, 'NULL') FROM walrelay.slots ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for rows.Next() {
		var name, at string
		if err := rows.Scan(&name, &at); err != nil {
			t.Fatal(err)
		}
		got[name] = at
	}
	if got[e.name] != "-infinity" || got[other] != "NULL" {
		t.Errorf("streamed_at after adding the column: %v, want -infinity for the row already there and NULL for the new slot's", got)
	}
}

// patroniCluster is Patroni itself (Debian's patroni package) over an etcd
// of its own (etcd-server), two nodes of the package's PostgreSQL
// (Debian's, for its pg_basebackup, which Patroni makes replicas with).
type patroniCluster struct {
	t     *testing.T
	dir   string
	scope string
	bin   string // PostgreSQL's bin directory
	etcd  *exec.Cmd
	dcs   string // etcd's client address
	nodes []*patroniNode
}

type patroniNode struct {
	name      string
	pgPort    int
	apiPort   int
	config    string
	cmd       *exec.Cmd
	log       string
	done      chan struct{}
	uid, gid  int
	runAsUser bool
}

// startPatroni starts etcd and a Patroni cluster of two nodes, the first
// the leader, the second its replica, and returns once both answer their
// role on Patroni's REST API. Skipped without patroni, etcd, or
// PostgreSQL's pg_basebackup beside the test cluster's server.
func startPatroni(t *testing.T) *patroniCluster {
	t.Helper()
	if pgCluster == nil {
		t.Skip("needs PostgreSQL binaries of its own; skipped against an external PostgreSQL")
	}
	for _, tool := range []string{"patroni", "patronictl", "etcd"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (Debian: apt-get install patroni etcd-server)", tool)
		}
	}
	server, err := filepath.EvalSymlinks(filepath.Join(pgCluster.BinDir(), "postgres"))
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Dir(server)
	if _, err := os.Stat(filepath.Join(bin, "pg_basebackup")); err != nil {
		t.Skipf("needs pg_basebackup beside %s, which Patroni makes its replicas with", server)
	}
	dir, err := os.MkdirTemp("", "walrelay-patroni-")
	if err != nil {
		t.Fatal(err)
	}
	pc := &patroniCluster{t: t, dir: dir, bin: bin, scope: filepath.Base(dir)}
	// Registered before any env on the cluster: it runs after their
	// cleanups, which drop their databases through it.
	t.Cleanup(pc.close)
	uid, gid := -1, -1
	if os.Geteuid() == 0 { // PostgreSQL refuses root: Patroni runs as postgres
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatal(err)
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	ports := make([]int, 6)
	for i := range ports {
		if ports[i], err = devcluster.FreePort(); err != nil {
			t.Fatal(err)
		}
	}
	pc.dcs = fmt.Sprintf("127.0.0.1:%d", ports[0])
	pc.etcd = exec.Command("etcd", "--name", "e", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", "http://"+pc.dcs, "--advertise-client-urls", "http://"+pc.dcs,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", ports[1]), "--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		"--initial-cluster", fmt.Sprintf("e=http://127.0.0.1:%d", ports[1]))
	etcdLog, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer etcdLog.Close()
	pc.etcd.Stdout, pc.etcd.Stderr = etcdLog, etcdLog
	if err := pc.etcd.Start(); err != nil {
		t.Fatal(err)
	}
	for i, name := range []string{"n1", "n2"} {
		n := &patroniNode{name: name, pgPort: ports[2+i], apiPort: ports[4+i], uid: uid, gid: gid, runAsUser: uid >= 0}
		n.config = filepath.Join(dir, name+".yml")
		n.log = filepath.Join(dir, name+".log")
		if err := os.WriteFile(n.config, []byte(pc.nodeConfig(n)), 0o644); err != nil {
			t.Fatal(err)
		}
		pc.nodes = append(pc.nodes, n)
	}
	pc.startNode(pc.nodes[0])
	pc.waitRole(pc.nodes[0], "primary", 2*time.Minute)
	pc.startNode(pc.nodes[1])
	pc.waitRole(pc.nodes[1], "replica", 2*time.Minute)
	return pc
}

// nodeConfig is a node's patroni.yml: trust on 127.0.0.1, a short loop,
// wal_level = logical and hot_standby_feedback (which Patroni's copies of
// logical slots need).
func (pc *patroniCluster) nodeConfig(n *patroniNode) string {
	data := filepath.Join(pc.dir, n.name)
	return fmt.Sprintf(`scope: %[1]s
name: %[2]s
restapi:
  listen: 127.0.0.1:%[3]d
  connect_address: 127.0.0.1:%[3]d
etcd3:
  hosts: %[4]s
bootstrap:
  dcs:
    ttl: 20
    loop_wait: 1
    retry_timeout: 5
    maximum_lag_on_failover: 1048576
    postgresql:
      use_pg_rewind: false
      use_slots: true
      parameters:
        wal_level: logical
        hot_standby_feedback: "on"
        max_replication_slots: 10
        max_wal_senders: 10
        wal_keep_size: 256MB
        wal_sender_timeout: 10s
  initdb:
  - encoding: UTF8
  - locale: C
  pg_hba:
  - local all all trust
  - host all all 127.0.0.1/32 trust
  - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:%[5]d
  connect_address: 127.0.0.1:%[5]d
  data_dir: %[6]s/data
  bin_dir: %[7]s
  pgpass: %[6]s.pgpass
  authentication:
    superuser: {username: postgres, password: unused}
    replication: {username: postgres, password: unused}
    rewind: {username: postgres, password: unused}
  parameters:
    unix_socket_directories: %[8]s
`, pc.scope, n.name, n.apiPort, pc.dcs, n.pgPort, data, pc.bin, pc.dir)
}

func (pc *patroniCluster) startNode(n *patroniNode) {
	pc.t.Helper()
	f, err := os.Create(n.log)
	if err != nil {
		pc.t.Fatal(err)
	}
	n.cmd = exec.Command("patroni", n.config)
	n.cmd.Stdout, n.cmd.Stderr = f, f
	n.cmd.Dir = pc.dir
	if n.runAsUser {
		n.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(n.uid), Gid: uint32(n.gid)}}
		if err := f.Chown(n.uid, n.gid); err != nil {
			pc.t.Fatal(err)
		}
	}
	if err := n.cmd.Start(); err != nil {
		pc.t.Fatal(err)
	}
	n.done = make(chan struct{})
	go func() {
		_ = n.cmd.Wait()
		f.Close()
		close(n.done)
	}()
}

// role asks Patroni's REST API whether n is the primary (or a replica):
// 200 when it is.
func (n *patroniNode) is(role string) bool {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/%s", n.apiPort, role))
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func (pc *patroniCluster) waitRole(n *patroniNode, role string, limit time.Duration) {
	pc.t.Helper()
	err := devcluster.WaitFor(limit, 200*time.Millisecond, func() (bool, error) {
		select {
		case <-n.done:
			return false, fmt.Errorf("patroni %s exited", n.name)
		default:
		}
		return n.is(role), fmt.Errorf("patroni %s is not %s yet", n.name, role)
	})
	if err != nil {
		pc.t.Fatalf("%v:\n%s", err, pc.logTail(n))
	}
}

func (pc *patroniCluster) logTail(n *patroniNode) string {
	b, _ := os.ReadFile(n.log)
	return lastLines(string(b), 30)
}

// url is db on n's PostgreSQL, whatever its role.
func (n *patroniNode) url(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", n.pgPort, db)
}

// url is the multi-host URL of db on both nodes: it reaches the leader.
func (pc *patroniCluster) url(db string) string {
	return devcluster.MultiHostURL(db, pc.nodes[0].pgPort, pc.nodes[1].pgPort)
}

// patchConfig changes Patroni's dynamic configuration (PATCH /config).
func (pc *patroniCluster) patchConfig(body string) {
	pc.t.Helper()
	req, err := http.NewRequest(http.MethodPatch, fmt.Sprintf("http://127.0.0.1:%d/config", pc.nodes[0].apiPort), strings.NewReader(body))
	if err != nil {
		pc.t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		pc.t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		pc.t.Fatalf("PATCH /config: %s: %s", resp.Status, b)
	}
}

// patronictl runs patronictl against the cluster.
func (pc *patroniCluster) patronictl(args ...string) string {
	pc.t.Helper()
	out, err := exec.Command("patronictl", append([]string{"-c", pc.nodes[0].config}, args...)...).CombinedOutput()
	if err != nil {
		pc.t.Fatalf("patronictl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// close stops Patroni (which stops its PostgreSQL) and etcd, and removes
// the cluster's directory.
func (pc *patroniCluster) close() {
	for _, n := range pc.nodes {
		if n.cmd != nil && n.cmd.Process != nil {
			_ = n.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for _, n := range pc.nodes {
		if n.cmd == nil || n.cmd.Process == nil {
			continue
		}
		select {
		case <-n.done:
		case <-time.After(30 * time.Second):
			_ = n.cmd.Process.Kill()
			<-n.done
		}
		// A PostgreSQL Patroni left running (it was killed) is stopped
		// by its own pid file.
		if b, err := os.ReadFile(filepath.Join(pc.dir, n.name, "data", "postmaster.pid")); err == nil {
			if pid, err := strconv.Atoi(strings.SplitN(string(b), "\n", 2)[0]); err == nil {
				_ = syscall.Kill(pid, syscall.SIGQUIT)
			}
		}
	}
	if pc.etcd != nil && pc.etcd.Process != nil {
		_ = pc.etcd.Process.Kill()
		_ = pc.etcd.Wait()
	}
	if !pc.t.Failed() {
		os.RemoveAll(pc.dir)
	} else {
		pc.t.Logf("Patroni's logs and data kept in %s", pc.dir)
	}
}

// TestPatroniSwitchover runs the relay under Patroni itself. Without
// slots: in Patroni's dynamic configuration, Patroni drops the slot
// walrelay setup made at its next look at the slots (a restart of
// PostgreSQL here), and walrelay run refuses, saying no relay ever
// streamed from the slot and naming Patroni's settings. With the slot
// named under slots:, Patroni creates it on the leader and copies it to
// the replica; walrelay setup --accept-gap takes it, status says a
// failover keeps it. Then patronictl switchover under writers: the relay
// goes on from the new leader's copy, every committed id delivered, none
// of a transaction that did not commit, per-key order kept; the
// duplicates are the WAL the copy lagged.
func TestPatroniSwitchover(t *testing.T) {
	began := time.Now()
	pc := startPatroni(t)
	e := newEnvOn(t, pc.url("postgres"))
	started := time.Since(began)
	n1, n2 := pc.nodes[0], pc.nodes[1]
	n1URL, n2URL := n1.url(e.name), n2.url(e.name)

	if out, code := runOutput(t, e.setupArgs()...); code != 0 {
		t.Fatalf("setup exit %d:\n%s", code, out)
	}
	pc.patronictl("restart", pc.scope, n1.name, "--force")
	dropped := fmt.Sprintf("Dropped unknown replication slot '%s'", e.name)
	e.waitFor("Patroni dropping the slot it does not know", 2*time.Minute, func() (bool, error) {
		b, err := os.ReadFile(n1.log)
		return strings.Contains(string(b), dropped), err
	})
	refusedWith(t, withFlag(e.args(), "--startup-timeout", "5s"), "no relay ever streamed from it", dropped, "slots: {"+e.name+":", "ignore_slots: [{name: "+e.name+"}]")

	pc.patchConfig(fmt.Sprintf(`{"slots": {%q: {"type": "logical", "database": %q, "plugin": "pgoutput"}}}`, e.name, e.name))
	// Patroni makes the slot on the leader, then copies it to the
	// replica, restarting it.
	e.waitFor("Patroni's copy of the slot on the replica", 2*time.Minute, func() (bool, error) {
		c, err := pgx.Connect(e.ctx, n2URL)
		if err != nil {
			return false, err
		}
		defer c.Close(context.Background())
		var n int
		err = c.QueryRow(e.ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, e.name).Scan(&n)
		return n == 1, err
	})
	if out, code := runOutput(t, e.setupArgs("--accept-gap")...); code != 0 {
		t.Fatalf("setup --accept-gap exit %d:\n%s", code, out)
	}
	c := e.consume()
	nodes := []string{"--standby-url", n1URL, "--standby-url", n2URL}
	args := append(withFlag(e.args(), "--slot-poll-interval", "1s"), nodes...)
	p := startProc(t, nil, args...)
	e.waitSlotActive(p)
	const keeps = "keeps a copy of the slot that slot synchronization did not make"
	status := func() string {
		out, _ := runOutput(t, append([]string{"status", "--pg-url", e.url, "--slot", e.name}, nodes...)...)
		return out
	}
	var out string
	e.waitFor("status saying Patroni's copy keeps the slot", time.Minute, func() (bool, error) {
		out = status()
		return strings.Contains(out, keeps) && !strings.Contains(out, "loses the slot"), fmt.Errorf("status said:\n%s", out)
	})
	fw := e.startFailoverWriters(2, 5*time.Millisecond)
	defer fw.halt()
	n := len(distinctIDs(c.records()))
	e.waitFor("records before the switchover", 2*time.Minute, func() (bool, error) {
		got := len(distinctIDs(c.records()))
		return got >= n+200, fmt.Errorf("%d ids read", got)
	})
	copyAt, leaderAt := confirmedOn(t, n2URL, e.name), confirmedOn(t, n1URL, e.name)
	switched := time.Now()
	pc.patronictl("switchover", pc.scope, "--leader", n1.name, "--candidate", n2.name, "--force")
	pc.waitRole(n2, "primary", 2*time.Minute)
	n = len(distinctIDs(c.records()))
	e.waitFor("records after the switchover", 2*time.Minute, func() (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("the relay exited: %s", finalLines(p.out.String()))
		default:
		}
		got := len(distinctIDs(c.records()))
		return got > n, fmt.Errorf("%d ids read", got)
	})
	toRecords := time.Since(switched)
	// The old leader rejoins as a replica with its own slot, which Patroni
	// then moves forward as a copy: status says it keeps the slot again.
	pc.waitRole(n1, "replica", 2*time.Minute)
	e.waitFor("status saying the old leader's copy keeps the slot", 2*time.Minute, func() (bool, error) {
		out = status()
		return strings.Contains(out, "standby postgres@127.0.0.1:"+strconv.Itoa(n1.pgPort)+"/"+e.name+" "+keeps), fmt.Errorf("status said:\n%s", out)
	})
	fw.halt()
	committed := e.committedIDs()
	var all []string
	for id := range committed {
		all = append(all, id)
	}
	e.waitFor("every committed id delivered", 2*time.Minute, func() (bool, error) {
		m := missingIDs(c, all)
		return len(m) == 0, fmt.Errorf("%d committed ids not read", len(m))
	})
	dups, _, _ := checkSurvivingHistory(t, "at-least-once", committed, c.records())
	t.Logf("Patroni (%s): cluster up in %s; the replica's copy at %s when the leader's slot was at %s (%d bytes behind) before the switchover; switchover to the first new record %s; %d committed, 0 lost, %d duplicates; the test took %s",
		strings.TrimSpace(pc.patronictl("version")), started.Round(time.Second), copyAt, leaderAt, int64(leaderAt-copyAt), toRecords.Round(time.Second),
		len(committed), dups, time.Since(began).Round(time.Second))
}
