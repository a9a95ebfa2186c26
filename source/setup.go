package source

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/slot"
)

// SetupConfig says what the source database must provide.
type SetupConfig struct {
	URL string
	// PrimaryURL, when set, names the primary of URL, a hot standby
	// (PostgreSQL 16+) walrelay decodes on: the publication, walrelay's
	// record and the nudges a slot created on a standby waits for are
	// written there (standby.go); the slot stays on the standby.
	PrimaryURL  string
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
	// Failover makes the slot a failover slot on PostgreSQL 17+ (created
	// so, or altered so when it is not): a standby with
	// sync_replication_slots keeps a copy that survives a promotion.
	Failover bool
	// RecordSchema is the schema of walrelay's record of what it streams
	// from (record.go); empty means DefaultRecordSchema.
	RecordSchema string
	// AcceptGap lets Prepare go on after something walrelay streamed from
	// was replaced or removed (the slot, the publication, an outbox
	// table's membership): the gap is logged, kept in the record, and
	// what is missing is created again. Only an operator sets it
	// (walrelay setup --accept-gap).
	AcceptGap bool
	// Binary is --binary: the mapped columns must be of types the decoder
	// renders from pgoutput's binary format (decoder.BinaryRenders).
	Binary bool
	// TopicTemplate, when set, is the relay's topic template: a start
	// warns when another walrelay streams the same publication from
	// another slot to the same template (StreamOptions.TopicTemplate).
	TopicTemplate string
	// Snapshot, when set, publishes the rows present when the slot is
	// created. It is called only when Prepare creates the slot, with the
	// name of a snapshot exported at the slot's consistent point (import
	// it with SET TRANSACTION SNAPSHOT) and that point; it must return
	// only once every row it published is safely in Kafka. Until it
	// returned nil the record marks the slot as waiting for its snapshot,
	// so a crash during the snapshot makes the next start drop the slot
	// and snapshot again (see createSlotWithSnapshot).
	Snapshot func(ctx context.Context, snapshotName string, consistentPoint decoder.LSN) error
	// CreateWarnInterval is how often creating the slot, while PostgreSQL
	// waits for transactions to end, warns naming them (slotwait.go); 0
	// means DefaultCreateWarnInterval.
	CreateWarnInterval time.Duration
	// CreateDeadline, when set, is when creating the slot gives up
	// waiting for transactions (at least CreateWarnInterval after it
	// began): PostgreSQL's wait is cancelled, which leaves no slot behind,
	// and Prepare returns a *CreateWaitError naming them.
	CreateDeadline time.Time
	// OnCreateWait, when set, is called every CreateWarnInterval while
	// creating the slot waits, with how long it has, and with 0 when the
	// creation ends.
	OnCreateWait func(waited time.Duration)
}

// Prepare checks the source database and creates the publication and slot
// when allowed, then returns walrelay's record of what the slot streams
// from. A *slot.SetupError means walrelay must not start, and a
// *slot.GapError that something it streamed from was replaced or removed;
// other errors (connection failures) may go away on retry.
func Prepare(ctx context.Context, cfg SetupConfig, log *zap.Logger) (Record, error) {
	if cfg.RecordSchema == "" {
		cfg.RecordSchema = DefaultRecordSchema
	}
	conn, err := slot.Connect(ctx, cfg.URL)
	if err != nil {
		return Record{}, err
	}
	defer conn.Close(context.Background())

	standby, err := checkEndpoint(ctx, conn, cfg)
	if err != nil {
		return Record{}, err
	}
	if !standby && cfg.PrimaryURL != "" {
		log.Warn("source.SetupConfig.URL names a primary that holds the slot, though source.SetupConfig.PrimaryURL is set: the standby walrelay decoded on was promoted; walrelay writes to it directly now (leave source.SetupConfig.PrimaryURL out)",
			zap.String("postgres", slot.Redact(cfg.URL)), zap.String("slot", cfg.Slot))
		cfg.PrimaryURL = ""
	}
	version, err := checkServer(ctx, conn)
	if err != nil {
		return Record{}, err
	}
	// pconn is where walrelay writes: the primary of a standby decoded on,
	// else conn.
	pconn := conn
	if standby {
		if pconn, err = slot.Connect(ctx, cfg.PrimaryURL); err != nil {
			return Record{}, fmt.Errorf("connect to the primary (source.SetupConfig.PrimaryURL): %w", err)
		}
		defer pconn.Close(context.Background())
		if err := checkStandby(ctx, conn, pconn, cfg, log); err != nil {
			return Record{}, err
		}
	}
	for _, t := range cfg.Tables {
		if err := checkTable(ctx, conn, t, cfg.Columns); err != nil {
			return Record{}, err
		}
	}
	if err := checkOutbox(ctx, conn, cfg, log); err != nil {
		return Record{}, err
	}
	haveRecords, err := recordTableReady(ctx, pconn, cfg.RecordSchema)
	if err != nil {
		return Record{}, err
	}
	if haveRecords {
		if err := ensureRecordColumns(ctx, pconn, cfg.RecordSchema, log); err != nil {
			return Record{}, err
		}
	}
	var rec Record
	var recorded bool
	if haveRecords {
		if rec, recorded, err = ReadRecord(ctx, pconn, cfg.RecordSchema, cfg.Slot); err != nil {
			return Record{}, err
		}
	}
	var accepted *slot.GapError
	if recorded {
		gap, err := checkRecord(ctx, conn, pconn, cfg, rec, log)
		if err != nil {
			return Record{}, err
		}
		if gap != nil && !cfg.AcceptGap {
			// Written down, so that undoing the change does not make the
			// next start forget the rows it skipped.
			if err := RecordStop(ctx, pconn, cfg.RecordSchema, cfg.Slot, gap.What, gap.Since); err != nil {
				log.Warn("cannot write the refusal into walrelay's record", zap.Error(err))
			}
			return Record{}, gap
		}
		if gap != nil {
			log.Warn("accepting a gap: events committed meanwhile may be missing from Kafka for good; walrelay recreates what is missing and goes on",
				zap.String("slot", cfg.Slot), zap.String("what", gap.What), zap.Stringer("missing_after_lsn", gap.Since))
			if err := acceptGap(ctx, pconn, cfg.RecordSchema, cfg.Slot, gap); err != nil {
				return Record{}, fmt.Errorf("write the accepted gap into walrelay's record: %w", err)
			}
			accepted = gap
		}
	}
	// The record's accepted other tables, when it describes this
	// publication as walrelay streamed from it: a table added since is
	// refused.
	var known *Record
	if recorded && accepted == nil && rec.Publication == cfg.Publication {
		known = &rec
	}
	if err := ensurePublication(ctx, pconn, cfg, known, log); err != nil {
		return Record{}, err
	}
	// Before the slot: a refusal here must not leave a slot holding WAL.
	if !haveRecords {
		if err := ensureRecordTable(ctx, pconn, cfg.RecordSchema); err != nil {
			return Record{}, err
		}
	}
	replaced, created, err := ensureSlot(ctx, conn, pconn, cfg, version, recorded && rec.SnapshotPending != 0, log)
	if err != nil {
		return Record{}, err
	}
	if created && recorded {
		if err := slotCreated(ctx, pconn, cfg.RecordSchema, cfg.Slot); err != nil {
			return Record{}, err
		}
	}
	now, err := currentRecord(ctx, conn, pconn, cfg)
	if err != nil {
		return Record{}, err
	}
	now.Accepted = accepted
	// A new record, or a slot created again, has no relay's stream yet.
	now.NeverStreamed = !recorded || rec.NeverStreamed || created
	if accepted != nil && now.PublicationOID != rec.PublicationOID {
		// The publication walrelay streamed from was dropped: decoding the
		// WAL written while it did not exist fails (PostgreSQL 15-17) or
		// skips it with a notice (18) whatever exists now, so the slot
		// moves past it, to now.
		if now.ConfirmedLSN, err = advanceSlot(ctx, conn, cfg.Slot); err != nil {
			return Record{}, err
		}
		log.Warn("moved the slot past the WAL written while its publication did not exist", zap.String("slot", cfg.Slot),
			zap.Stringer("from_lsn", accepted.Since), zap.Stringer("to_lsn", now.ConfirmedLSN))
	}
	if !recorded {
		log.Info("recorded what the slot streams from: walrelay will refuse to replace the slot, the publication or an outbox table's membership if they change under it",
			zap.String("slot", cfg.Slot), zap.String("record", recordTable(cfg.RecordSchema)))
	}
	if recorded && accepted == nil && sameSource(rec, now) {
		// Nothing to write down: a start writes no WAL the slot would
		// then hold until a relay confirms it.
		now.ConfirmedLSN = max(now.ConfirmedLSN, rec.ConfirmedLSN)
		return now, nil
	}
	if err := writeRecord(ctx, pconn, cfg.RecordSchema, now); err != nil {
		return Record{}, err
	}
	if replaced != nil && accepted == nil {
		// An invalidated slot without a record: the gap goes into the
		// record written just now.
		if err := acceptGap(ctx, pconn, cfg.RecordSchema, cfg.Slot, replaced); err != nil {
			return Record{}, fmt.Errorf("write the accepted gap into walrelay's record: %w", err)
		}
		now.Accepted = replaced
	}
	return now, nil
}

// sameSource reports whether two records describe the same publication and
// tables on the same system.
func sameSource(a, b Record) bool {
	return a.Publication == b.Publication && a.PublicationOID == b.PublicationOID && a.PublicationXmin == b.PublicationXmin &&
		a.SystemID == b.SystemID && slices.Equal(a.Tables, b.Tables) && slices.Equal(a.Others, b.Others)
}

// currentRecord is the record of what the slot streams from now: the slot
// as conn has it, the publication as pconn (the primary, where it was
// just made or changed) has it.
func currentRecord(ctx context.Context, conn, pconn *pgx.Conn, cfg SetupConfig) (Record, error) {
	rec := Record{Slot: cfg.Slot, Publication: cfg.Publication}
	pub, err := ReadPublication(ctx, pconn, cfg.Publication, cfg.Tables)
	if err != nil {
		return rec, err
	}
	rec.PublicationOID = pub.OID
	rec.PublicationXmin = pub.xmin
	for _, t := range pub.Tables {
		rec.Tables = append(rec.Tables, RecordedTable{Table: t.Table, OID: t.OID, MemberOID: t.MemberOID})
	}
	rec.Others = pub.Others
	if err := conn.QueryRow(ctx, "SELECT system_identifier::text FROM pg_control_system()").Scan(&rec.SystemID); err != nil {
		return rec, fmt.Errorf("read the system identifier: %w", err)
	}
	info, err := slot.ReadInfo(ctx, conn, cfg.Slot)
	if err != nil {
		return rec, err
	}
	rec.ConfirmedLSN = info.ConfirmedLSN
	return rec, nil
}

// checkRecord compares what the database holds now with the record of
// what the slot streamed from: a *slot.GapError names the first thing
// replaced or removed since.
func checkRecord(ctx context.Context, conn, pconn *pgx.Conn, cfg SetupConfig, rec Record, log *zap.Logger) (*slot.GapError, error) {
	if rec.Stopped != "" {
		return &slot.GapError{What: rec.Stopped, Since: rec.StoppedAt}, nil
	}
	if rec.SnapshotPending != 0 {
		// Written by a start that died during its initial snapshot: the
		// slot was never streamed from, so nothing can be missing; it is
		// created again (ensureSlot).
		return nil, nil
	}
	since := rec.ConfirmedLSN
	info, err := slot.ReadInfo(ctx, conn, cfg.Slot)
	switch {
	case errors.Is(err, slot.ErrNoSlot):
		var system string
		if err := conn.QueryRow(ctx, "SELECT system_identifier::text FROM pg_control_system()").Scan(&system); err != nil {
			return nil, fmt.Errorf("read the system identifier: %w", err)
		}
		gap := doctor.SlotGoneError(cfg.Slot, rec.Recorded(cfg.RecordSchema), cfg.PrimaryURL != "")
		if system != rec.SystemID {
			gap.What += fmt.Sprintf("; the record was written on PostgreSQL system %s and this server is system %s: a copy or restore of another cluster?", rec.SystemID, system)
		}
		return gap, nil
	case err != nil:
		return nil, err
	}
	since = max(since, info.ConfirmedLSN)
	if info.Invalidated() {
		return doctor.ReadInvalidatedError(ctx, conn, info, since), nil
	}
	if rec.Publication != cfg.Publication {
		// The operator moved the slot to another publication: what it
		// publishes is checked as at a first start.
		return nil, nil
	}
	var tables []decoder.Table
	recorded := map[decoder.Table]RecordedTable{}
	for _, t := range rec.Tables {
		if slices.Contains(cfg.Tables, t.Table) {
			tables = append(tables, t.Table)
			recorded[t.Table] = t
		}
	}
	pub, err := ReadPublication(ctx, pconn, cfg.Publication, tables)
	if err != nil {
		return nil, err
	}
	return publicationGap(cfg, rec, recorded, pub, since, log), nil
}

// publicationGap compares the publication as it is now with the record of
// the one the slot streamed from (recorded: its outbox tables still
// configured): a *slot.GapError names the first thing replaced or removed
// since, nil means none.
func publicationGap(cfg SetupConfig, rec Record, recorded map[decoder.Table]RecordedTable, pub Publication, since decoder.LSN, log *zap.Logger) *slot.GapError {
	ident := pgx.Identifier{cfg.Publication}.Sanitize()
	switch {
	case !pub.Exists:
		return &slot.GapError{What: fmt.Sprintf("publication %q was dropped after walrelay streamed from it", cfg.Publication), Since: since}
	case pub.OID != rec.PublicationOID:
		return &slot.GapError{What: fmt.Sprintf("publication %q was dropped and created again after walrelay streamed from it (OID %d, now %d)", cfg.Publication, rec.PublicationOID, pub.OID), Since: since}
	case !pub.Insert:
		return &slot.GapError{What: fmt.Sprintf("publication %q no longer publishes inserts", cfg.Publication), Since: since,
			Fix: fmt.Sprintf("restore it with ALTER PUBLICATION %s SET (publish = 'insert')", ident)}
	}
	if rec.PublicationXmin != "" && pub.xmin != rec.PublicationXmin {
		// An ALTER PUBLICATION ... SET that left it publishing the outbox:
		// harmless, unless a change undone since stopped it publishing
		// inserts meanwhile, which nothing here can tell.
		log.Warn("the publication was altered while walrelay was not streaming; it publishes the outbox tables now. Had a change undone since stopped it publishing inserts meanwhile, the rows committed then were skipped: compare the outbox with the topics",
			zap.String("publication", cfg.Publication), zap.Stringer("since_lsn", since))
	}
	for _, pt := range pub.Tables {
		t := recorded[pt.Table]
		switch {
		case pt.OID != t.OID:
			return &slot.GapError{What: fmt.Sprintf("outbox table %s was dropped and created again after walrelay streamed from it (OID %d, now %d): PostgreSQL takes a dropped table out of its publications, so inserts into the new table were not published", pt.Table, t.OID, pt.OID), Since: since}
		case !pt.Published && !pt.AsPartitions:
			return &slot.GapError{What: fmt.Sprintf("outbox table %s was removed from publication %q after walrelay streamed from it", pt.Table, cfg.Publication), Since: since}
		case t.MemberOID != 0 && pt.MemberOID != 0 && pt.MemberOID != t.MemberOID:
			return &slot.GapError{What: fmt.Sprintf("outbox table %s was removed from publication %q and added again after walrelay streamed from it", pt.Table, cfg.Publication), Since: since}
		}
	}
	return nil
}

// advanceSlot moves the slot's confirmed position to the server's WAL end.
func advanceSlot(ctx context.Context, conn *pgx.Conn, slotName string) (decoder.LSN, error) {
	var end string
	err := conn.QueryRow(ctx, `SELECT end_lsn::text FROM pg_replication_slot_advance($1,
		CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)`, slotName).Scan(&end)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55006" {
		return 0, setupErrorf("replication slot %q is in use (%s): stop the relay streaming from it, then accept the gap", slotName, pgErr.Message)
	}
	if err != nil {
		return 0, fmt.Errorf("advance replication slot %q: %w", slotName, err)
	}
	return slot.ParseLSN(end)
}

// checkServer refuses a server walrelay cannot stream from and returns
// its version (server_version_num).
func checkServer(ctx context.Context, conn *pgx.Conn) (int, error) {
	if err := checkServerVersion(ctx, conn); err != nil {
		return 0, err
	}
	var walLevel string
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('wal_level'), current_setting('server_version_num')::int").Scan(&walLevel, &version); err != nil {
		return 0, fmt.Errorf("read wal_level: %w", err)
	}
	if walLevel != "logical" {
		return 0, setupErrorf("wal_level is %q: set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL", walLevel)
	}
	var user string
	var canReplicate bool
	err := conn.QueryRow(ctx, "SELECT current_user, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").Scan(&user, &canReplicate)
	if err != nil {
		return 0, fmt.Errorf("read role attributes: %w", err)
	}
	if !canReplicate {
		return 0, setupErrorf("role %q lacks the REPLICATION attribute: run ALTER ROLE %s WITH REPLICATION as a superuser", user, pgx.Identifier{user}.Sanitize())
	}
	return version, nil
}

func checkTable(ctx context.Context, conn *pgx.Conn, t decoder.Table, want []string) error {
	ident := pgx.Identifier{t.Schema, t.Name}.Sanitize()
	var oid *uint32
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1)::oid", ident).Scan(&oid); err != nil {
		return fmt.Errorf("look up table %s: %w", t, err)
	}
	if oid == nil {
		return setupErrorf("outbox table %s does not exist: create it (see the README's DDL) or name the right one in source.SetupConfig.Tables", t)
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
			return setupErrorf("outbox table %s has no column %q: add it, or map another column (decoder.Mapping; it has: %s)", t, c, strings.Join(have, ", "))
		}
	}
	return nil
}

// ensureSlot checks the slot, creating it when allowed (created); replaced
// is the gap accepted when it dropped an invalidated slot to create a new
// one.
// snapshotPending says the record marks the slot's initial snapshot as
// unfinished (Record.SnapshotPending).
func ensureSlot(ctx context.Context, conn, pconn *pgx.Conn, cfg SetupConfig, version int, snapshotPending bool, log *zap.Logger) (replaced *slot.GapError, created bool, err error) {
	// A slot on a standby cannot be a failover slot (PostgreSQL refuses
	// it): promoting the standby keeps the slot itself.
	failover := cfg.Failover && version >= slot.FailoverSlots && cfg.PrimaryURL == ""
	info, err := slot.ReadInfo(ctx, conn, cfg.Slot)
	create := func() (*slot.GapError, bool, error) {
		if !cfg.CreateSlot {
			return nil, false, setupErrorf("replication slot %q does not exist: create it with SELECT pg_create_logical_replication_slot('%s', 'pgoutput'), or turn on source.SetupConfig.CreateSlot", cfg.Slot, cfg.Slot)
		}
		if cfg.Snapshot != nil {
			err := createSlotWithSnapshot(ctx, conn, pconn, cfg, failover, log)
			return replaced, err == nil, err
		}
		err := createSlot(ctx, cfg, failover, log)
		return replaced, err == nil, err
	}
	if err == nil && cfg.Snapshot != nil && cfg.CreateSlot {
		if snapshotPending, err = snapshotPendingLocked(ctx, conn, pconn, cfg, log); err != nil {
			return nil, false, err
		}
		// Read again: the start that held the lock may have dropped
		// the slot, or made it a failover slot.
		info, err = slot.ReadInfo(ctx, conn, cfg.Slot)
	}
	if errors.Is(err, slot.ErrNoSlot) {
		return create()
	}
	if err != nil {
		return nil, false, err
	}
	var db string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		return nil, false, fmt.Errorf("read current database: %w", err)
	}
	if err := checkSlotInfo(cfg, info, db); err != nil {
		return nil, false, err
	}
	if snapshotPending && cfg.CreateSlot {
		if cfg.Snapshot != nil {
			return create() // under its lock: drops the slot, snapshots again
		}
		log.Warn("the initial snapshot of an earlier start did not finish, and this start takes none: the slot streams from its consistent point; rows present then that the snapshot did not publish are not published (relay.PublishSnapshot publishes the current rows)",
			zap.String("slot", cfg.Slot))
		if err := snapshotDone(ctx, pconn, cfg.RecordSchema, cfg.Slot); err != nil {
			return nil, false, err
		}
	}
	if info.Invalidated() {
		// Only a slot walrelay could have streamed from is replaced.
		if replaced, err = replaceInvalidated(ctx, conn, cfg, info, log); err != nil {
			return nil, false, err
		}
		return create()
	}
	if failover && info.Failover != nil && !*info.Failover {
		return nil, false, makeFailoverSlot(ctx, cfg, log)
	}
	return nil, false, nil
}

// checkSlotInfo refuses an existing slot walrelay cannot stream from: not
// a logical pgoutput slot of database db. (An invalidated one is replaced,
// not refused: ensureSlot.)
func checkSlotInfo(cfg SetupConfig, info slot.Info, db string) error {
	switch {
	case info.SlotType != "logical":
		return setupErrorf("replication slot %q is a %s slot: walrelay needs a logical pgoutput slot; choose another source.SetupConfig.Slot", cfg.Slot, info.SlotType)
	case info.Plugin != "pgoutput":
		return setupErrorf("replication slot %q uses plugin %q, not pgoutput: choose another source.SetupConfig.Slot, or drop it if nothing else uses it", cfg.Slot, info.Plugin)
	case info.Database != db:
		return setupErrorf("replication slot %q belongs to database %q, not %q: choose another source.SetupConfig.Slot", cfg.Slot, info.Database, db)
	}
	return nil
}

// makeFailoverSlot turns an existing slot into a failover slot. A slot in
// use is left alone: the relay streaming from it does this at its start.
func makeFailoverSlot(ctx context.Context, cfg SetupConfig, log *zap.Logger) error {
	rconn, err := slot.ReplicationConn(ctx, cfg.URL)
	if err != nil {
		return err
	}
	defer rconn.Close(context.Background())
	_, err = rconn.Exec(ctx, "ALTER_REPLICATION_SLOT "+quoteIdent(cfg.Slot)+" (FAILOVER true)").ReadAll()
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55006" {
		return nil
	}
	if err != nil {
		return fmt.Errorf("make replication slot %q a failover slot: %w", cfg.Slot, err)
	}
	log.Info("made the replication slot a failover slot: a standby with sync_replication_slots = on keeps a copy that survives its promotion", zap.String("slot", cfg.Slot))
	return nil
}

// createSlotCommand is CREATE_REPLICATION_SLOT for a pgoutput slot without
// a snapshot, a failover slot when asked (PostgreSQL 17+; pglogrepl has no
// option for it).
func createSlotCommand(name string, failover bool) string {
	cmd := "CREATE_REPLICATION_SLOT " + quoteIdent(name) + " LOGICAL pgoutput"
	if failover {
		return cmd + " (SNAPSHOT 'nothing', FAILOVER true)"
	}
	return cmd + " NOEXPORT_SNAPSHOT"
}

func createSlot(ctx context.Context, cfg SetupConfig, failover bool, log *zap.Logger) error {
	rconn, err := slot.ReplicationConn(ctx, cfg.URL)
	if err != nil {
		return err
	}
	defer rconn.Close(context.Background())
	var res pglogrepl.CreateReplicationSlotResult
	err = createWatched(ctx, cfg, rconn, cfg.Slot, log, func(ctx context.Context) (err error) {
		res, err = pglogrepl.ParseCreateReplicationSlot(rconn.Exec(ctx, createSlotCommand(cfg.Slot, failover)))
		return err
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
	log.Info("created replication slot", zap.String("slot", cfg.Slot), zap.String("consistent_point", res.ConsistentPoint), zap.Bool("failover", failover))
	return nil
}

// createSlotWithSnapshot creates the slot at a consistent point whose rows
// cfg.Snapshot publishes: a temporary slot exporting its snapshot on a
// replication connection, at once a permanent copy of it
// (pg_copy_logical_replication_slot keeps the consistent point) marked in
// the record as waiting for its snapshot, then the snapshot read at the
// exported point and published, then the mark cleared. Rows committed
// before the consistent point are in the snapshot, later ones come through
// the slot: none both ways, none lost.
//
// The copy comes before the publishing so that nothing which can fail
// comes after it but clearing the mark: the temporary slot and its
// snapshot live only as long as their connection, which a server, a
// network or a DBA may end while a snapshot is published (a snapshot
// already read keeps its rows once imported). A start that dies while
// publishing leaves the marked slot, never streamed from: the next start
// drops it and snapshots again (rows already published arrive twice).
//
// Relays started together on a fresh database (a standby and the active
// one) would each snapshot, and publish the rows twice; with exactly-once
// delivery the second one's snapshot would take the transactional id from
// the first, already streaming. So creating the slot this way is
// serialised by an advisory lock on the slot's name: the relay that waited
// finds the slot, publishes no snapshot and streams (or waits as the
// standby).
func createSlotWithSnapshot(ctx context.Context, conn, pconn *pgx.Conn, cfg SetupConfig, failover bool, log *zap.Logger) error {
	unlock, err := lockSlotCreation(ctx, conn, cfg, log)
	if err != nil {
		return err
	}
	defer unlock()
	if done, err := unfinishedSnapshot(ctx, conn, pconn, cfg, log); done || err != nil {
		return err
	}
	rcfg, err := slot.ReplicationConfig(cfg.URL)
	if err != nil {
		return err
	}
	rconn, err := pgconn.ConnectConfig(ctx, rcfg)
	if err != nil {
		return fmt.Errorf("replication connection: %w", slot.RedactError(err, cfg.URL))
	}
	// Closing the connection drops the temporary slot, whatever happened.
	defer rconn.Close(context.Background())
	suffix := make([]byte, 6)
	rand.Read(suffix)
	tmp := "walrelay_snapshot_" + hex.EncodeToString(suffix)
	var res pglogrepl.CreateReplicationSlotResult
	err = createWatched(ctx, cfg, rconn, tmp, log, func(ctx context.Context) (err error) {
		res, err = pglogrepl.CreateReplicationSlot(ctx, rconn, tmp, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
			Mode:           pglogrepl.LogicalReplication,
			Temporary:      true,
			SnapshotAction: "EXPORT_SNAPSHOT",
		})
		return err
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
	// another command: it stays idle until the snapshot is published.
	_, err = conn.Exec(ctx, "SELECT pg_copy_logical_replication_slot($1, $2, false)", tmp, cfg.Slot)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "53400" {
			return setupErrorf("cannot create replication slot %q: %s; raise max_replication_slots or drop unused slots", cfg.Slot, pgErr.Message)
		}
		return fmt.Errorf("create replication slot %q from the snapshot's temporary slot: %w", cfg.Slot, err)
	}
	rec, err := currentRecord(ctx, conn, pconn, cfg)
	if err != nil {
		return err
	}
	rec.SnapshotPending = at
	if err := writeRecord(ctx, pconn, cfg.RecordSchema, rec); err != nil {
		return err
	}
	log.Info("created replication slot at the snapshot's consistent point; publishing the initial snapshot", zap.String("slot", cfg.Slot), zap.Stringer("consistent_point", at))
	if err := cfg.Snapshot(ctx, res.SnapshotName, at); err != nil {
		// Nothing streamed from the slot: dropped, a relay that does not
		// try again (a refused snapshot query, a stop) leaves nothing
		// holding WAL; the record's mark makes the next start do it if
		// this does not.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		if _, derr := conn.Exec(dctx, "SELECT pg_drop_replication_slot($1)", cfg.Slot); derr != nil {
			log.Warn("cannot drop the slot of the unfinished initial snapshot; the next start drops it", zap.String("slot", cfg.Slot), zap.Error(derr))
		}
		cancel()
		return err
	}
	if err := snapshotDone(ctx, pconn, cfg.RecordSchema, cfg.Slot); err != nil {
		return err
	}
	if failover {
		// A copy is never a failover slot (PostgreSQL 17 does not copy
		// the property); the temporary slot and its snapshot are done
		// with, so the connection may run another command.
		if _, err := rconn.Exec(ctx, "ALTER_REPLICATION_SLOT "+quoteIdent(cfg.Slot)+" (FAILOVER true)").ReadAll(); err != nil {
			return fmt.Errorf("make replication slot %q a failover slot: %w", cfg.Slot, err)
		}
	}
	log.Info("initial snapshot done: the slot streams from its consistent point", zap.String("slot", cfg.Slot), zap.Stringer("consistent_point", at), zap.Bool("failover", failover))
	return nil
}

// lockSlotCreation takes the advisory lock serialising createSlotWithSnapshot,
// waiting (and saying so) while another walrelay holds it; unlock releases
// it (a failed unlock is released with the session, when conn closes).
func lockSlotCreation(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, log *zap.Logger) (unlock func(), err error) {
	key := "walrelay slot " + cfg.Slot
	var got bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock(hashtext($1))", key).Scan(&got); err != nil {
		return nil, fmt.Errorf("take the lock on creating slot %q: %w", cfg.Slot, err)
	}
	if !got {
		log.Info("another walrelay is creating the replication slot and publishing its initial snapshot: waiting for it to finish", zap.String("slot", cfg.Slot))
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(hashtext($1))", key); err != nil {
			return nil, fmt.Errorf("wait for the lock on creating slot %q: %w", cfg.Slot, err)
		}
	}
	return func() { _, _ = conn.Exec(context.Background(), "SELECT pg_advisory_unlock(hashtext($1))", key) }, nil
}

// snapshotPendingLocked reads, with the lock on creating the slot held for
// a moment, whether the record marks the slot's initial snapshot as
// unfinished. A slot found without the lock may be one another walrelay
// copied from its temporary slot a moment ago and is still publishing the
// snapshot of: streaming from it then would put later changes on Kafka
// before snapshot rows (and take the slot, so that the other start cannot
// finish). Once the lock is free, a mark still there is one a start that
// died left.
func snapshotPendingLocked(ctx context.Context, conn, pconn *pgx.Conn, cfg SetupConfig, log *zap.Logger) (bool, error) {
	unlock, err := lockSlotCreation(ctx, conn, cfg, log)
	if err != nil {
		return false, err
	}
	defer unlock()
	rec, ok, err := ReadRecord(ctx, pconn, cfg.RecordSchema, cfg.Slot)
	if err != nil {
		return false, err
	}
	return ok && rec.SnapshotPending != 0, nil
}

// unfinishedSnapshot looks, with the lock on creating the slot held, at
// what a start before this one left: done when another walrelay created
// the slot with its snapshot meanwhile (use it); when an earlier start
// died publishing its snapshot, it drops the slot that start created,
// never streamed from, so that this one snapshots again.
func unfinishedSnapshot(ctx context.Context, conn, pconn *pgx.Conn, cfg SetupConfig, log *zap.Logger) (done bool, err error) {
	if _, err := slot.ReadInfo(ctx, conn, cfg.Slot); errors.Is(err, slot.ErrNoSlot) {
		return false, nil
	} else if err != nil {
		return false, err
	}
	rec, ok, err := ReadRecord(ctx, pconn, cfg.RecordSchema, cfg.Slot)
	if err != nil {
		return false, err
	}
	if !ok || rec.SnapshotPending == 0 {
		log.Info("replication slot was created meanwhile by another walrelay (with its initial snapshot); using it", zap.String("slot", cfg.Slot))
		return true, nil
	}
	log.Warn("the initial snapshot of an earlier start did not finish: dropping the slot it created, never streamed from, and snapshotting again (rows it published arrive again)",
		zap.String("slot", cfg.Slot), zap.Stringer("consistent_point", rec.SnapshotPending))
	if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", cfg.Slot); err != nil {
		return false, fmt.Errorf("drop replication slot %q, left by an unfinished initial snapshot: %w", cfg.Slot, err)
	}
	return false, nil
}

// replaceInvalidated drops an invalidated slot when the gap was accepted
// (SetupConfig.AcceptGap), so that ensureSlot creates a new one, and
// returns the gap; without AcceptGap it is the refusal.
func replaceInvalidated(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, info slot.Info, log *zap.Logger) (*slot.GapError, error) {
	gap := doctor.ReadInvalidatedError(ctx, conn, info, 0)
	if !cfg.AcceptGap {
		return nil, gap
	}
	_, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", cfg.Slot)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42704":
		// Dropped meanwhile: ensureSlot creates it.
	case err != nil:
		return nil, fmt.Errorf("drop the invalidated replication slot %q: %w", cfg.Slot, err)
	}
	log.Warn("accepting a gap: dropped the invalidated replication slot to create a new one; events committed after its confirmed position are not published through it",
		zap.String("slot", cfg.Slot), zap.String("what", gap.What), zap.Stringer("missing_after_lsn", gap.Since))
	return gap, nil
}

// quoteIdent quotes a PostgreSQL identifier.
func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// quoteLiteral quotes a PostgreSQL string literal.
func quoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }

// setupErrorf is a *slot.SetupError: a reason not to start, naming the fix.
func setupErrorf(format string, args ...any) error {
	return &slot.SetupError{Msg: fmt.Sprintf(format, args...)}
}
