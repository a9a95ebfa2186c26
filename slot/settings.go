package slot

// settings.go: the session settings every connection walrelay opens sets
// for itself, over whatever a role (ALTER ROLE … SET), a database (ALTER
// DATABASE … SET) or the server (ALTER SYSTEM, postgresql.conf) imposes.
//
// Those are set for an application's sessions, and some end walrelay's
// work part-way: an idle_in_transaction_session_timeout ends the
// replication connection that holds the initial snapshot's exported
// snapshot (it stays idle in its transaction for the snapshot's length), a
// transaction_timeout or statement_timeout ends a snapshot of a large
// table, a default_transaction_read_only refuses the record's writes, the
// heartbeat and the publication, a DateStyle changes how a timestamp
// renders in a header. Every connection therefore starts with one
// statement that sets them to what walrelay's work needs (a client's
// setting wins over all of those sources), each only where the server
// knows it (transaction_timeout came with PostgreSQL 17).
//
// TimeZone is left alone: it decides the offset a timestamptz renders
// with, and consumers may rely on the server's. A relay connected through
// a connection pooler in transaction mode loses these settings; walrelay
// refuses such a pooler for its replication connection anyway.

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// clientEncoding is the client_encoding of every connection walrelay
// opens, the replication connection included: PostgreSQL then converts
// text from the database's encoding (LATIN1, WIN1252, EUC_JP, …) to
// UTF-8, in the walsender as in the snapshot's queries, so records carry
// UTF-8 whatever the database stores. pgx relies on UTF-8 as well.
const clientEncoding = "UTF8"

// sessionSettings are the settings, and why each.
var sessionSettings = []struct{ name, value string }{
	// A snapshot's FETCH on a large table, CREATE_REPLICATION_SLOT waiting
	// for running transactions.
	{"statement_timeout", "0"},
	// The advisory lock that serialises creating the slot.
	{"lock_timeout", "0"},
	// The exported snapshot's connection, idle in its transaction while
	// the snapshot is read; a snapshot's transaction waiting for Kafka.
	{"idle_in_transaction_session_timeout", "0"},
	// The watch connections, idle between polls.
	{"idle_session_timeout", "0"},
	// A snapshot's transaction lasts as long as its tables take to read.
	{"transaction_timeout", "0"},
	// The record, the publication, the heartbeat's WAL write.
	{"default_transaction_read_only", "off"},
	// The publication watch reads one statement's snapshot; the record's
	// writes must not fail on serialization.
	{"default_transaction_isolation", "read committed"},
	// How pgoutput and a snapshot render dates, intervals and floats in
	// text: a record's headers must not change with a role's taste.
	{"DateStyle", "ISO, MDY"},
	{"IntervalStyle", "postgres"},
	{"extra_float_digits", "1"},
}

// settingsSQL sets sessionSettings on a connection, plain or replication
// (which accepts only the simple query protocol, hence the literals).
var settingsSQL = func() string {
	rows := make([]string, len(sessionSettings))
	for i, s := range sessionSettings {
		rows[i] = fmt.Sprintf("(%s, %s)", quoteLiteral(s.name), quoteLiteral(s.value))
	}
	return "SELECT set_config(s.name, s.value, false) FROM (VALUES " + strings.Join(rows, ", ") +
		") AS s(name, value) WHERE current_setting(s.name, true) IS NOT NULL"
}()

// applySettings is the connections' AfterConnect.
func applySettings(ctx context.Context, conn *pgconn.PgConn) error {
	if _, err := conn.Exec(ctx, settingsSQL).ReadAll(); err != nil {
		return fmt.Errorf("set walrelay's session settings: %w", err)
	}
	return nil
}
