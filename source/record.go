package source

// record.go: walrelay's record, in the source database, of what it streams
// from.
//
// From the database alone, a slot, a publication or an outbox table's
// membership that disappeared under the relay looks exactly like a first
// start: the slot is missing, the publication is missing, the table is not
// in it. Creating them then skips every event committed in between, for
// good. So the first time walrelay streams from a slot it writes down what
// it streams from (one row per slot in <schema>.slots: the publication and
// the outbox tables by OID, the tables' publication memberships) and from
// then on it refuses to replace any of it until the operator accepts the
// gap (walrelay setup --accept-gap).
//
// The record lives in the database itself, not in Kafka or on the relay's
// disk: physical replication copies it to every standby with the rest, so
// after a failover the new primary's copy describes the slot that did not
// come with it; a database restored from a backup brings the record of its
// own time; and a record sits beside the objects it describes, so that no
// relay of another database can mistake it for its own.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/slot"
)

// DefaultRecordSchema is the schema of walrelay's record table (slots).
const DefaultRecordSchema = "walrelay"

// Record is what walrelay streamed from a slot, as it last wrote it down.
type Record struct {
	Slot        string
	Publication string
	// PublicationOID identifies the publication: one dropped and created
	// again under the same name has another.
	PublicationOID uint32
	// PublicationXmin is the xmin of the publication's pg_publication row:
	// every ALTER PUBLICATION ... SET changes it.
	PublicationXmin string
	Tables          []RecordedTable
	// SystemID is the PostgreSQL system identifier of the cluster the
	// record was written on (IDENTIFY_SYSTEM).
	SystemID string
	// ConfirmedLSN is a position walrelay had confirmed when it last
	// wrote the record: events committed before it reached Kafka.
	ConfirmedLSN decoder.LSN
	// Stopped, when not empty, is why a running relay stopped on a change
	// it could not stream past; StoppedAt is the last position it had
	// confirmed then. walrelay refuses to start until the gap is accepted.
	Stopped   string
	StoppedAt decoder.LSN
	UpdatedAt time.Time
	// Accepted is the gap Prepare accepted (SetupConfig.AcceptGap), if
	// it did: events committed after Accepted.Since were not published.
	Accepted *slot.GapError
	// Others are the tables the publication listed, when the record was
	// written, that are not outbox tables (another subscriber's, in a
	// shared publication): their inserts are counted, not published. A
	// table added to the publication since is refused, not counted. They
	// are kept in the tables column, marked "other".
	Others []RecordedTable
	// SnapshotPending is the consistent point of the slot's initial
	// snapshot while it is being published (0 otherwise): a slot found
	// with it set was created by a start that died during its snapshot,
	// was never streamed from, and is created again with a new snapshot.
	SnapshotPending decoder.LSN
	// NeverStreamed: no relay has started a stream from the slot since
	// walrelay set it up (RecordStreamed writes the first). False when
	// not known: a record table of an older walrelay, without the
	// column, or whose rows predate it.
	NeverStreamed bool
}

// RecordedTable is one outbox table as the record knows it.
type RecordedTable struct {
	Table decoder.Table `json:"table"`
	// OID is the table's pg_class OID: a table dropped and created again
	// under the same name has another.
	OID uint32 `json:"oid"`
	// MemberOID is the OID of the table's pg_publication_rel row: removed
	// from the publication and added again, it has another. 0 when the
	// publication covers the table without one (FOR ALL TABLES, TABLES IN
	// SCHEMA).
	MemberOID uint32 `json:"member_oid"`
	// Other marks a table of Record.Others in the tables column.
	Other bool `json:"other,omitempty"`
}

// AcceptsOther reports whether the table of pg_class OID oid is one of
// the record's Others: listed in the publication when walrelay recorded
// it, so its inserts are counted, not refused.
func (r Record) AcceptsOther(oid uint32) bool {
	for _, o := range r.Others {
		if o.OID == oid {
			return true
		}
	}
	return false
}

// Recorded is what the record says that the doctor reads (its figures for
// status, and the words of the refusal of a slot gone); schema is the
// record table's.
func (r Record) Recorded(schema string) doctor.Recorded {
	return doctor.Recorded{Table: recordTable(schema), ConfirmedLSN: r.ConfirmedLSN, UpdatedAt: r.UpdatedAt, Stopped: r.Stopped, StoppedAt: r.StoppedAt,
		NeverStreamed: r.NeverStreamed}
}

// RecordTableName is the record table's name in its schema.
const RecordTableName = "slots"

// recordTable is the record table's qualified, quoted name.
func recordTable(schema string) string {
	return pgx.Identifier{schema, RecordTableName}.Sanitize()
}

// recordDDL creates the record table. The comment says what it is to
// whoever finds it.
func recordDDL(schema string) []string {
	s := pgx.Identifier{schema}.Sanitize()
	t := recordTable(schema)
	return []string{
		"CREATE SCHEMA IF NOT EXISTS " + s,
		`CREATE TABLE IF NOT EXISTS ` + t + ` (
			slot_name text PRIMARY KEY,
			publication text NOT NULL,
			publication_oid oid NOT NULL,
			publication_xmin text NOT NULL DEFAULT '',
			tables jsonb NOT NULL,
			system_identifier text NOT NULL,
			confirmed_lsn pg_lsn NOT NULL,
			stopped text,
			stopped_at_lsn pg_lsn,
			accepted_gaps jsonb NOT NULL DEFAULT '[]',
			initial_snapshot_lsn pg_lsn,
			streamed_at timestamptz,
			created_at timestamptz NOT NULL DEFAULT now(),
			updated_at timestamptz NOT NULL DEFAULT now()
		)`,
		"COMMENT ON TABLE " + t + " IS 'walrelay: what each replication slot streamed from; walrelay refuses to replace a slot, publication or outbox table recorded here until an operator accepts the gap'",
	}
}

// recordTableReady reports whether the record table exists, refusing (a
// *slot.SetupError naming the GRANT) one the role may not read and write.
func recordTableReady(ctx context.Context, conn *pgx.Conn, schema string) (bool, error) {
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", recordTable(schema)).Scan(&exists); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			return false, fmt.Errorf("look up walrelay's record table: %w", err)
		}
		exists = true // in a schema the role may not use: the privilege check below says so
	}
	if !exists {
		return false, nil
	}
	var role string
	var ok bool
	err := conn.QueryRow(ctx, `SELECT current_user, has_schema_privilege($2, 'USAGE') AND has_table_privilege($1, 'SELECT')
		AND has_table_privilege($1, 'INSERT') AND has_table_privilege($1, 'UPDATE') AND has_table_privilege($1, 'DELETE')`,
		recordTable(schema), schema).Scan(&role, &ok)
	if err != nil {
		return false, fmt.Errorf("read the privileges on walrelay's record table: %w", err)
	}
	if !ok {
		r := pgx.Identifier{role}.Sanitize()
		return false, setupErrorf("role %q may not read and write walrelay's record table %s, where walrelay writes down what it streams from: as its owner run GRANT USAGE ON SCHEMA %s TO %s; GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s",
			role, recordTable(schema), pgx.Identifier{schema}.Sanitize(), r, recordTable(schema), r)
	}
	return true, nil
}

// snapshotColumn marks an initial snapshot being published; a record table
// created by an older walrelay lacks it (readers use to_jsonb, which works
// either way).
const snapshotColumn = "initial_snapshot_lsn"

// streamedColumn is when a relay first started a stream from the slot
// (RecordStreamed), NULL while none has: a refusal of a slot that is gone
// says whether one ever did. Rows of a record table that predates the
// column get -infinity when it is added: whether a relay streamed from
// those slots is not known, so they count as streamed from, as they did.
const streamedColumn = "streamed_at"

// ensureRecordColumns adds to an existing record table the columns later
// versions use. A role that may not alter it gets the statement to have
// its owner run: refused for the column the initial snapshot needs, a
// warning for streamed_at, which only words a refusal.
func ensureRecordColumns(ctx context.Context, conn *pgx.Conn, schema string, log *zap.Logger) error {
	var haveSnapshot, haveStreamed bool
	if err := conn.QueryRow(ctx, `SELECT coalesce(bool_or(attname = $2), false), coalesce(bool_or(attname = $3), false)
		FROM pg_attribute WHERE attrelid = to_regclass($1) AND NOT attisdropped`,
		recordTable(schema), snapshotColumn, streamedColumn).Scan(&haveSnapshot, &haveStreamed); err != nil {
		return fmt.Errorf("read the columns of walrelay's record table: %w", err)
	}
	var pgErr *pgconn.PgError
	if !haveSnapshot {
		sql := "ALTER TABLE " + recordTable(schema) + " ADD COLUMN IF NOT EXISTS " + snapshotColumn + " pg_lsn"
		_, err := conn.Exec(ctx, sql)
		if errors.As(err, &pgErr) && pgErr.Code == "42501" {
			return setupErrorf("walrelay's record table %s lacks column %s, which this version writes while the initial snapshot is published, and this role may not add it (%s): as the table's owner run %s",
				recordTable(schema), snapshotColumn, pgErr.Message, sql)
		}
		if err != nil {
			return fmt.Errorf("add column %s to walrelay's record table: %w", snapshotColumn, err)
		}
	}
	if !haveStreamed {
		// Added with a default that only the rows already there keep.
		add := "ALTER TABLE " + recordTable(schema) + " ADD COLUMN IF NOT EXISTS " + streamedColumn + " timestamptz DEFAULT '-infinity'"
		drop := "ALTER TABLE " + recordTable(schema) + " ALTER COLUMN " + streamedColumn + " DROP DEFAULT"
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, add); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, drop)
			return err
		})
		if errors.As(err, &pgErr) && pgErr.Code == "42501" {
			log.Warn("walrelay's record table lacks a column this version writes, and this role may not add it: a refusal of a slot that is gone cannot then say whether a relay ever streamed from it; as the table's owner run "+add+"; "+drop,
				zap.String("record", recordTable(schema)), zap.String("column", streamedColumn), zap.String("server", pgErr.Message))
			return nil
		}
		if err != nil {
			return fmt.Errorf("add column %s to walrelay's record table: %w", streamedColumn, err)
		}
	}
	return nil
}

// ensureRecordTable creates the record table. A role that may not create
// it gets the statements to have a superuser run.
func ensureRecordTable(ctx context.Context, conn *pgx.Conn, schema string) error {
	ddl := recordDDL(schema)
	var haveSchema bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", schema).Scan(&haveSchema); err != nil {
		return fmt.Errorf("look up schema %q: %w", schema, err)
	}
	if haveSchema {
		// CREATE SCHEMA IF NOT EXISTS still needs CREATE on the database.
		ddl = ddl[1:]
	}
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		for _, q := range ddl {
			if _, err := tx.Exec(ctx, q); err != nil {
				return err
			}
		}
		return nil
	})
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42501":
		var role string
		_ = conn.QueryRow(ctx, "SELECT current_user").Scan(&role) // the refusal stands without the name
		return setupErrorf("cannot create walrelay's record table %s (%s): walrelay writes down there what it streams from, to refuse replacing it after a failover or a migration; as a superuser run CREATE SCHEMA %s AUTHORIZATION %s (or source.Prepare, then grant the role SELECT, INSERT, UPDATE, DELETE on it), or choose a schema the role may create tables in (source.SetupConfig.RecordSchema)",
			recordTable(schema), pgErr.Message, pgx.Identifier{schema}.Sanitize(), pgx.Identifier{role}.Sanitize())
	case errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "42P07"):
		return nil // created concurrently by another walrelay
	case err != nil:
		return fmt.Errorf("create walrelay's record table %s: %w", recordTable(schema), err)
	}
	return nil
}

// ReadRecord reads the record of slot; ok is false when there is none
// (nor a record table).
func ReadRecord(ctx context.Context, conn *pgx.Conn, schema, slotName string) (rec Record, ok bool, err error) {
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", recordTable(schema)).Scan(&exists); err != nil {
		return rec, false, fmt.Errorf("look up walrelay's record table: %w", err)
	}
	if !exists {
		return rec, false, nil
	}
	var tables []byte
	var confirmed string
	var stopped, stoppedAt, pending *string
	// Through to_jsonb, so that a table without the later columns reads.
	err = conn.QueryRow(ctx, `SELECT slot_name, publication, publication_oid, publication_xmin, tables, system_identifier, confirmed_lsn::text,
			stopped, stopped_at_lsn::text, updated_at, to_jsonb(r) ->> '`+snapshotColumn+`',
			to_jsonb(r) ? '`+streamedColumn+`' AND to_jsonb(r) ->> '`+streamedColumn+`' IS NULL
		FROM `+recordTable(schema)+` r WHERE slot_name = $1`, slotName).Scan(
		&rec.Slot, &rec.Publication, &rec.PublicationOID, &rec.PublicationXmin, &tables, &rec.SystemID, &confirmed, &stopped, &stoppedAt, &rec.UpdatedAt, &pending,
		&rec.NeverStreamed)
	if errors.Is(err, pgx.ErrNoRows) {
		return Record{}, false, nil
	}
	if err != nil {
		return rec, false, fmt.Errorf("read walrelay's record of slot %q: %w", slotName, err)
	}
	var all []RecordedTable
	if err := json.Unmarshal(tables, &all); err != nil {
		return rec, false, fmt.Errorf("walrelay's record of slot %q: tables: %w", slotName, err)
	}
	for _, t := range all {
		if t.Other {
			rec.Others = append(rec.Others, t)
		} else {
			rec.Tables = append(rec.Tables, t)
		}
	}
	if rec.ConfirmedLSN, err = slot.ParseLSN(confirmed); err != nil {
		return rec, false, err
	}
	if stopped != nil {
		rec.Stopped = *stopped
	}
	if stoppedAt != nil {
		if rec.StoppedAt, err = slot.ParseLSN(*stoppedAt); err != nil {
			return rec, false, err
		}
	}
	if pending != nil {
		if rec.SnapshotPending, err = slot.ParseLSN(*pending); err != nil {
			return rec, false, err
		}
	}
	return rec, true, nil
}

// recordWriteTimeout bounds a write of the record: a refusal must not
// wait on it for long.
const recordWriteTimeout = 10 * time.Second

// recordExec runs one write of the record. It commits locally: the record
// reaches standbys like every other change, but a synchronous standby that
// does not answer (the very trouble a refusal may be about) must not hold
// the relay's writes back.
func recordExec(ctx context.Context, conn *pgx.Conn, sql string, args ...any) error {
	ctx, cancel := context.WithTimeout(ctx, recordWriteTimeout)
	defer cancel()
	return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = local"); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, sql, args...)
		return err
	})
}

// writeRecord stores rec (a first start, or what changed at this one),
// clearing any stop: the caller checked there was none, or accepted it.
// The confirmed position never moves back.
func writeRecord(ctx context.Context, conn *pgx.Conn, schema string, rec Record) error {
	all := slices.Clone(rec.Tables)
	for _, o := range rec.Others {
		o.Other = true
		all = append(all, o)
	}
	tables, err := json.Marshal(all)
	if err != nil {
		return err
	}
	var pending *string
	if rec.SnapshotPending != 0 {
		p := rec.SnapshotPending.String()
		pending = &p
	}
	err = recordExec(ctx, conn, `INSERT INTO `+recordTable(schema)+` AS r
			(slot_name, publication, publication_oid, publication_xmin, tables, system_identifier, confirmed_lsn, `+snapshotColumn+`)
		VALUES ($1, $2, $3, $4, $5, $6, $7::text::pg_lsn, $8::text::pg_lsn)
		ON CONFLICT (slot_name) DO UPDATE SET publication = excluded.publication, publication_oid = excluded.publication_oid,
			publication_xmin = excluded.publication_xmin, tables = excluded.tables, system_identifier = excluded.system_identifier,
			confirmed_lsn = greatest(r.confirmed_lsn, excluded.confirmed_lsn), stopped = NULL, stopped_at_lsn = NULL,
			`+snapshotColumn+` = excluded.`+snapshotColumn+`, updated_at = now()`,
		rec.Slot, rec.Publication, rec.PublicationOID, rec.PublicationXmin, tables, rec.SystemID, rec.ConfirmedLSN.String(), pending)
	if err != nil {
		return fmt.Errorf("write walrelay's record of slot %q: %w", rec.Slot, err)
	}
	return nil
}

// RecordConfirmed moves the record's confirmed position forward to lsn,
// so that a refusal after a failover names a recent one. It returns the
// server's WAL position after its own write: that write is a transaction
// of the relay's database, which PostgreSQL 14 streams as an empty one and
// the relay confirms; a caller that writes again only past the returned
// position does not feed on its own writes on an idle outbox.
func RecordConfirmed(ctx context.Context, conn *pgx.Conn, schema, slotName string, lsn decoder.LSN) (decoder.LSN, error) {
	err := recordExec(ctx, conn, `UPDATE `+recordTable(schema)+` SET confirmed_lsn = $2::text::pg_lsn, updated_at = now()
		WHERE slot_name = $1 AND confirmed_lsn < $2::text::pg_lsn`, slotName, lsn.String())
	if err != nil {
		return 0, fmt.Errorf("update walrelay's record of slot %q: %w", slotName, err)
	}
	var after string
	if err := conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&after); err != nil {
		return 0, fmt.Errorf("read the WAL position after updating walrelay's record of slot %q: %w", slotName, err)
	}
	end, err := slot.ParseLSN(after)
	if err != nil {
		return 0, err
	}
	return max(lsn, end), nil
}

// RecordStreamed writes into the record of slotName that a relay started
// a stream from the slot, the first time one does after walrelay set the
// slot up: a refusal of the slot once it is gone then says whether a relay
// ever streamed from it (doctor.SlotGoneError). A record table without
// the column (a role that may not add it: ensureRecordColumns warned) is
// left as it is.
func RecordStreamed(ctx context.Context, conn *pgx.Conn, schema, slotName string) error {
	err := recordExec(ctx, conn, `UPDATE `+recordTable(schema)+` SET `+streamedColumn+` = now() WHERE slot_name = $1 AND `+streamedColumn+` IS NULL`, slotName)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42703" {
		return nil
	}
	if err != nil {
		return fmt.Errorf("write into walrelay's record of slot %q that a relay streamed from it: %w", slotName, err)
	}
	return nil
}

// slotCreated forgets, in an existing record, that a relay streamed from
// the slot: Prepare just created the slot again (a gap accepted, an
// initial snapshot redone), and no relay streamed from this one yet.
func slotCreated(ctx context.Context, conn *pgx.Conn, schema, slotName string) error {
	err := recordExec(ctx, conn, `UPDATE `+recordTable(schema)+` SET `+streamedColumn+` = NULL WHERE slot_name = $1 AND `+streamedColumn+` IS NOT NULL`, slotName)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42703" {
		return nil
	}
	if err != nil {
		return fmt.Errorf("write the new slot into walrelay's record of slot %q: %w", slotName, err)
	}
	return nil
}

// snapshotDone clears the record's mark of an initial snapshot being
// published: the slot is an ordinary one from now on.
func snapshotDone(ctx context.Context, conn *pgx.Conn, schema, slotName string) error {
	err := recordExec(ctx, conn, `UPDATE `+recordTable(schema)+` SET `+snapshotColumn+` = NULL, updated_at = now() WHERE slot_name = $1`, slotName)
	if err != nil {
		return fmt.Errorf("write the end of the initial snapshot into walrelay's record of slot %q: %w", slotName, err)
	}
	return nil
}

// RecordStop writes down why a running relay stopped, and the last
// position it confirmed: the next start refuses until the gap is accepted,
// even when the change was undone meanwhile.
func RecordStop(ctx context.Context, conn *pgx.Conn, schema, slotName, reason string, confirmed decoder.LSN) error {
	err := recordExec(ctx, conn, `UPDATE `+recordTable(schema)+` SET stopped = $2, stopped_at_lsn = $3::text::pg_lsn,
			confirmed_lsn = greatest(confirmed_lsn, $3::text::pg_lsn), updated_at = now()
		WHERE slot_name = $1 AND stopped IS NULL`, slotName, reason, confirmed.String())
	if err != nil {
		return fmt.Errorf("write the stop into walrelay's record of slot %q: %w", slotName, err)
	}
	return nil
}

// acceptGap appends an accepted gap to the record's history, for whoever
// later wonders why events are missing.
func acceptGap(ctx context.Context, conn *pgx.Conn, schema, slotName string, g *slot.GapError) error {
	entry, _ := json.Marshal(map[string]string{"what": g.What, "after_lsn": g.Since.String(), "accepted_at": time.Now().UTC().Format(time.RFC3339)})
	return recordExec(ctx, conn, `UPDATE `+recordTable(schema)+` SET accepted_gaps = accepted_gaps || jsonb_build_array($2::jsonb), updated_at = now()
		WHERE slot_name = $1`, slotName, entry)
}

// DropRecord removes the record of slot: the operator dropped the slot on
// purpose, so the next start is a first start again.
func DropRecord(ctx context.Context, conn *pgx.Conn, schema, slotName string) error {
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", recordTable(schema)).Scan(&exists); err != nil || !exists {
		return err
	}
	return recordExec(ctx, conn, "DELETE FROM "+recordTable(schema)+" WHERE slot_name = $1", slotName)
}
