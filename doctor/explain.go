package doctor

// explain.go: why a slot holds WAL, and why PostgreSQL invalidated one.
//
// A logical slot keeps two things: WAL from its restart_lsn on, and the
// catalog rows of transactions from its catalog_xmin on. Both move only
// when the client confirms a position and PostgreSQL then logs a
// running-transactions record (every 15 s) past it, and neither can pass
// a transaction that is still open with an xid anywhere in the cluster
// (prepared ones included): decoding must be able to go back to its first
// change. So what holds a slot is, in order of blame, the relay itself
// (stopped, not streaming, waiting for Kafka, behind), the cluster's
// oldest open and prepared transactions, and a quiet outbox the relay has
// nothing to confirm for. Other slots and standbys holding an old xmin do
// not hold this slot, but they hold the cluster's WAL and vacuum, which is
// what an operator asking "why is WAL growing" also needs to see.
//
// Everything here is read from PostgreSQL's views, so that `walrelay
// status --explain` works from anywhere the database answers. The relay
// adds what only it knows by naming its connections (RelayAppName):
// whether it streams, waits for Kafka or cannot reach it.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// Relay states, as the relay names its slot watch connection (see
// RelayAppName) and status reads them back.
const (
	// RelayStreaming: a stream is open and Kafka acknowledges.
	RelayStreaming = "streaming"
	// RelayWaitingForKafka: events are in flight and Kafka acknowledged
	// none of them since the relay last looked (a slot poll ago).
	RelayWaitingForKafka = "waiting for kafka"
	// RelayBackpressure: the in-flight limit is reached; the relay reads
	// nothing more until Kafka acknowledges.
	RelayBackpressure = "backpressure"
	// RelayStandby: another client streams from the slot; the relay waits
	// to take over.
	RelayStandby = "standby"
	// RelayConnectingKafka: no stream, because the relay has no Kafka
	// producer: it cannot reach the brokers, or they refused it.
	RelayConnectingKafka = "connecting to kafka"
	// RelayRestarting: no stream; the relay retries after a failure.
	RelayRestarting = "restarting"
	// RelayStarting: the relay has not streamed yet.
	RelayStarting = "starting"
	// RelayCreatingSlot names the replication connection creating the
	// slot (or the initial snapshot's temporary slot): status reads what
	// the creation waits for from it (creation.go).
	RelayCreatingSlot = "creating slot"
	// relayHeartbeat names the relay's heartbeat connection.
	relayHeartbeat = "heartbeat"
)

// maxAppName is the longest application_name PostgreSQL keeps
// (NAMEDATALEN - 1 bytes); a longer one is cut.
const maxAppName = 63

// RelayAppName is the application_name the relay gives its connections:
// "walrelay <slot>: <state>" for the slot watch, "walrelay <slot>:
// heartbeat" for the heartbeat. pg_stat_activity shows it to every role.
func RelayAppName(slot, state string) string { return "walrelay " + slot + ": " + state }

// HeartbeatAppName is the application_name of the relay's heartbeat
// connection.
func HeartbeatAppName(slot string) string { return RelayAppName(slot, relayHeartbeat) }

// Settings are the server settings that decide when a slot is
// invalidated and what holds it.
type Settings struct {
	// MaxSlotWALKeepSize is max_slot_wal_keep_size as PostgreSQL shows it
	// ("1GB", "-1"); MaxSlotWALKeepBytes in bytes, negative when
	// unlimited.
	MaxSlotWALKeepSize  string
	MaxSlotWALKeepBytes int64
	// IdleSlotTimeout is idle_replication_slot_timeout ("1d", "0"; empty
	// before PostgreSQL 18); IdleSlotTimeoutDur is 0 when it is off.
	IdleSlotTimeout    string
	IdleSlotTimeoutDur time.Duration
	WALLevel           string
	HotStandbyFeedback string
	InRecovery         bool
	// IdleInTransactionTimeout is idle_in_transaction_session_timeout.
	IdleInTransactionTimeout string
}

// readSettings reads the settings of the server conn is connected to.
func readSettings(ctx context.Context, conn *pgx.Conn) (Settings, error) {
	var s Settings
	var idleSeconds *int64
	err := conn.QueryRow(ctx, `
		SELECT current_setting('max_slot_wal_keep_size'),
		       (SELECT setting::bigint * CASE unit WHEN 'MB' THEN 1048576 WHEN 'kB' THEN 1024 WHEN 'GB' THEN 1073741824 ELSE 1 END
		          FROM pg_settings WHERE name = 'max_slot_wal_keep_size'),
		       coalesce(current_setting('idle_replication_slot_timeout', true), ''),
		       (SELECT setting::bigint * CASE unit WHEN 'min' THEN 60 WHEN 'h' THEN 3600 WHEN 'd' THEN 86400 ELSE 1 END
		          FROM pg_settings WHERE name = 'idle_replication_slot_timeout'),
		       current_setting('wal_level'), current_setting('hot_standby_feedback'), pg_is_in_recovery(),
		       current_setting('idle_in_transaction_session_timeout')`).Scan(
		&s.MaxSlotWALKeepSize, &s.MaxSlotWALKeepBytes, &s.IdleSlotTimeout, &idleSeconds,
		&s.WALLevel, &s.HotStandbyFeedback, &s.InRecovery, &s.IdleInTransactionTimeout)
	if err != nil {
		return s, fmt.Errorf("read the slot settings: %w", err)
	}
	if idleSeconds != nil && *idleSeconds > 0 {
		s.IdleSlotTimeoutDur = time.Duration(*idleSeconds) * time.Second
	}
	return s, nil
}

// sender is the walsender streaming a slot, as pg_stat_replication
// shows it.
type sender struct {
	PID        int32
	ClientAddr string
	State      string
	// SentLSN is how far the walsender decoded and sent; FlushLSN what the
	// client confirmed.
	SentLSN, FlushLSN decoder.LSN
}

// relayConn is a connection a relay of the slot named (RelayAppName).
type relayConn struct {
	PID        int32
	ClientAddr string
	// State is what the relay said it does; empty when its name was cut.
	State string
}

// Xact is an open transaction with an xid.
type Xact struct {
	PID int32
	Xid int64
	// XidAge is how many transactions ago it began writing.
	XidAge int64
	// Visible is false for a session of another role, whose database,
	// state, start and query PostgreSQL hides without pg_read_all_stats.
	Visible                 bool
	Database, User, State   string
	Query, ApplicationName  string
	Age                     time.Duration // now - xact_start
	BackendType, ClientAddr string
}

// PreparedXact is a prepared transaction (pg_prepared_xacts).
type PreparedXact struct {
	GID, Owner, Database string
	Xid, XidAge          int64
	Age                  time.Duration
}

// OtherSlot is another replication slot of the cluster.
type OtherSlot struct {
	Name, Type, Database, WALStatus string
	Active                          bool
	ActivePID                       *int32
	RestartLSN                      decoder.LSN
	RetainedWALBytes                int64
	// Xmin is the oldest transaction whose rows the slot keeps from
	// vacuum (a standby's hot_standby_feedback); CatalogXmin the same
	// for catalog rows (logical slots). Ages in transactions.
	Xmin, XminAge, CatalogXmin, CatalogXminAge *int64
	InactiveSince                              *time.Time
	// Standby is the application_name of the walsender streaming a
	// physical slot.
	Standby string
}

// Standby is a physical standby without a slot whose hot_standby_feedback
// holds an xmin (pg_stat_replication.backend_xmin).
type Standby struct {
	PID                     int32
	ApplicationName, Client string
	Xmin, XminAge           int64
}

// Facts are what PostgreSQL shows about a slot and what holds it.
type Facts struct {
	Info     slot.Info
	Settings Settings
	// walsender is nil when no client streams from the slot.
	walsender *sender
	// relays are the connections relays of this slot named; heartbeat
	// tells whether one of them is a relay's heartbeat.
	relays    []relayConn
	heartbeat bool
	// Xacts are the cluster's oldest open transactions with an xid,
	// oldest first.
	Xacts    []Xact
	Prepared []PreparedXact
	Slots    []OtherSlot
	Standbys []Standby
}

// maxXacts bounds how many open transactions ReadFacts reports.
const maxXacts = 5

// ReadFacts reads what holds the slot of info, on conn.
func ReadFacts(ctx context.Context, conn *pgx.Conn, info slot.Info) (Facts, error) {
	f := Facts{Info: info}
	var err error
	if f.Settings, err = readSettings(ctx, conn); err != nil {
		return f, err
	}
	if info.ActivePID != nil {
		var w sender
		var sent, flush *string
		// pg_stat_replication shows a walsender's columns but its pid only
		// to superusers and pg_read_all_stats, not even to the walsender's
		// own role (the relay's, which status runs as with least
		// privilege): a NULL state is such a row, and the explanation goes
		// on without the walsender's details.
		err := conn.QueryRow(ctx, `SELECT pid, coalesce(host(client_addr), 'local'), state, sent_lsn::text, flush_lsn::text
			FROM pg_stat_replication WHERE pid = $1 AND state IS NOT NULL`, *info.ActivePID).Scan(&w.PID, &w.ClientAddr, &w.State, &sent, &flush)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return f, fmt.Errorf("read pg_stat_replication: %w", err)
		}
		if err == nil {
			for _, p := range []struct {
				s   *string
				lsn *decoder.LSN
			}{{sent, &w.SentLSN}, {flush, &w.FlushLSN}} {
				if p.s != nil {
					if *p.lsn, err = slot.ParseLSN(*p.s); err != nil {
						return f, err
					}
				}
			}
			f.walsender = &w
		}
	}
	if err := f.readRelays(ctx, conn); err != nil {
		return f, err
	}
	if err := f.readXacts(ctx, conn); err != nil {
		return f, err
	}
	if err := f.readPrepared(ctx, conn); err != nil {
		return f, err
	}
	if err := f.readSlots(ctx, conn); err != nil {
		return f, err
	}
	return f, f.readStandbys(ctx, conn)
}

func (f *Facts) readRelays(ctx context.Context, conn *pgx.Conn) error {
	prefix := RelayAppName(f.Info.Name, "")
	if len(prefix) > maxAppName {
		prefix = prefix[:maxAppName]
	}
	rows, err := conn.Query(ctx, `SELECT pid, coalesce(host(client_addr), 'local'), application_name FROM pg_stat_activity
		WHERE left(application_name, $1) = $2 AND pid <> pg_backend_pid() ORDER BY backend_start`, len(prefix), prefix)
	if err != nil {
		return fmt.Errorf("read pg_stat_activity: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var c relayConn
		var name string
		if err := rows.Scan(&c.PID, &c.ClientAddr, &name); err != nil {
			return err
		}
		c.State = strings.TrimPrefix(name, prefix)
		if len(name) >= maxAppName {
			c.State = uncut(c.State)
		}
		if c.State == relayHeartbeat {
			f.heartbeat = true
			continue
		}
		if c.State == RelayCreatingSlot {
			// The snapshot's replication connection, idle until the
			// slot is copied from its temporary one: not the relay's
			// state (a creation under way is ReadCreation's).
			continue
		}
		f.relays = append(f.relays, c)
	}
	return rows.Err()
}

// relayStates are the words a relay names its connections with.
var relayStates = []string{RelayStreaming, RelayWaitingForKafka, RelayBackpressure, RelayStandby, RelayConnectingKafka,
	RelayRestarting, RelayStarting, relayHeartbeat, RelayCreatingSlot}

// uncut is the state a name PostgreSQL cut to maxAppName began: the one
// state it is a prefix of, else "" (unknown).
func uncut(state string) string {
	found := ""
	for _, s := range relayStates {
		if state != "" && strings.HasPrefix(s, state) {
			if found != "" {
				return ""
			}
			found = s
		}
	}
	return found
}

// AppNameAsShown is name as pg_stat_activity shows it: cut to the 63
// bytes PostgreSQL keeps.
func AppNameAsShown(name string) string {
	if len(name) > maxAppName {
		return name[:maxAppName]
	}
	return name
}

// readXacts finds open transactions by the lock each holds on its own
// xid: pg_locks shows them to every role, pg_stat_activity only to the
// same role or pg_read_all_stats. Prepared transactions hold theirs
// without a backend (pid NULL); they are read from pg_prepared_xacts.
func (f *Facts) readXacts(ctx context.Context, conn *pgx.Conn) error {
	var err error
	f.Xacts, err = queryXacts(ctx, conn, 0, maxXacts)
	return err
}

// queryXacts reads the cluster's oldest open transactions with an xid,
// oldest first, at most limit, leaving out the backend of pid except (0:
// none) and conn's own.
func queryXacts(ctx context.Context, conn *pgx.Conn, except int32, limit int) ([]Xact, error) {
	rows, err := conn.Query(ctx, `
		SELECT l.pid, l.xid::text::bigint, age(l.xid), a.datname IS NOT NULL AND a.state IS NOT NULL,
		       coalesce(a.datname, ''), coalesce(a.usename, ''), coalesce(a.state, ''), coalesce(a.query, ''), coalesce(a.application_name, ''),
		       coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8, coalesce(a.backend_type, ''), coalesce(host(a.client_addr), 'local')
		FROM (SELECT pid, transactionid AS xid, row_number() OVER (PARTITION BY pid ORDER BY age(transactionid) DESC) AS n
		        FROM pg_locks WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock' AND granted AND pid IS NOT NULL) l
		LEFT JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.n = 1 AND l.pid <> pg_backend_pid() AND l.pid <> $2
		ORDER BY age(l.xid) DESC LIMIT $1`, limit, except)
	if err != nil {
		return nil, fmt.Errorf("read the open transactions (pg_locks, pg_stat_activity): %w", err)
	}
	defer rows.Close()
	var xacts []Xact
	for rows.Next() {
		var x Xact
		var age float64
		if err := rows.Scan(&x.PID, &x.Xid, &x.XidAge, &x.Visible, &x.Database, &x.User, &x.State, &x.Query, &x.ApplicationName,
			&age, &x.BackendType, &x.ClientAddr); err != nil {
			return nil, err
		}
		x.Age = time.Duration(age * float64(time.Second))
		xacts = append(xacts, x)
	}
	return xacts, rows.Err()
}

func (f *Facts) readPrepared(ctx context.Context, conn *pgx.Conn) error {
	var err error
	f.Prepared, err = queryPrepared(ctx, conn)
	return err
}

// queryPrepared reads the prepared transactions, oldest first.
func queryPrepared(ctx context.Context, conn *pgx.Conn) ([]PreparedXact, error) {
	rows, err := conn.Query(ctx, `SELECT gid, owner::text, database::text, transaction::text::bigint, age(transaction),
			extract(epoch FROM now() - prepared)::float8
		FROM pg_prepared_xacts ORDER BY age(transaction) DESC`)
	if err != nil {
		return nil, fmt.Errorf("read pg_prepared_xacts: %w", err)
	}
	defer rows.Close()
	var prepared []PreparedXact
	for rows.Next() {
		var p PreparedXact
		var age float64
		if err := rows.Scan(&p.GID, &p.Owner, &p.Database, &p.Xid, &p.XidAge, &age); err != nil {
			return nil, err
		}
		p.Age = time.Duration(age * float64(time.Second))
		prepared = append(prepared, p)
	}
	return prepared, rows.Err()
}

func (f *Facts) readSlots(ctx context.Context, conn *pgx.Conn) error {
	rows, err := conn.Query(ctx, `
		SELECT s.slot_name, s.slot_type, coalesce(s.database, ''), coalesce(s.wal_status, ''), s.active, s.active_pid,
		       coalesce(s.restart_lsn::text, '0/0'),
		       coalesce((CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END - s.restart_lsn)::bigint, 0),
		       s.xmin::text::bigint, age(s.xmin), s.catalog_xmin::text::bigint, age(s.catalog_xmin),
		       (to_jsonb(s)->>'inactive_since')::timestamptz, coalesce(r.application_name, '')
		FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
		WHERE s.slot_name <> $1 ORDER BY s.restart_lsn NULLS LAST`, f.Info.Name)
	if err != nil {
		return fmt.Errorf("read pg_replication_slots: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var o OtherSlot
		var restart string
		if err := rows.Scan(&o.Name, &o.Type, &o.Database, &o.WALStatus, &o.Active, &o.ActivePID, &restart, &o.RetainedWALBytes,
			&o.Xmin, &o.XminAge, &o.CatalogXmin, &o.CatalogXminAge, &o.InactiveSince, &o.Standby); err != nil {
			return err
		}
		if o.RestartLSN, err = slot.ParseLSN(restart); err != nil {
			return err
		}
		f.Slots = append(f.Slots, o)
	}
	return rows.Err()
}

func (f *Facts) readStandbys(ctx context.Context, conn *pgx.Conn) error {
	rows, err := conn.Query(ctx, `
		SELECT r.pid, r.application_name, coalesce(host(r.client_addr), 'local'), r.backend_xmin::text::bigint, age(r.backend_xmin)
		FROM pg_stat_replication r
		WHERE r.backend_xmin IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid)
		ORDER BY age(r.backend_xmin) DESC`)
	if err != nil {
		return fmt.Errorf("read the standbys (pg_stat_replication): %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var s Standby
		if err := rows.Scan(&s.PID, &s.ApplicationName, &s.Client, &s.Xmin, &s.XminAge); err != nil {
			return err
		}
		f.Standbys = append(f.Standbys, s)
	}
	return rows.Err()
}

// Cause is one thing holding a slot (or the cluster's WAL), with the fix.
type Cause struct {
	// Kind is invalidated, relay_stopped, relay_not_streaming,
	// relay_waiting_for_kafka, relay_behind, open_transaction,
	// prepared_transaction, replication_slot, standby, quiet_outbox,
	// standby_replay_paused, standby_not_streaming, standby_replay_behind
	// (the slot on a hot standby: StandbyReplay.Cause), primary_unreachable
	// (its primary: PrimaryUnreachableCause) or standby_slot
	// (Failover.Causes).
	Kind string `json:"cause"`
	// Holds is what it holds back.
	Holds string `json:"holds"`
	Text  string `json:"text"`
	Fix   string `json:"fix"`
}

// explainOptions are what explain knows beyond the database's views.
type explainOptions struct {
	// Record is walrelay's record of the slot, if any: its last move is
	// the nearest to inactive_since a server before 17 has.
	Record *Recorded
}

// Recorded is what walrelay's record of a slot (source.Record, in the
// record table) says, as far as the doctor needs it.
type Recorded struct {
	// Table is the record table's qualified, quoted name.
	Table string
	// ConfirmedLSN is the last position walrelay confirmed, as recorded;
	// UpdatedAt when the record last moved.
	ConfirmedLSN decoder.LSN
	UpdatedAt    time.Time
	// Stopped is why a running relay stopped, and StoppedAt where, when it
	// refused to go on; empty when it did not.
	Stopped   string
	StoppedAt decoder.LSN
	// NeverStreamed: no relay started a stream from the slot since
	// walrelay set it up (false when that is not known).
	NeverStreamed bool
}

// Thresholds of explain.
const (
	// behindBytes is confirmed lag past which a streaming relay counts as
	// behind: a WAL segment. Under it the lag is what status updates and
	// acknowledgements in flight leave.
	behindBytes = 16 << 20
	// heldAge is how long an open or prepared transaction must be open
	// to count as holding the slot when its xid is not the slot's
	// catalog_xmin: PostgreSQL's running-transactions interval, so that
	// the short transactions of normal traffic are not blamed.
	heldAge = 15 * time.Second
)

const holdsSlot = "the slot's restart_lsn and catalog_xmin"

// explain names what holds the slot, most to blame first: the relay,
// the oldest open transactions, prepared transactions, a quiet outbox
// without heartbeats; then what holds the cluster's WAL or xmin without
// holding this slot (other slots, standbys). An invalidated slot has one
// cause: its invalidation.
func (f Facts) explain(opts explainOptions) []Cause {
	info := f.Info
	if info.Invalidated() {
		g := InvalidatedError(info, f.Settings, 0)
		return []Cause{{Kind: "invalidated", Holds: "nothing: PostgreSQL keeps no WAL for it",
			Text: g.What + fmt.Sprintf("; events committed after %s may be missing from Kafka", g.Since),
			Fix:  "accept the gap (source.SetupConfig.AcceptGap, with the same database, slot, publication and tables: it drops the invalidated slot, creates a new one and records the gap), then publish the rows still in the outbox tables once (relay.PublishSnapshot); " + f.Settings.prevent(info)}}
	}
	var causes []Cause
	causes = append(causes, f.relayCauses(opts)...)
	for i, x := range f.Xacts {
		if !f.pins(x.XidAge) {
			continue
		}
		// A short transaction of normal traffic is not blamed; one whose
		// age PostgreSQL hides (another role's) only when it is the
		// oldest and the slot's restart_lsn lags far behind what the
		// relay confirmed.
		if x.Visible && x.Age < heldAge || !x.Visible && (i > 0 || int64(info.ConfirmedLSN-info.RestartLSN) < behindBytes) {
			continue
		}
		causes = append(causes, f.xactCause(x))
	}
	for _, p := range f.Prepared {
		if !f.pins(p.XidAge) || p.Age < heldAge {
			continue
		}
		causes = append(causes, Cause{Kind: "prepared_transaction", Holds: holdsSlot,
			Text: fmt.Sprintf("prepared transaction %s (xid %d) in database %q, prepared %s ago by %q: until it is committed or rolled back, across restarts, PostgreSQL keeps the WAL from its first change and the catalog rows of its time%s",
				quoteLiteral(p.GID), p.Xid, p.Database, DurationText(p.Age), p.Owner, f.pinText()),
			Fix: fmt.Sprintf("finish it as its transaction manager meant, in database %q: COMMIT PREPARED %s or ROLLBACK PREPARED %s", p.Database, quoteLiteral(p.GID), quoteLiteral(p.GID))})
	}
	if c, ok := f.quietOutbox(); ok {
		causes = append(causes, c)
	}
	causes = append(causes, f.clusterCauses()...)
	return causes
}

// prevent is the setting to change so that a slot is not invalidated.
func (s Settings) prevent(info slot.Info) string {
	return "so that the next slot lasts, " + invalidationOf(info, s).Prevent
}

// relay is the first relay connection's state, "" without one.
func (f Facts) relay() (relayConn, bool) {
	for _, r := range f.relays {
		if r.State != RelayStandby {
			return r, true
		}
	}
	if len(f.relays) > 0 {
		return f.relays[0], true
	}
	return relayConn{}, false
}

func (f Facts) relayCauses(opts explainOptions) []Cause {
	info := f.Info
	lag := fmt.Sprintf("it keeps %s of WAL from its confirmed_flush_lsn %s on", BytesText(info.LagBytes), info.ConfirmedLSN)
	r, connected := f.relay()
	if !info.Active {
		since := f.inactiveSince(opts)
		if !connected {
			return []Cause{{Kind: "relay_stopped", Holds: holdsSlot,
				Text: fmt.Sprintf("no relay streams from the slot%s, and no walrelay process of this slot is connected to the server: %s", since, lag),
				Fix:  "start relay.Relay.Run: it resumes from confirmed_flush_lsn (if it exited, its last log line says why; exit 2 needs you first)" + f.idleWarning()}}
		}
		what := map[string]string{
			RelayConnectingKafka: "it cannot reach Kafka, or Kafka refused it, so it does not read the slot",
			RelayRestarting:      "its last stream failed and it retries after a backoff",
			RelayStandby:         "it waits as a standby for the slot, which nobody holds now: it takes it at its next attempt",
			RelayStarting:        "it has not streamed yet (an initial snapshot, or retrying until relay.Config.StartupTimeout)",
		}[r.State]
		if what == "" {
			what = "it does not stream"
		}
		fix := "read its log: the reason and how it retries are there (walrelay_stream_restarts_total by cause)"
		if r.State == RelayConnectingKafka {
			fix = "make the seed brokers (kgo.SeedBrokers) reachable (DNS, network, TLS, SASL: its log names the error); it streams by itself once Kafka answers"
		}
		return []Cause{{Kind: "relay_not_streaming", Holds: holdsSlot,
			Text: fmt.Sprintf("no relay streams from the slot%s; walrelay is connected (pid %d, from %s) and says %q: %s; %s", since, r.PID, r.ClientAddr, r.State, what, lag),
			Fix:  fix + f.idleWarning()}}
	}
	w := f.walsender
	sender := fmt.Sprintf("walsender pid %d", *info.ActivePID)
	var sent decoder.LSN
	if w != nil {
		sent = w.SentLSN
		sender += fmt.Sprintf(", client %s", w.ClientAddr)
	}
	switch {
	case connected && (r.State == RelayWaitingForKafka || r.State == RelayBackpressure):
		what := "Kafka acknowledged none of the events in flight since the relay last looked"
		if r.State == RelayBackpressure {
			what = "the relay holds as many events as relay.Config.Router.MaxInflightEvents and relay.Config.Router.MaxInflightBytes allow and reads nothing more until Kafka acknowledges"
		}
		text := fmt.Sprintf("the relay streams (%s) but says %q: %s; %s", sender, r.State, what, lag)
		if sent > info.ConfirmedLSN {
			text += fmt.Sprintf("; the walsender sent up to %s, %s of it not yet confirmed", sent, BytesText(int64(sent-info.ConfirmedLSN)))
		}
		return []Cause{{Kind: "relay_waiting_for_kafka", Holds: holdsSlot, Text: text,
			Fix: "make Kafka accept writes again: the relay's log names the error (walrelay_produce_errors_total, walrelay_inflight_events); it confirms by itself once Kafka acknowledges"}}
	case info.LagBytes < behindBytes || info.LagBytes < int64(info.ConfirmedLSN-info.RestartLSN):
		return nil
	case w != nil && sent != 0 && int64(info.CurrentLSN-sent) >= behindBytes && info.CurrentLSN-sent >= sent-info.ConfirmedLSN:
		return []Cause{{Kind: "relay_behind", Holds: holdsSlot,
			Text: fmt.Sprintf("the relay streams (%s) but the walsender has decoded only up to %s, %s behind the server: it is decoding a large transaction, or the relay reads slowly; %s",
				sender, sent, BytesText(int64(info.CurrentLSN-sent)), lag),
			Fix: "wait for it if a large transaction is being decoded; otherwise see the relay's throughput (walrelay_received_bytes_total) against the WAL rate"}}
	case !f.heartbeat:
		return nil // quietOutbox names it
	default:
		return []Cause{{Kind: "relay_behind", Holds: holdsSlot,
			Text: fmt.Sprintf("the relay streams (%s) and sends heartbeats but has confirmed only %s, %s behind the server", sender, info.ConfirmedLSN, BytesText(info.LagBytes)),
			Fix:  "see the relay's log and walrelay_inflight_events: it confirms what Kafka acknowledged"}}
	}
}

// quietOutbox names a relay that streams, is not behind the walsender and
// has nothing to confirm: the outbox is quiet and no heartbeat gives the
// relay a position to confirm.
func (f Facts) quietOutbox() (Cause, bool) {
	info := f.Info
	if !info.Active || f.heartbeat || info.LagBytes < behindBytes || info.LagBytes < int64(info.ConfirmedLSN-info.RestartLSN) {
		return Cause{}, false
	}
	if r, ok := f.relay(); ok && r.State != RelayStreaming {
		return Cause{}, false
	}
	sent := info.CurrentLSN
	if f.walsender != nil && f.walsender.SentLSN != 0 {
		sent = f.walsender.SentLSN
	}
	if int64(info.CurrentLSN-sent) >= behindBytes && info.CurrentLSN-sent >= sent-info.ConfirmedLSN {
		return Cause{}, false // relayCauses: the walsender is behind
	}
	return Cause{Kind: "quiet_outbox", Holds: holdsSlot,
		Text: fmt.Sprintf("the outbox is quiet and the relay sends no heartbeats (no connection named %q): the walsender passed %s of WAL with nothing for the relay to publish, and its confirmed_flush_lsn %s stays where the last event was, %s behind the server",
			HeartbeatAppName(info.Name), BytesText(int64(sent-info.ConfirmedLSN)), info.ConfirmedLSN, BytesText(info.LagBytes)),
		Fix: "run the relay with heartbeats (relay.Config.HeartbeatInterval above 0, as by default, and a relay.Config.HeartbeatQuery other than '-') and with idle advance (relay.Config.NoIdleAdvance=false, the default): both give it positions to confirm while the outbox is quiet"}, true
}

// inactiveSince says since when no client streamed from the slot:
// inactive_since on PostgreSQL 17+, before that the nearest walrelay has,
// its record's last move.
func (f Facts) inactiveSince(opts explainOptions) string {
	info := f.Info
	if info.InactiveSince != nil {
		return fmt.Sprintf(" (inactive_since %s, %s ago)", info.InactiveSince.UTC().Format(time.RFC3339), DurationText(info.Now.Sub(*info.InactiveSince)))
	}
	if opts.Record != nil && !opts.Record.UpdatedAt.IsZero() {
		return fmt.Sprintf(" (PostgreSQL before 17 does not say since when; walrelay last moved its record of the slot at %s, %s ago)",
			opts.Record.UpdatedAt.UTC().Format(time.RFC3339), DurationText(info.Now.Sub(opts.Record.UpdatedAt)))
	}
	return ""
}

// idleWarning says when idle_replication_slot_timeout invalidates an
// inactive slot.
func (f Facts) idleWarning() string {
	d := f.Settings.IdleSlotTimeoutDur
	if d <= 0 {
		return ""
	}
	s := fmt.Sprintf("; idle_replication_slot_timeout = %s invalidates the slot once it has been inactive that long", f.Settings.IdleSlotTimeout)
	if since := f.Info.InactiveSince; since != nil {
		s += fmt.Sprintf(" (at the first checkpoint after %s)", since.Add(d).UTC().Format(time.RFC3339))
	}
	return s
}

// pins reports whether a transaction open with an xid xidAge
// transactions old holds the slot: the slot's catalog_xmin is not newer
// than it, so it cannot pass it until it ends.
func (f Facts) pins(xidAge int64) bool {
	return f.Info.CatalogXminAge != nil && *f.Info.CatalogXminAge >= xidAge
}

// pinText says where the slot's catalog_xmin stands.
func (f Facts) pinText() string {
	if f.Info.CatalogXmin == nil {
		return ""
	}
	return fmt.Sprintf(" (the slot's catalog_xmin %d stays at or before it)", *f.Info.CatalogXmin)
}

func (f Facts) xactCause(x Xact) Cause {
	pin := f.pinText()
	const what = "PostgreSQL keeps the WAL from its first change and the catalog rows of its time until it ends: the slot cannot move past it"
	if !x.Visible {
		return Cause{Kind: "open_transaction", Holds: holdsSlot,
			Text: fmt.Sprintf("open transaction of pid %d in database %q (user %q; xid %d, %d transactions ago; its age, state and query show only to its role or pg_read_all_stats), the oldest of the cluster, while restart_lsn lags %s behind what the relay confirmed: %s%s",
				x.PID, x.Database, x.User, x.Xid, x.XidAge, BytesText(int64(f.Info.ConfirmedLSN-f.Info.RestartLSN)), what, pin),
			Fix: fmt.Sprintf("have its session commit or roll back, or end it: SELECT pg_terminate_backend(%d)", x.PID)}
	}
	return Cause{Kind: "open_transaction", Holds: holdsSlot,
		Text: fmt.Sprintf("open transaction: %s, open %s, %s, xid %d: %q; %s%s", x.who(), DurationText(x.Age), x.State, x.Xid, firstLine(x.Query), what, pin),
		Fix: fmt.Sprintf("end it: COMMIT or ROLLBACK in its session, or SELECT pg_terminate_backend(%d); idle_in_transaction_session_timeout (now %s) ends abandoned ones by itself",
			x.PID, f.Settings.IdleInTransactionTimeout)}
}

// who names a visible transaction's session: pid, database, user,
// application, client and backend type.
func (x Xact) who() string {
	who := fmt.Sprintf("pid %d in database %q (user %q", x.PID, x.Database, x.User)
	if x.ApplicationName != "" {
		who += fmt.Sprintf(", application %q", x.ApplicationName)
	}
	who += ", from " + x.ClientAddr + ")"
	if x.BackendType != "" && x.BackendType != "client backend" {
		who += " (" + x.BackendType + ")"
	}
	return who
}

// clusterCauses are other slots and standbys that keep more WAL or an
// older xmin than this slot: they do not hold this slot, but pg_wal keeps
// WAL for the oldest slot of the cluster and vacuum keeps rows for the
// oldest xmin.
func (f Facts) clusterCauses() []Cause {
	info := f.Info
	var ownAge int64 = -1
	if info.CatalogXminAge != nil {
		ownAge = *info.CatalogXminAge
	}
	const notThis = "it does not hold this slot, but PostgreSQL keeps the cluster's WAL for the oldest slot and rows from vacuum for the oldest xmin"
	var causes []Cause
	for _, o := range f.Slots {
		if o.WALStatus == "lost" {
			continue
		}
		moreWAL := o.RetainedWALBytes > info.RetainedWALBytes && o.RestartLSN != 0
		var xmins []string
		if o.Xmin != nil && *o.XminAge > ownAge {
			xmins = append(xmins, fmt.Sprintf("xmin %d (%d transactions ago)", *o.Xmin, *o.XminAge))
		}
		if o.CatalogXmin != nil && *o.CatalogXminAge > ownAge {
			xmins = append(xmins, fmt.Sprintf("catalog_xmin %d (%d transactions ago)", *o.CatalogXmin, *o.CatalogXminAge))
		}
		if !moreWAL && len(xmins) == 0 {
			continue
		}
		var held []string
		if moreWAL {
			held = append(held, fmt.Sprintf("keeps %s of WAL from %s", BytesText(o.RetainedWALBytes), o.RestartLSN))
		}
		if len(xmins) > 0 {
			held = append(held, "holds "+strings.Join(xmins, " and "))
		}
		desc := o.Type
		if o.Database != "" {
			desc += fmt.Sprintf(", database %q", o.Database)
		}
		fix := fmt.Sprintf("if nothing uses it any more, drop it: SELECT pg_drop_replication_slot('%s')", o.Name)
		switch {
		case o.Active && o.Type == "physical":
			desc += fmt.Sprintf(", streamed by pid %d", *o.ActivePID)
			if o.Standby != "" {
				desc += fmt.Sprintf(" (standby %q)", o.Standby)
			}
			fix = "its standby holds it: long queries there hold xmin with hot_standby_feedback = on (end them, or bound them with max_standby_streaming_delay); a standby far behind holds WAL until it catches up"
		case o.Active:
			desc += fmt.Sprintf(", streamed by pid %d", *o.ActivePID)
			fix = "its consumer is behind: see to it"
		case o.InactiveSince != nil:
			desc += fmt.Sprintf(", inactive since %s", o.InactiveSince.UTC().Format(time.RFC3339))
		default:
			desc += ", inactive"
		}
		causes = append(causes, Cause{Kind: "replication_slot", Holds: "the cluster's WAL and xmin, not this slot",
			Text: fmt.Sprintf("replication slot %q (%s) %s: %s", o.Name, desc, strings.Join(held, " and "), notThis),
			Fix:  fix})
	}
	for _, s := range f.Standbys {
		if s.XminAge <= ownAge {
			continue
		}
		causes = append(causes, Cause{Kind: "standby", Holds: "the cluster's xmin, not this slot",
			Text: fmt.Sprintf("standby %q (walsender pid %d, from %s) holds xmin %d (%d transactions ago) through hot_standby_feedback, without a slot: it does not hold this slot, but vacuum keeps the cluster's rows from that xmin on (the outbox's deleted rows too)",
				s.ApplicationName, s.PID, s.Client, s.Xmin, s.XminAge),
			Fix: "long queries on the standby hold it: end them, or bound them with max_standby_streaming_delay"})
	}
	return causes
}

// firstLine is the first line of a query, cut to a readable length.
func firstLine(q string) string {
	q = strings.TrimSpace(q)
	if i := strings.IndexAny(q, "\r\n"); i >= 0 {
		q = strings.TrimSpace(q[:i]) + " …"
	}
	if r := []rune(q); len(r) > 120 {
		q = string(r[:120]) + " …"
	}
	return q
}

// round rounds a duration for people: seconds under an hour, minutes
// above.
func round(d time.Duration) time.Duration {
	if d > time.Hour {
		return d.Round(time.Minute)
	}
	return d.Round(time.Second)
}

// DurationText prints a duration for people: rounded to the second
// (minute above an hour, millisecond below a second), without Go's
// trailing zero units ("24h", not "24h0m0s").
func DurationText(d time.Duration) string {
	if d > 0 && d < time.Second {
		return d.Round(time.Millisecond).String()
	}
	t := round(d).String()
	if strings.HasSuffix(t, "m0s") {
		t = strings.TrimSuffix(t, "0s")
	}
	if strings.HasSuffix(t, "h0m") {
		t = strings.TrimSuffix(t, "0m")
	}
	return t
}

// BytesText prints a byte count for people, with the exact figure.
func BytesText(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	f, i := float64(n), 0
	for f >= 1024 && i < len(units)-1 {
		f /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s (%d bytes)", f, units[i], n)
}

// quoteLiteral quotes a PostgreSQL string literal.
func quoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }
