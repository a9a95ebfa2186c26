package slot

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
)

// SetupConfig says what the source database must provide.
type SetupConfig struct {
	URL         string
	Slot        string
	Publication string
	Tables      []decoder.Table
	// Columns are the mapped columns every outbox table must have.
	Columns []string
	// CreatePublication creates the publication when it is missing and
	// adds outbox tables it lacks when walrelay created it.
	CreatePublication bool
	// AlterPublication adds outbox tables to an existing publication that
	// walrelay did not create (it may be shared with other subscribers).
	AlterPublication bool
	// AllowRowFilter accepts a publication row filter on an outbox table:
	// rows it filters out are never published.
	AllowRowFilter bool
	// CreateSlot creates the slot (pgoutput) when it is missing.
	CreateSlot bool
	// Snapshot, when set, publishes the rows present when the slot is
	// created. It is called only when Prepare creates the slot, with the
	// name of a snapshot exported at the slot's consistent point (import
	// it with SET TRANSACTION SNAPSHOT) and that point; it must return
	// only once every row it published is safely in Kafka. The slot is
	// made permanent only after it returned nil: until then it exists as
	// a temporary slot that vanishes with the connection, so a crash
	// during the snapshot leaves no slot behind and the next start
	// snapshots again.
	Snapshot func(ctx context.Context, snapshotName string, consistentPoint decoder.LSN) error
}

// Connect opens a normal (non-replication) connection for checks and
// queries, with the password kept out of any error. A string that does not
// parse is a *SetupError, before any connection attempt; without sslmode
// the connection uses DefaultSSLMode.
func Connect(ctx context.Context, url string) (*pgx.Conn, error) {
	if _, err := parseConfig(url); err != nil {
		return nil, err
	}
	cfg, err := pgx.ParseConfig(withDefaultSSLMode(url))
	if err != nil {
		return nil, fmt.Errorf("parse PostgreSQL URL %s: %w", Redact(url), redactErr(err, url))
	}
	if _, ok := cfg.RuntimeParams["application_name"]; !ok {
		cfg.RuntimeParams["application_name"] = "walrelay"
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		if err := connectError(err, url); IsSetupError(err) {
			return nil, err
		}
		return nil, fmt.Errorf("connect to PostgreSQL %s: %w", Redact(url), redactErr(err, url))
	}
	return conn, nil
}

// Prepare checks the source database and creates the publication and slot
// when allowed. A *SetupError means walrelay must not start; other errors
// (connection failures) may go away on retry.
func Prepare(ctx context.Context, cfg SetupConfig, log *zap.Logger) error {
	conn, err := Connect(ctx, cfg.URL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())

	if err := checkServer(ctx, conn); err != nil {
		return err
	}
	for _, t := range cfg.Tables {
		if err := checkTable(ctx, conn, t, cfg.Columns); err != nil {
			return err
		}
	}
	if err := ensurePublication(ctx, conn, cfg, log); err != nil {
		return err
	}
	return ensureSlot(ctx, conn, cfg, log)
}

func checkServer(ctx context.Context, conn *pgx.Conn) error {
	if err := checkServerVersion(ctx, conn); err != nil {
		return err
	}
	var walLevel string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if walLevel != "logical" {
		return setupErrorf("wal_level is %q: set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL", walLevel)
	}
	var user string
	var canReplicate bool
	err := conn.QueryRow(ctx, "SELECT current_user, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").Scan(&user, &canReplicate)
	if err != nil {
		return fmt.Errorf("read role attributes: %w", err)
	}
	if !canReplicate {
		return setupErrorf("role %q lacks the REPLICATION attribute: run ALTER ROLE %s WITH REPLICATION as a superuser", user, pgx.Identifier{user}.Sanitize())
	}
	return nil
}

func checkTable(ctx context.Context, conn *pgx.Conn, t decoder.Table, want []string) error {
	ident := pgx.Identifier{t.Schema, t.Name}.Sanitize()
	var oid *uint32
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1)::oid", ident).Scan(&oid); err != nil {
		return fmt.Errorf("look up table %s: %w", t, err)
	}
	if oid == nil {
		return setupErrorf("outbox table %s does not exist: create it (see the README's DDL) or name the right one with --table", t)
	}
	rows, err := conn.Query(ctx, "SELECT attname FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped", *oid)
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", t, err)
	}
	have, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", t, err)
	}
	for _, c := range want {
		if !slices.Contains(have, c) {
			return setupErrorf("outbox table %s has no column %q: add it, or map another column with the matching --column-* or --header-column flag (it has: %s)", t, c, strings.Join(have, ", "))
		}
	}
	return nil
}

func ensureSlot(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, log *zap.Logger) error {
	info, err := ReadInfo(ctx, conn, cfg.Slot)
	if errors.Is(err, ErrNoSlot) {
		if !cfg.CreateSlot {
			return setupErrorf("replication slot %q does not exist: create it with SELECT pg_create_logical_replication_slot('%s', 'pgoutput'), or allow --create-slot", cfg.Slot, cfg.Slot)
		}
		if cfg.Snapshot != nil {
			return createSlotWithSnapshot(ctx, conn, cfg, log)
		}
		return createSlot(ctx, cfg, log)
	}
	if err != nil {
		return err
	}
	var db string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		return fmt.Errorf("read current database: %w", err)
	}
	switch {
	case info.SlotType != "logical":
		return setupErrorf("replication slot %q is a %s slot: walrelay needs a logical pgoutput slot; choose another --slot", cfg.Slot, info.SlotType)
	case info.Plugin != "pgoutput":
		return setupErrorf("replication slot %q uses plugin %q, not pgoutput: choose another --slot, or drop it if nothing else uses it", cfg.Slot, info.Plugin)
	case info.Database != db:
		return setupErrorf("replication slot %q belongs to database %q, not %q: choose another --slot", cfg.Slot, info.Database, db)
	case info.WALStatus == "lost":
		return InvalidatedError(cfg.Slot)
	}
	return nil
}

func createSlot(ctx context.Context, cfg SetupConfig, log *zap.Logger) error {
	rcfg, err := ReplicationConfig(cfg.URL)
	if err != nil {
		return err
	}
	rconn, err := pgconn.ConnectConfig(ctx, rcfg)
	if err != nil {
		return fmt.Errorf("replication connection: %w", connectError(err, cfg.URL))
	}
	defer rconn.Close(context.Background())
	res, err := pglogrepl.CreateReplicationSlot(ctx, rconn, cfg.Slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
		Mode:           pglogrepl.LogicalReplication,
		SnapshotAction: "NOEXPORT_SNAPSHOT",
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42710" { // created concurrently by another walrelay
			return nil
		}
		if errors.As(err, &pgErr) && pgErr.Code == "53400" {
			return setupErrorf("cannot create replication slot %q: %s; raise max_replication_slots or drop unused slots", cfg.Slot, pgErr.Message)
		}
		return fmt.Errorf("create replication slot %q: %w", cfg.Slot, err)
	}
	log.Info("created replication slot", zap.String("slot", cfg.Slot), zap.String("consistent_point", res.ConsistentPoint))
	return nil
}

// createSlotWithSnapshot creates the slot at a consistent point whose rows
// cfg.Snapshot publishes first: a temporary slot exporting its snapshot on
// a replication connection, the snapshot read at it, then a permanent copy
// of the temporary slot (pg_copy_logical_replication_slot keeps the
// consistent point), then the temporary slot goes with the connection.
// Rows committed before the consistent point are in the snapshot, later
// ones come through the slot: none both ways, none lost.
//
// Relays started together on a fresh database (a standby and the active
// one) would each snapshot, and publish the rows twice; with exactly-once
// delivery the second one's snapshot would take the transactional id from
// the first, already streaming. So creating the slot this way is
// serialised by an advisory lock on the slot's name: the relay that waited
// finds the slot, publishes no snapshot and streams (or waits as the
// standby).
func createSlotWithSnapshot(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, log *zap.Logger) error {
	lockKey := "walrelay slot " + cfg.Slot
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(hashtext($1))", lockKey); err != nil {
		return fmt.Errorf("wait for the lock on creating slot %q: %w", cfg.Slot, err)
	}
	defer conn.Exec(context.Background(), "SELECT pg_advisory_unlock(hashtext($1))", lockKey)
	if _, err := ReadInfo(ctx, conn, cfg.Slot); err == nil {
		log.Info("replication slot was created meanwhile by another walrelay (with its initial snapshot); using it", zap.String("slot", cfg.Slot))
		return nil
	} else if !errors.Is(err, ErrNoSlot) {
		return err
	}
	rcfg, err := ReplicationConfig(cfg.URL)
	if err != nil {
		return err
	}
	rconn, err := pgconn.ConnectConfig(ctx, rcfg)
	if err != nil {
		return fmt.Errorf("replication connection: %w", redactErr(err, cfg.URL))
	}
	// Closing the connection drops the temporary slot, whatever happened.
	defer rconn.Close(context.Background())
	suffix := make([]byte, 6)
	rand.Read(suffix)
	tmp := "walrelay_snapshot_" + hex.EncodeToString(suffix)
	res, err := pglogrepl.CreateReplicationSlot(ctx, rconn, tmp, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
		Mode:           pglogrepl.LogicalReplication,
		Temporary:      true,
		SnapshotAction: "EXPORT_SNAPSHOT",
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "53400" {
			return setupErrorf("cannot create replication slot %q: %s; raise max_replication_slots or drop unused slots", cfg.Slot, pgErr.Message)
		}
		return fmt.Errorf("create temporary replication slot %q for the initial snapshot: %w", tmp, err)
	}
	at, err := pglogrepl.ParseLSN(res.ConsistentPoint)
	if err != nil {
		return fmt.Errorf("consistent point %q of slot %q: %w", res.ConsistentPoint, tmp, err)
	}
	log.Info("created a temporary replication slot for the initial snapshot", zap.String("temporary_slot", tmp),
		zap.Stringer("consistent_point", at), zap.String("snapshot", res.SnapshotName))
	// The exported snapshot lives until the replication connection runs
	// another command: it stays idle until the copy is made.
	if err := cfg.Snapshot(ctx, res.SnapshotName, at); err != nil {
		return err
	}
	_, err = conn.Exec(ctx, "SELECT pg_copy_logical_replication_slot($1, $2, false)", tmp, cfg.Slot)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42710" {
			// Another walrelay created it meanwhile: it streams from its
			// own consistent point, and the rows this one published are
			// duplicates at worst.
			log.Info("replication slot was created meanwhile by another walrelay; using it", zap.String("slot", cfg.Slot))
			return nil
		}
		if errors.As(err, &pgErr) && pgErr.Code == "53400" {
			return setupErrorf("cannot create replication slot %q: %s; raise max_replication_slots or drop unused slots", cfg.Slot, pgErr.Message)
		}
		return fmt.Errorf("create replication slot %q from the snapshot's temporary slot: %w", cfg.Slot, err)
	}
	log.Info("created replication slot at the snapshot's consistent point", zap.String("slot", cfg.Slot), zap.Stringer("consistent_point", at))
	return nil
}
