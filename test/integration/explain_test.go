package integration

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// explain runs walrelay status --explain, as text and as JSON, and
// returns the text and the causes.
func (e *env) explain() (string, []doctor.Cause) {
	e.t.Helper()
	args := []string{"status", "--pg-url", e.url, "--slot", e.name, "--explain", "--rate-window", "0"}
	text, code := runOutput(e.t, args...)
	if code == 2 {
		e.t.Fatalf("status --explain: exit 2:\n%s", text)
	}
	out, _ := runOutput(e.t, append(args, "--json")...)
	var st struct {
		Explain []doctor.Cause `json:"explain"`
	}
	// An unhealthy slot's error follows the JSON on stderr.
	if err := json.NewDecoder(strings.NewReader(out[max(strings.Index(out, "{"), 0):])).Decode(&st); err != nil {
		e.t.Fatalf("status --explain --json: %v\n%s", err, out)
	}
	if st.Explain == nil {
		e.t.Fatalf("status --explain --json has no explain:\n%s", out)
	}
	return text, st.Explain
}

// waitCause waits until status --explain names a cause of kind, and
// returns its text output and the cause.
func (e *env) waitCause(kind string, timeout time.Duration) (string, doctor.Cause) {
	e.t.Helper()
	var text string
	var found doctor.Cause
	e.waitFor("status --explain naming "+kind, timeout, func() (bool, error) {
		var causes []doctor.Cause
		text, causes = e.explain()
		var kinds []string
		for _, c := range causes {
			// The text and the JSON come from two runs: both must
			// name it.
			if c.Kind == kind && strings.Contains(text, ". "+kind+" (") {
				found = c
				return true, nil
			}
			kinds = append(kinds, c.Kind)
		}
		info := e.slotInfo()
		return false, fmt.Errorf("causes %v (slot: active %v, lag %d)", kinds, info.Active, info.LagBytes)
	})
	return text, found
}

// explainSection is the explain part of status's text output.
func explainSection(text string) string {
	if i := strings.Index(text, "explain "); i >= 0 {
		return text[i:]
	}
	return text
}

// restartPast writes outbox rows and checkpoints (each logs the
// running-transactions record PostgreSQL moves restart_lsn at) until the
// slot's restart_lsn passed lsn, or for at most timeout; it reports
// whether it did.
func (e *env) restartPast(lsn decoder.LSN, timeout time.Duration) bool {
	e.t.Helper()
	conn := e.conn()
	err := devcluster.WaitFor(timeout, 100*time.Millisecond, func() (bool, error) {
		if e.slotInfo().RestartLSN > lsn {
			return true, nil
		}
		e.insertOutbox("pin", 1)
		_, err := conn.Exec(e.ctx, "CHECKPOINT")
		return false, err
	})
	return err == nil
}

// hasSeries reports whether the registry exports metric name at all
// (gathered leaves out zero values).
func hasSeries(reg *prometheus.Registry, name string) bool {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			return true
		}
	}
	return false
}

// metricOf is the value of an unlabelled metric name.
func metricOf(reg *prometheus.Registry, name string) float64 { return sumValues(gathered(reg, name)) }

// TestExplainOpenTransaction: a transaction of another session, open with
// an xid, pins the slot's catalog_xmin and restart_lsn. status --explain
// names its pid, database, age, state and the first line of its query,
// with the fix; walrelay_source_oldest_xact_age_seconds counts its age.
// Once it ends, explain no longer names it.
func TestExplainOpenTransaction(t *testing.T) {
	e, _ := newClusterEnv(t, nil)
	e.exec(`CREATE TABLE accounts (id int PRIMARY KEY, balance int)`)
	e.exec(`INSERT INTO accounts VALUES (7, 100)`)
	cfg := e.config()
	cfg.SlotPollInterval = 200 * time.Millisecond
	_, reg := e.startRelayGathered(cfg)

	holder := e.conn()
	for _, q := range []string{"BEGIN", "UPDATE accounts SET balance = balance - 1\n  WHERE id = 7"} {
		if _, err := holder.Exec(e.ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	pid := holder.PgConn().PID()
	var xid int64
	if err := e.conn().QueryRow(e.ctx, `SELECT backend_xid::text::bigint FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	began := e.currentLSN(e.conn())
	// PostgreSQL holds the slot: restart_lsn stays before the
	// transaction's change while the relay confirms past it.
	if e.restartPast(began, 5*time.Second) {
		t.Fatalf("restart_lsn passed %s, the open transaction's change", began)
	}
	text, c := e.waitCause("open_transaction", 60*time.Second)
	t.Logf("status --explain:\n%s", explainSection(text))
	mustContain(t, "the open transaction's cause", c.Text+" fix: "+c.Fix,
		fmt.Sprintf("pid %d in database %q", pid, e.name), `user "postgres"`, "idle in transaction",
		fmt.Sprintf("xid %d", xid), "stays at or before it", `"UPDATE accounts SET balance = balance - 1 …"`,
		fmt.Sprintf("SELECT pg_terminate_backend(%d)", pid), "idle_in_transaction_session_timeout")
	if c.Holds != "the slot's restart_lsn and catalog_xmin" {
		t.Errorf("holds %q", c.Holds)
	}
	e.waitFor("walrelay_source_oldest_xact_age_seconds > 0", 30*time.Second, func() (bool, error) {
		v := metricOf(reg, "walrelay_source_oldest_xact_age_seconds")
		return v > 0 && metricOf(reg, "walrelay_slot_restart_lag_bytes") > 0, fmt.Errorf("%v", v)
	})

	if _, err := holder.Exec(e.ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if !e.restartPast(began, 60*time.Second) {
		t.Errorf("restart_lsn did not pass %s after the transaction ended", began)
	}
	if _, causes := e.explain(); len(causes) != 0 {
		t.Errorf("explain after the transaction ended: %+v, want nothing", causes)
	}
}

// TestExplainPreparedTransaction: a prepared transaction pins the slot
// like an open one, with no session; status --explain names its gid,
// database, age and the COMMIT/ROLLBACK PREPARED that ends it.
func TestExplainPreparedTransaction(t *testing.T) {
	e, _ := newClusterEnv(t, map[string]string{"max_prepared_transactions": "4"})
	e.exec(`CREATE TABLE accounts (id int PRIMARY KEY, balance int)`)
	cfg := e.config()
	cfg.SlotPollInterval = 200 * time.Millisecond
	_, reg := e.startRelayGathered(cfg)
	const gid = "walrelay test's 2pc"
	holder := e.conn()
	for _, q := range []string{"BEGIN", "INSERT INTO accounts VALUES (1, 1)", "PREPARE TRANSACTION 'walrelay test''s 2pc'"} {
		if _, err := holder.Exec(e.ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { e.exec("ROLLBACK PREPARED 'walrelay test''s 2pc'") })
	var xid int64
	if err := e.conn().QueryRow(e.ctx, `SELECT transaction::text::bigint FROM pg_prepared_xacts WHERE gid = $1`, gid).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	prepared := e.currentLSN(e.conn())
	if e.restartPast(prepared, 5*time.Second) {
		t.Fatalf("restart_lsn passed %s, the prepared transaction's change", prepared)
	}
	text, c := e.waitCause("prepared_transaction", 60*time.Second)
	t.Logf("status --explain:\n%s", explainSection(text))
	mustContain(t, "the prepared transaction's cause", c.Text+" fix: "+c.Fix,
		"prepared transaction 'walrelay test''s 2pc'", fmt.Sprintf("xid %d", xid), "stays at or before it", fmt.Sprintf("database %q", e.name),
		"COMMIT PREPARED 'walrelay test''s 2pc' or ROLLBACK PREPARED 'walrelay test''s 2pc'")
	e.waitFor("walrelay_source_prepared_xacts 1", 30*time.Second, func() (bool, error) {
		v := metricOf(reg, "walrelay_source_prepared_xacts")
		return v == 1 && metricOf(reg, "walrelay_source_oldest_prepared_xact_age_seconds") > 0, fmt.Errorf("%v", v)
	})
}

// TestExplainOtherSlots: a logical slot nobody reads and a physical slot
// of a standby that is gone keep WAL (and the logical one catalog_xmin)
// older than walrelay's slot: status --explain names both, says they do
// not hold walrelay's slot but the cluster's WAL, and how to drop them;
// walrelay_source_oldest_slot_retained_wal_bytes shows the WAL.
func TestExplainOtherSlots(t *testing.T) {
	e, _ := newClusterEnv(t, nil)
	stale, gone := e.name+"_stale", e.name+"_standby"
	e.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, stale)
	e.exec(`SELECT pg_create_physical_replication_slot($1, true)`, gone)
	t.Cleanup(func() {
		e.exec(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name IN ($1, $2)`, stale, gone)
	})
	cfg := e.config()
	cfg.SlotPollInterval = 200 * time.Millisecond
	_, reg := e.startRelayGathered(cfg)
	conn := e.conn()
	var staleRestart string
	if err := conn.QueryRow(e.ctx, `SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, stale).Scan(&staleRestart); err != nil {
		t.Fatal(err)
	}
	old, _ := slot.ParseLSN(staleRestart)
	e.waitFor("walrelay's slot past the stale one", 60*time.Second, func() (bool, error) {
		var own, other int64
		if err := conn.QueryRow(e.ctx, `SELECT age(a.catalog_xmin), age(b.catalog_xmin) FROM pg_replication_slots a, pg_replication_slots b
			WHERE a.slot_name = $1 AND b.slot_name = $2`, e.name, stale).Scan(&own, &other); err != nil {
			return false, err
		}
		if e.slotInfo().RestartLSN > old && own < other {
			return true, nil
		}
		e.insertOutbox("o", 10)
		_, err := conn.Exec(e.ctx, "CHECKPOINT")
		return false, err
	})
	text, c := e.waitCause("replication_slot", 30*time.Second)
	t.Logf("status --explain:\n%s", explainSection(text))
	_, causes := e.explain()
	var named []string
	for _, c := range causes {
		if c.Kind == "replication_slot" {
			named = append(named, c.Text+" fix: "+c.Fix)
		}
	}
	all := strings.Join(named, "\n")
	mustContain(t, "the slots' causes", all,
		fmt.Sprintf("replication slot %q (logical, database %q, inactive", stale, e.name), "catalog_xmin",
		fmt.Sprintf("replication slot %q (physical, inactive", gone), "keeps",
		"it does not hold this slot, but PostgreSQL keeps the cluster's WAL for the oldest slot",
		fmt.Sprintf("SELECT pg_drop_replication_slot('%s')", stale), fmt.Sprintf("SELECT pg_drop_replication_slot('%s')", gone))
	if c.Holds != "the cluster's WAL and xmin, not this slot" {
		t.Errorf("holds %q", c.Holds)
	}
	e.waitFor("walrelay_source_oldest_slot_retained_wal_bytes above the slot's own", 30*time.Second, func() (bool, error) {
		all, own := metricOf(reg, "walrelay_source_oldest_slot_retained_wal_bytes"), metricOf(reg, "walrelay_slot_retained_wal_bytes")
		return all > own && metricOf(reg, "walrelay_source_replication_xmin_age") > 0, fmt.Errorf("oldest slot %v, own %v", all, own)
	})
}

// TestExplainStandbyXmin: a physical walsender without a slot whose
// standby sends hot_standby_feedback with an xmin older than the slot's
// catalog_xmin. The standby is this test speaking the replication
// protocol to the real server (a physical stream and a feedback message,
// as a standby's walreceiver sends them): status --explain names it by
// its application_name, says it holds the cluster's xmin and not this
// slot, and walrelay_source_replication_xmin_age counts it.
func TestExplainStandbyXmin(t *testing.T) {
	e, _ := newClusterEnv(t, nil)
	cfg := e.config()
	cfg.SlotPollInterval = 200 * time.Millisecond
	_, reg := e.startRelayGathered(cfg)
	conn := e.conn()
	var xmin int64
	if err := conn.QueryRow(e.ctx, "SELECT txid_current() % 4294967296").Scan(&xmin); err != nil {
		t.Fatal(err)
	}
	e.waitFor("the slot's catalog_xmin past the standby's xmin", 60*time.Second, func() (bool, error) {
		if info := e.slotInfo(); info.CatalogXmin != nil && *info.CatalogXmin > xmin {
			return true, nil
		}
		e.insertOutbox("o", 1)
		_, err := conn.Exec(e.ctx, "CHECKPOINT")
		return false, err
	})

	rcfg, err := pgconn.ParseConfig(e.url + "&replication=true&application_name=feedback_standby")
	if err != nil {
		t.Fatal(err)
	}
	standby, err := pgconn.ConnectConfig(e.ctx, rcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Close(context.Background()) })
	sys, err := pglogrepl.IdentifySystem(e.ctx, standby)
	if err != nil {
		t.Fatal(err)
	}
	// A physical stream without a slot (pglogrepl always names one).
	standby.Frontend().SendQuery(&pgproto3.Query{String: "START_REPLICATION PHYSICAL " + sys.XLogPos.String()})
	if err := standby.Frontend().Flush(); err != nil {
		t.Fatal(err)
	}
	for started := false; !started; {
		msg, err := standby.ReceiveMessage(e.ctx)
		if err != nil {
			t.Fatal(err)
		}
		switch msg := msg.(type) {
		case *pgproto3.ErrorResponse:
			t.Fatal(pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.CopyBothResponse:
			started = true
		}
	}
	// Hot standby feedback: 'h', the client's time (microseconds since
	// 2000-01-01), xmin and its epoch, catalog_xmin and its epoch.
	msg := []byte{'h'}
	msg = binary.BigEndian.AppendUint64(msg, uint64(time.Since(time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)).Microseconds()))
	msg = binary.BigEndian.AppendUint32(msg, uint32(xmin))
	msg = binary.BigEndian.AppendUint32(msg, 0)
	msg = binary.BigEndian.AppendUint32(msg, 0)
	msg = binary.BigEndian.AppendUint32(msg, 0)
	buf, err := (&pgproto3.CopyData{Data: msg}).Encode(nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := standby.Frontend().SendUnbufferedEncodedCopyData(buf); err != nil {
		t.Fatal(err)
	}
	e.waitFor("pg_stat_replication showing the standby's xmin", 30*time.Second, func() (bool, error) {
		var got *int64
		err := conn.QueryRow(e.ctx, `SELECT backend_xmin::text::bigint FROM pg_stat_replication WHERE application_name = 'feedback_standby'`).Scan(&got)
		return got != nil && *got == xmin, err
	})
	text, c := e.waitCause("standby", 30*time.Second)
	t.Logf("status --explain:\n%s", explainSection(text))
	mustContain(t, "the standby's cause", c.Text+" fix: "+c.Fix, `standby "feedback_standby"`, fmt.Sprintf("holds xmin %d", xmin),
		"through hot_standby_feedback, without a slot", "it does not hold this slot", "max_standby_streaming_delay")
	if c.Holds != "the cluster's xmin, not this slot" {
		t.Errorf("holds %q", c.Holds)
	}
	e.waitFor("walrelay_source_replication_xmin_age > 0", 30*time.Second, func() (bool, error) {
		v := metricOf(reg, "walrelay_source_replication_xmin_age")
		return v > 0, fmt.Errorf("%v", v)
	})
}

// TestExplainStandbySlotXmin: a real streaming standby (devcluster, with
// hot_standby_feedback = on and a physical slot) runs a long query; its
// feedback puts the query's xmin on its slot. status --explain names the
// slot, the standby streaming from it and the xmin, says it holds the
// cluster's xmin, not this slot, and what holds it on the standby.
func TestExplainStandbySlotXmin(t *testing.T) {
	e, primary := newClusterEnv(t, nil)
	cfg := e.config()
	cfg.SlotPollInterval = 200 * time.Millisecond
	e.startRelayGathered(cfg)
	standby, err := primary.StartStandby(e.ctx, devcluster.StandbyOptions{Settings: map[string]string{"wal_receiver_status_interval": "'1s'"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Close() })
	if err := standby.WaitReplayed(e.ctx); err != nil {
		t.Fatal(err)
	}
	q, err := pgx.Connect(e.ctx, standby.URL(e.name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close(context.Background()) })
	// A long report on the standby: its snapshot's xmin is what
	// hot_standby_feedback sends the primary.
	var xmin int64
	for _, sql := range []string{"BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT count(*) FROM outbox"} {
		if _, err := q.Exec(e.ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	if err := q.QueryRow(e.ctx, "SELECT backend_xmin::text::bigint FROM pg_stat_activity WHERE pid = pg_backend_pid()").Scan(&xmin); err != nil {
		t.Fatal(err)
	}
	conn := e.conn()
	e.waitFor("the standby's slot holding xmin "+fmt.Sprint(xmin)+" and the relay's slot past it", 60*time.Second, func() (bool, error) {
		var held *int64
		if err := conn.QueryRow(e.ctx, `SELECT xmin::text::bigint FROM pg_replication_slots WHERE slot_type = 'physical'`).Scan(&held); err != nil {
			return false, err
		}
		if info := e.slotInfo(); held != nil && *held <= xmin && info.CatalogXmin != nil && *info.CatalogXmin > *held {
			return true, nil
		}
		e.insertOutbox("o", 1)
		_, err := conn.Exec(e.ctx, "CHECKPOINT")
		return false, fmt.Errorf("standby slot xmin %v (err %v)", held, err)
	})
	text, c := e.waitCause("replication_slot", 30*time.Second)
	t.Logf("status --explain:\n%s", explainSection(text))
	mustContain(t, "the standby slot's cause", c.Text+" fix: "+c.Fix, "(physical, streamed by pid", "(standby ", "holds xmin",
		"it does not hold this slot", "hot_standby_feedback = on", "max_standby_streaming_delay")
	if c.Holds != "the cluster's WAL and xmin, not this slot" {
		t.Errorf("holds %q", c.Holds)
	}
}

// TestExplainRelayStopped: with no relay running, status --explain blames
// the relay: none streams, none is connected, since when (inactive_since
// on 17+, the record's last move before), and the WAL it keeps.
func TestExplainRelayStopped(t *testing.T) {
	e := newEnv(t)
	p := startProc(t, nil, e.args()...)
	e.waitSlotActive(p)
	// The slot is active already while the relay creates it, before its
	// initial snapshot is done (which a stop drops the slot of, to be
	// made again): a stop then leaves no slot, or no record to tell since
	// when.
	e.waitFor("walrelay's record of the slot, its initial snapshot done", 30*time.Second, func() (bool, error) {
		conn, err := pgx.Connect(e.ctx, e.url)
		if err != nil {
			return false, err
		}
		defer conn.Close(context.Background())
		rec, ok, err := source.ReadRecord(e.ctx, conn, source.DefaultRecordSchema, e.name)
		return ok && rec.SnapshotPending == 0, err
	})
	stopProc(t, p)
	e.exec(`SELECT pg_logical_emit_message(false, 'walrelay.test', repeat('x', 100000))`)
	text, c := e.waitCause("relay_stopped", 30*time.Second)
	t.Logf("status --explain:\n%s", explainSection(text))
	mustContain(t, "the stopped relay's cause", c.Text+" fix: "+c.Fix,
		"no relay streams from the slot", "no walrelay process of this slot is connected", "from its confirmed_flush_lsn", "start walrelay run")
	if e.slotInfo().ServerVersion >= 170000 {
		mustContain(t, "the stopped relay's cause", c.Text, "(inactive_since ")
	} else {
		mustContain(t, "the stopped relay's cause", c.Text, "PostgreSQL before 17 does not say since when; walrelay last moved its record of the slot at")
	}
}

// TestExplainRelayWaitingForKafka: the broker goes away under a streaming
// relay. The relay names its connection after what it does, and status
// --explain blames it: "waiting for kafka" with events in flight, then
// "backpressure" once --max-inflight-events is reached. Before, with the
// relay healthy, explain blames nothing; after the broker is back every
// event arrives and the relay is not blamed any more.
func TestExplainRelayWaitingForKafka(t *testing.T) {
	e := newEnv(t)
	b := startKafkaAt(t)
	e.brokers = []string{b.addr()}
	cfg := e.config()
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(b.addr()), kgo.ProducerLinger(time.Millisecond)}
	cfg.Router.MaxInflightEvents = 5
	cfg.SlotPollInterval = 200 * time.Millisecond
	_, reg := e.startRelayGathered(cfg)
	c := e.consume()
	e.insertOutbox("o", 1)
	c.waitIDs(1, 30*time.Second)
	relayNamed := func(state string) {
		e.waitFor("the relay's connection named "+state, 30*time.Second, func() (bool, error) {
			var n int
			err := e.conn().QueryRow(e.ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, doctor.AppNameAsShown(doctor.RelayAppName(e.name, state))).Scan(&n)
			return n == 1, err
		})
	}
	relayNamed(doctor.RelayStreaming)
	if text, causes := e.explain(); len(causes) != 0 {
		t.Errorf("explain of a healthy relay blames %+v:\n%s", causes, text)
	} else {
		t.Logf("status --explain of the healthy relay:\n%s", explainSection(text))
	}
	// Absent, not 0, while max_slot_wal_keep_size is unlimited: an alert
	// on a low value must not fire.
	for _, name := range []string{"walrelay_slot_safe_wal_size_bytes", "walrelay_slot_time_to_invalidation_seconds"} {
		if hasSeries(reg, name) {
			t.Errorf("%s is exported with max_slot_wal_keep_size = -1: want it absent", name)
		}
	}

	b.stop()
	e.insertOutbox("o", 2)
	relayNamed(doctor.RelayWaitingForKafka)
	text, cause := e.waitCause("relay_waiting_for_kafka", 30*time.Second)
	t.Logf("status --explain, broker down, 2 events in flight:\n%s", explainSection(text))
	mustContain(t, "the cause", cause.Text+" fix: "+cause.Fix, `says "waiting for kafka"`, "Kafka acknowledged none of the events in flight", "make Kafka accept writes")

	e.insertOutbox("o", 10)
	relayNamed(doctor.RelayBackpressure)
	text, cause = e.waitCause("relay_waiting_for_kafka", 30*time.Second)
	t.Logf("status --explain, broker down, in-flight limit reached:\n%s", explainSection(text))
	mustContain(t, "the cause", cause.Text, `says "backpressure"`, "--max-inflight-events")

	b.start()
	c.waitIDs(13, 60*time.Second)
	relayNamed(doctor.RelayStreaming)
	e.waitFor("explain no longer blaming the relay", 30*time.Second, func() (bool, error) {
		_, causes := e.explain()
		return len(causes) == 0, fmt.Errorf("%+v", causes)
	})
}

// TestExplainQuietOutbox: the relay's database is quiet while another
// database of the cluster writes tens of MB, and the relay runs without
// heartbeats and idle advance: nothing comes through the slot for it to
// confirm (the other database's transactions are not even sent as empty
// ones, as PostgreSQL 14's pgoutput sends those of its own database).
// status --explain names the quiet outbox and the fix. The control, with
// heartbeats, does not.
func TestExplainQuietOutbox(t *testing.T) {
	for _, tc := range []struct {
		name      string
		heartbeat time.Duration
	}{{"no heartbeats", 0}, {"control: heartbeats", 500 * time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.heartbeat == 0 {
				// 14's pgoutput sends every transaction of the relay's
				// database, the relay's own record updates (each slot
				// poll) as an empty BEGIN and COMMIT, and the relay
				// confirms them: there the record moves the slot like a
				// heartbeat. 15 skips empty transactions.
				needPG(t, 15)
			}
			e := newEnv(t)
			otherURL, err := devcluster.CreateDatabase(e.ctx, pgAdminURL, e.name+"_other")
			if err != nil {
				t.Fatal(err)
			}
			other, err := pgx.Connect(e.ctx, otherURL)
			if err != nil {
				t.Fatal(err)
			}
			defer other.Close(context.Background())
			if _, err := other.Exec(e.ctx, `CREATE TABLE noise (id bigserial PRIMARY KEY, v text)`); err != nil {
				t.Fatal(err)
			}
			cfg := e.config()
			cfg.HeartbeatInterval = tc.heartbeat
			cfg.NoIdleAdvance = true
			e.startRelayGathered(cfg)
			conn := e.conn()
			start := e.currentLSN(conn)
			if tc.heartbeat > 0 {
				e.waitFor("the heartbeat's connection", 30*time.Second, func() (bool, error) {
					var n int
					err := conn.QueryRow(e.ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, doctor.AppNameAsShown(doctor.HeartbeatAppName(e.name))).Scan(&n)
					return n == 1, err
				})
			}
			// Noise until the relay is 20 MB behind, or its heartbeats
			// keep it closer.
			for e.currentLSN(conn)-start < 24<<20 {
				if _, err := other.Exec(e.ctx, `INSERT INTO noise (v) SELECT repeat('x', 1000) FROM generate_series(1, 4000)`); err != nil {
					t.Fatal(err)
				}
			}
			if tc.heartbeat == 0 {
				text, c := e.waitCause("quiet_outbox", 30*time.Second)
				t.Logf("status --explain:\n%s", explainSection(text))
				mustContain(t, "the quiet outbox's cause", c.Text+" fix: "+c.Fix, "the outbox is quiet and the relay sends no heartbeats",
					doctor.HeartbeatAppName(e.name), "--heartbeat-interval", "--idle-advance")
				return
			}
			// The heartbeat moves the slot past the noise.
			e.waitFor("the slot past the noise", 30*time.Second, func() (bool, error) {
				return e.slotInfo().ConfirmedLSN > start+24<<20, nil
			})
			text, causes := e.explain()
			for _, c := range causes {
				if c.Kind == "quiet_outbox" {
					t.Errorf("explain names a quiet outbox although the relay sends heartbeats:\n%s", text)
				}
			}
		})
	}
}

// TestSlotTimeLeft: with max_slot_wal_keep_size = 64MB and WAL written at
// about 1 MB/s, the relay's slot watch measures the WAL rate and the time
// the slot has left (walrelay_server_wal_bytes_per_second,
// walrelay_slot_time_to_invalidation_seconds) and warns once that the
// setting would invalidate the slot during a 24 h outage. With the relay
// stopped, status prints the rate and the time left and warns that it is
// short; past the limit (wal_status = unreserved, before the checkpoint
// that invalidates the slot) it exits 1.
func TestSlotTimeLeft(t *testing.T) {
	e, _ := newClusterEnv(t, map[string]string{"max_slot_wal_keep_size": "'64MB'", "checkpoint_timeout": "'30min'", "max_wal_size": "'1GB'"})
	logs := e.observeLogs()
	cfg := e.config()
	cfg.SlotPollInterval = 200 * time.Millisecond
	rr, reg := e.startRelayGathered(cfg)

	ctx, stopWriter := context.WithCancel(e.ctx)
	defer stopWriter()
	writer, err := pgx.Connect(ctx, e.url)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer writer.Close(context.Background())
		for ctx.Err() == nil {
			_, _ = writer.Exec(ctx, `SELECT pg_logical_emit_message(false, 'walrelay.test', repeat('x', 64000))`)
			time.Sleep(50 * time.Millisecond) // paces the load at about 1 MB/s
		}
	}()
	e.waitFor("the startup WARN about max_slot_wal_keep_size", 30*time.Second, func() (bool, error) {
		return len(warnings(logs, "max_slot_wal_keep_size = 64MB: at the server's WAL rate")) == 1, nil
	})
	t.Logf("WARN: %s", warnings(logs, "max_slot_wal_keep_size = 64MB")[0].Message)
	e.waitFor("the rate and time-left metrics", 30*time.Second, func() (bool, error) {
		return metricOf(reg, "walrelay_server_wal_bytes_per_second") > 0 && metricOf(reg, "walrelay_slot_time_to_invalidation_seconds") > 0 &&
			hasSeries(reg, "walrelay_slot_safe_wal_size_bytes"), nil
	})
	t.Logf("walrelay_server_wal_bytes_per_second %.0f, walrelay_slot_time_to_invalidation_seconds %.1f, walrelay_slot_safe_wal_size_bytes %.0f",
		metricOf(reg, "walrelay_server_wal_bytes_per_second"), metricOf(reg, "walrelay_slot_time_to_invalidation_seconds"), metricOf(reg, "walrelay_slot_safe_wal_size_bytes"))
	if err := rr.stop(t); err != nil {
		t.Fatal(err)
	}

	out, code := runOutput(t, "status", "--pg-url", e.url, "--slot", e.name)
	t.Logf("status: exit %d:\n%s", code, out)
	mustContain(t, "status", out, "wal_rate ", "time_left", "before max_slot_wal_keep_size invalidates the slot",
		"less than --planned-outage 24h", "raise max_slot_wal_keep_size to at least")
	out, _ = runOutput(t, "status", "--pg-url", e.url, "--slot", e.name, "--json")
	var st struct {
		WALRate  *float64 `json:"wal_rate_bytes_per_second"`
		TimeLeft *float64 `json:"time_to_invalidation_seconds"`
	}
	if err := json.Unmarshal([]byte(out[max(strings.Index(out, "{"), 0):]), &st); err != nil || st.WALRate == nil || st.TimeLeft == nil || *st.TimeLeft <= 0 {
		t.Errorf("status --json: rate %v, time left %v (%v):\n%s", st.WALRate, st.TimeLeft, err, out)
	}

	stopWriter()
	<-done
	conn := e.conn()
	e.waitFor("wal_status unreserved", 60*time.Second, func() (bool, error) {
		info := e.slotInfo()
		if info.WALStatus == "unreserved" {
			return true, nil
		}
		_, err := conn.Exec(e.ctx, `SELECT pg_logical_emit_message(false, 'walrelay.test', repeat('x', 4000000))`)
		return false, fmt.Errorf("wal_status %s (err %v)", info.WALStatus, err)
	})
	out, code = runOutput(t, "status", "--pg-url", e.url, "--slot", e.name, "--rate-window", "0")
	t.Logf("status: exit %d:\n%s", code, out)
	if code != 1 {
		t.Errorf("status of an unreserved slot: exit %d, want 1", code)
	}
	mustContain(t, "status", out, "wal_status = unreserved", "max_slot_wal_keep_size = 64MB", "next checkpoint")
}
