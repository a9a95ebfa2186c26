package integration

// Tests of what the database's settings do to the relay: settings a role,
// a database or the server imposes on every session, and the initial
// snapshot's connections ended part-way.

import (
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// hostileSettings are settings an application's role or database may
// carry, each of which ended or refused part of walrelay's work: its
// snapshot's exported snapshot (idle in transaction), a snapshot's
// statements and transaction, the record's and the heartbeat's writes.
func hostileSettings() map[string]string {
	s := map[string]string{
		"idle_in_transaction_session_timeout": "'500ms'",
		"statement_timeout":                   "'500ms'",
		"lock_timeout":                        "'10ms'",
		"idle_session_timeout":                "'1s'",
		"default_transaction_read_only":       "on",
		"default_transaction_isolation":       "'serializable'",
		"DateStyle":                           "'German'",
	}
	if pgVersion >= 170000 {
		s["transaction_timeout"] = "'1s'"
	}
	return s
}

// TestSessionSettingsOfRoleAndDatabase starts the relay, with its initial
// snapshot of rows that take seconds to publish, as a role that carries
// hostileSettings, or in a database that does: the snapshot is published
// once (no row twice, no second snapshot), the relay streams and publishes
// what is written after, with the heartbeat on.
func TestSessionSettingsOfRoleAndDatabase(t *testing.T) {
	for _, level := range []string{"role", "database"} {
		t.Run(level, func(t *testing.T) {
			e := newEnv(t)
			role := e.name + "_r"
			e.exec(`CREATE ROLE ` + role + ` WITH LOGIN REPLICATION`)
			e.dropRoleAtEnd(role)
			e.exec(`CREATE SCHEMA walrelay AUTHORIZATION ` + role)
			e.exec(`GRANT SELECT ON outbox TO ` + role)
			e.exec(fmt.Sprintf(`CREATE PUBLICATION %s FOR TABLE outbox WITH (publish = 'insert')`, pgx.Identifier{e.name}.Sanitize()))
			const rows = 3000
			insertSeq(e, "pre", 0, rows-1)
			target := "ROLE " + role
			if level == "database" {
				target = "DATABASE " + pgx.Identifier{e.name}.Sanitize()
				// The test's own sessions (an administrator's, in the same
				// database) keep the defaults: a role's setting in a
				// database wins over the database's.
				var admin string
				if err := e.conn().QueryRow(e.ctx, "SELECT current_user").Scan(&admin); err != nil {
					t.Fatal(err)
				}
				for name := range hostileSettings() {
					safe := "0"
					switch name {
					case "default_transaction_read_only":
						safe = "off"
					case "default_transaction_isolation":
						safe = "'read committed'"
					case "DateStyle":
						safe = "'ISO, MDY'"
					}
					e.exec(fmt.Sprintf("ALTER ROLE %s IN DATABASE %s SET %s = %s", pgx.Identifier{admin}.Sanitize(), pgx.Identifier{e.name}.Sanitize(), name, safe))
				}
			}
			for name, value := range hostileSettings() {
				e.exec(fmt.Sprintf("ALTER %s SET %s = %s", target, name, value))
			}
			u, err := url.Parse(e.url)
			if err != nil {
				t.Fatal(err)
			}
			u.User = url.User(role)
			cfg := e.config()
			cfg.PGURL = u.String()
			cfg.InitialSnapshot = true
			cfg.HeartbeatInterval = 200 * time.Millisecond
			// A small in-flight window makes the snapshot take seconds,
			// longer than every timeout above.
			cfg.Router.MaxInflightEvents = 5
			c := e.consume()
			_, reg := e.startRelayGathered(cfg)
			insertSeq(e, "post", 0, 9)
			recs := c.waitIDs(rows+10, 2*time.Minute)
			checkEachOnce(t, recs, tableIDs(e))
			if n := gathered(reg, "walrelay_snapshot_rows_total")[""]; n != rows {
				t.Errorf("walrelay_snapshot_rows_total = %v, want %d (one snapshot)", n, rows)
			}
			e.waitFor("heartbeats", 30*time.Second, func() (bool, error) {
				got := gathered(reg, "walrelay_heartbeats_total")
				return got["wal"] > 0, fmt.Errorf("walrelay_heartbeats_total %v", got)
			})
		})
	}
}

// TestInitialSnapshotOutlivesItsExportingConnection ends, while the
// initial snapshot is being published, the replication connection that
// exported it (a DBA's pg_terminate_backend, an idle timeout in the
// network): the slot already exists, so the snapshot goes on and is
// published once.
func TestInitialSnapshotOutlivesItsExportingConnection(t *testing.T) {
	e := newEnv(t)
	const rows = 3000
	insertSeq(e, "pre", 0, rows-1)
	cfg := e.config()
	cfg.InitialSnapshot = true
	cfg.Router.MaxInflightEvents = 5
	c := e.consume()
	conn := e.conn()
	done := make(chan struct{})
	var terminated int
	go func() {
		defer close(done)
		// The walsender holding the temporary slot, once the snapshot's
		// rows reach Kafka.
		_ = devcluster.WaitFor(time.Minute, 10*time.Millisecond, func() (bool, error) {
			if len(c.records()) < 100 {
				return false, nil
			}
			err := conn.QueryRow(e.ctx, `SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots
				WHERE slot_name LIKE 'walrelay_snapshot_%' AND database = $1 AND active_pid IS NOT NULL`, e.name).Scan(&terminated)
			return terminated > 0, err
		})
	}()
	_, reg := e.startRelayGathered(cfg)
	<-done
	if terminated == 0 {
		t.Fatal("the snapshot's exporting connection was not found to terminate")
	}
	recs := c.waitIDs(rows, 2*time.Minute)
	checkEachOnce(t, recs, tableIDs(e))
	if n := gathered(reg, "walrelay_snapshot_rows_total")[""]; n != rows {
		t.Errorf("walrelay_snapshot_rows_total = %v, want %d (one snapshot)", n, rows)
	}
}

// TestWatchConnectionTerminated ends the relay's ordinary connections (the
// publication watch's, the slot watch's) with pg_terminate_backend, as a
// DBA or an idle-connection reaper does: the relay reconnects them without
// taking it for a server shutting down, keeps its stream, and confirms
// what is written after.
func TestWatchConnectionTerminated(t *testing.T) {
	e := newEnv(t)
	logs := e.observeLogs()
	rr, reg := e.startRelayGathered(e.config())
	c := e.consume()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('o', 'k', 'T', '{}')`)
	c.waitIDs(1, 30*time.Second)
	conn := e.conn()
	walsender := e.slotInfo().ActivePID
	var n int
	if err := conn.QueryRow(e.ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = $1 AND backend_type = 'client backend' AND application_name LIKE 'walrelay%' AND pid <> pg_backend_pid()`, e.name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("no connection of the relay to terminate")
	}
	for i := range 5 {
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('o', 'k', 'T', '{}', $1)`, i)
	}
	target := e.currentLSN(conn)
	c.waitIDs(6, 30*time.Second)
	e.waitFor("the rows confirmed", 30*time.Second, func() (bool, error) { return e.slotInfo().ConfirmedLSN >= target, nil })
	if got := e.slotInfo().ActivePID; walsender == nil || got == nil || *got != *walsender {
		t.Errorf("the walsender changed (%v, now %v): the stream was ended", walsender, got)
	}
	if n := sumValues(gathered(reg, "walrelay_stream_restarts_total")); n != 0 || !rr.relay.Streaming() {
		t.Errorf("%v restarts, streaming %v: the relay took terminated connections for a shutdown", n, rr.relay.Streaming())
	}
	if l := logs.FilterMessageSnippet("shutting down").All(); len(l) != 0 {
		t.Errorf("logged a shutdown: %v", l)
	}
}
