package source

// publication.go: what the publication publishes of the outbox tables, and
// making it publish them.
//
// The publication decides what reaches the relay: a partitioned outbox
// published without publish_via_partition_root arrives under its
// partitions' names, a row filter drops rows before they are decoded, a
// column list can leave out a mapped column, and a table added to the
// publication later brings none of the rows it already held. Each of these
// would lose events without a word, so each is refused or said at startup.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// ownerMark starts the comment walrelay puts on the publications it
// creates. Only those it alters without --alter-publication: another
// publication may be shared, and every subscriber of it would receive an
// added table.
const ownerMark = "created by walrelay"

// Publication is what a publication publishes of the outbox tables.
type Publication struct {
	Name   string
	Exists bool
	// OID is the publication's pg_publication OID (0 when it does not
	// exist): one dropped and created again under the same name has another.
	OID uint32
	// Owned means walrelay created it (its comment starts with "created by
	// walrelay").
	Owned bool
	// AllTables is a FOR ALL TABLES publication: every table's rows stream.
	AllTables bool
	// Insert: it publishes inserts.
	Insert bool
	// ViaRoot is publish_via_partition_root: rows of partitions arrive
	// under the name of the partitioned table that is published.
	ViaRoot bool
	// Tables are the outbox tables, in the order configured.
	Tables []PublishedTable
	// Others are the tables the publication lists by name (FOR TABLE)
	// that are neither an outbox table nor a partition of one: their
	// inserts stream to the relay, which maps none of them (see Coverage).
	Others []RecordedTable

	version int    // server_version_num
	xmin    string // of its pg_publication row: changes with every ALTER PUBLICATION ... SET
}

// PublishedTable is one outbox table as a publication publishes it.
type PublishedTable struct {
	Table decoder.Table
	// OID is the table's pg_class OID.
	OID uint32
	// MemberOID is the OID of the publication's pg_publication_rel row
	// for the table; 0 when it has none (not published, or covered by FOR
	// ALL TABLES or TABLES IN SCHEMA).
	MemberOID uint32
	// Partitioned is a partitioned table (relkind 'p'): its rows live in
	// partitions and arrive under its own name only with
	// publish_via_partition_root.
	Partitioned bool
	// Partitions is the number of its leaf partitions now.
	Partitions int
	// Published: the publication sends its inserts under its own name.
	Published bool
	// AsPartitions: the publication covers the partitioned table, but sends
	// its rows under the partitions' names (publish_via_partition_root is
	// off), which no outbox maps.
	AsPartitions bool
	// Columns are the published columns when the publication leaves some
	// out (a column list, PostgreSQL 15+); nil means every column.
	Columns []string
	// RowFilter is the publication's WHERE expression for the table
	// (PostgreSQL 15+); empty means none.
	RowFilter string
}

// ReadPublication reads what publication name publishes of tables. A
// publication that does not exist is returned with Exists false.
func ReadPublication(ctx context.Context, conn *pgx.Conn, name string, tables []decoder.Table) (Publication, error) {
	pub := Publication{Name: name}
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&pub.version); err != nil {
		return pub, fmt.Errorf("read server version: %w", err)
	}
	viaRoot := "p.pubviaroot"
	if pub.version < 130000 {
		viaRoot = "false" // publish_via_partition_root came with PostgreSQL 13
	}
	var pubOID uint32
	var comment string
	err := conn.QueryRow(ctx, `SELECT p.oid, p.xmin::text, p.pubinsert, p.puballtables, `+viaRoot+`, coalesce(obj_description(p.oid, 'pg_publication'), '')
		FROM pg_publication p WHERE p.pubname = $1`, name).Scan(&pubOID, &pub.xmin, &pub.Insert, &pub.AllTables, &pub.ViaRoot, &comment)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return pub, fmt.Errorf("look up publication %q: %w", name, err)
	default:
		pub.Exists = true
		pub.OID = pubOID
		pub.Owned = strings.HasPrefix(comment, ownerMark)
	}
	for _, t := range tables {
		pt, err := readPublishedTable(ctx, conn, &pub, pubOID, t)
		if err != nil {
			return pub, err
		}
		pub.Tables = append(pub.Tables, pt)
	}
	if pub.Exists {
		others, err := listedOthers(ctx, conn, pubOID, pub.Tables)
		if err != nil {
			return pub, fmt.Errorf("read the tables of publication %q: %w", name, err)
		}
		pub.Others = others
	}
	return pub, nil
}

// listedOthers are the tables publication pubOID lists that are not one of
// outbox nor a partition of one (whose rows arrive under the outbox's
// name), with their OIDs and membership rows'.
func listedOthers(ctx context.Context, conn *pgx.Conn, pubOID uint32, outbox []PublishedTable) ([]RecordedTable, error) {
	oids := make([]uint32, 0, len(outbox))
	for _, t := range outbox {
		oids = append(oids, t.OID)
	}
	rows, err := conn.Query(ctx, `SELECT n.nspname::text, c.relname::text, c.oid, r.oid
		FROM pg_publication_rel r JOIN pg_class c ON c.oid = r.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE r.prpubid = $1 AND r.prrelid <> ALL($2::oid[])
		  AND NOT EXISTS (SELECT 1 FROM pg_partition_ancestors(r.prrelid) a WHERE a.relid = ANY($2::oid[]))
		ORDER BY 1, 2`, pubOID, oids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (RecordedTable, error) {
		var t RecordedTable
		return t, r.Scan(&t.Table.Schema, &t.Table.Name, &t.OID, &t.MemberOID)
	})
}

// newOthers are the tables of others that the record does not list as
// accepted when it was written (rec.Others): tables added to the
// publication since walrelay first streamed from it. Without a record
// (a first start) none is new.
func newOthers(others []RecordedTable, rec *Record) []RecordedTable {
	if rec == nil {
		return nil
	}
	var added []RecordedTable
	for _, o := range others {
		if !rec.AcceptsOther(o.OID) {
			added = append(added, o)
		}
	}
	return added
}

// Coverage is how a publication covers a table walrelay does not map.
type Coverage uint8

const (
	// NotCovered means the publication does not publish the table (any
	// more): an operator took it out, or dropped it.
	NotCovered Coverage = iota
	// Listed means the publication names the table, or a partitioned
	// table it is a partition of (FOR TABLE): someone made its rows part
	// of what the slot streams, as an outbox's.
	Listed
	// Broad means only FOR ALL TABLES or TABLES IN SCHEMA cover it: every
	// table's rows stream, and those walrelay does not map are not events.
	Broad
	// Shared is a Listed table that the publication already listed when
	// walrelay recorded it (Record.Others): another subscriber's, in a
	// shared publication, whose rows are not events of this relay.
	Shared
)

// ReadCoverage says how publication covers the table of pg_class OID
// relOID, as the catalog is now.
func ReadCoverage(ctx context.Context, conn *pgx.Conn, publication string, relOID uint32) (Coverage, error) {
	schemas := "false"
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return NotCovered, fmt.Errorf("read server version: %w", err)
	}
	if version >= 150000 { // TABLES IN SCHEMA came with PostgreSQL 15
		schemas = "EXISTS (SELECT 1 FROM pg_publication_namespace pn JOIN pg_class c ON c.relnamespace = pn.pnnspid WHERE pn.pnpubid = p.oid AND c.oid = $2)"
	}
	var listed, broad bool
	err := conn.QueryRow(ctx, `SELECT
			EXISTS (SELECT 1 FROM pg_publication_rel r WHERE r.prpubid = p.oid
				AND (r.prrelid = $2 OR r.prrelid IN (SELECT relid FROM pg_partition_ancestors($2)))),
			p.puballtables OR `+schemas+`
		FROM pg_publication p WHERE p.pubname = $1`, publication, relOID).Scan(&listed, &broad)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return NotCovered, nil
	case err != nil:
		return NotCovered, fmt.Errorf("read how publication %q covers table %d: %w", publication, relOID, err)
	case listed:
		return Listed, nil
	case broad:
		return Broad, nil
	}
	return NotCovered, nil
}

func readPublishedTable(ctx context.Context, conn *pgx.Conn, pub *Publication, pubOID uint32, t decoder.Table) (PublishedTable, error) {
	pt := PublishedTable{Table: t}
	ident := pgx.Identifier{t.Schema, t.Name}.Sanitize()
	leaves, generated := "0", "true"
	if pub.version >= 120000 { // pg_partition_tree and generated columns came with PostgreSQL 12
		leaves = "(SELECT count(*) FROM pg_partition_tree(c.oid) WHERE isleaf AND relid <> c.oid)"
		generated = "a.attgenerated = ''"
	}
	var oid uint32
	var visible int // columns PostgreSQL replicates (generated ones it does not)
	err := conn.QueryRow(ctx, `SELECT c.oid, c.relkind = 'p', CASE WHEN c.relkind = 'p' THEN `+leaves+` ELSE 0 END,
			(SELECT count(*) FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND `+generated+`)
		FROM pg_class c WHERE c.oid = to_regclass($1)`, ident).Scan(&oid, &pt.Partitioned, &pt.Partitions, &visible)
	if errors.Is(err, pgx.ErrNoRows) {
		return pt, setupErrorf("outbox table %s does not exist: create it (see the README's DDL) or name the right one in source.SetupConfig.Tables", t)
	}
	if err != nil {
		return pt, fmt.Errorf("look up table %s: %w", t, err)
	}
	pt.OID = oid
	if !pub.Exists {
		return pt, nil
	}
	err = conn.QueryRow(ctx, `SELECT oid FROM pg_publication_rel WHERE prpubid = $1 AND prrelid = $2`, pubOID, oid).Scan(&pt.MemberOID)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return pt, fmt.Errorf("read publication %q of %s: %w", pub.Name, t, err)
	}

	cols := "NULL::text[], NULL::text"
	if pub.version >= 150000 {
		cols = "attnames::text[], rowfilter"
	}
	var attnames []string
	var rowFilter *string
	err = conn.QueryRow(ctx, `SELECT `+cols+` FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3`,
		pub.Name, t.Schema, t.Name).Scan(&attnames, &rowFilter)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return pt, fmt.Errorf("read publication %q of %s: %w", pub.Name, t, err)
	default:
		pt.Published = true
		if attnames != nil && len(attnames) < visible {
			pt.Columns = attnames
		}
		if rowFilter != nil {
			pt.RowFilter = *rowFilter
		}
	}
	if pt.Published || !pt.Partitioned || pub.ViaRoot || pub.version < 120000 {
		return pt, nil
	}
	// Not listed under its own name: without publish_via_partition_root a
	// partitioned table the publication covers is listed as its leaves.
	schemas := "false"
	if pub.version >= 150000 {
		schemas = "EXISTS (SELECT 1 FROM pg_publication_namespace n JOIN pg_class c ON c.relnamespace = n.pnnspid WHERE n.pnpubid = $1 AND c.oid = $2)"
	}
	err = conn.QueryRow(ctx, `SELECT $3::bool
		OR EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pg_partition_tree($2) p ON p.relid = r.prrelid WHERE r.prpubid = $1)
		OR `+schemas, pubOID, oid, pub.AllTables).Scan(&pt.AsPartitions)
	if err != nil {
		return pt, fmt.Errorf("read publication %q of %s: %w", pub.Name, t, err)
	}
	return pt, nil
}

// createOptions are the publication options walrelay creates with.
// publish_via_partition_root is set even when no outbox is partitioned
// (it changes nothing for other tables), so that a partitioned table added
// with a later --table also arrives under its own name.
func createOptions(version int) string {
	if version < 130000 {
		return "publish = 'insert'"
	}
	return "publish = 'insert', publish_via_partition_root = true"
}

func ensurePublication(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, rec *Record, log *zap.Logger) error {
	pub, err := ReadPublication(ctx, conn, cfg.Publication, cfg.Tables)
	if err != nil {
		return err
	}
	if !pub.Exists {
		return createPublication(ctx, conn, cfg, pub, log)
	}
	if err := publicationRefusal(cfg, pub, rec, log); err != nil {
		return err
	}
	missing := unpublished(pub)
	if len(missing) == 0 {
		return nil
	}
	return addTables(ctx, conn, cfg, addTablesSQL(cfg, missing), missing, log)
}

// publicationRefusal is why walrelay must not stream from the existing
// publication pub as it is, or nil; it logs what it accepts with a
// warning. Outbox tables pub lacks are no refusal when walrelay may add
// them (unpublished, addTablesSQL).
func publicationRefusal(cfg SetupConfig, pub Publication, rec *Record, log *zap.Logger) error {
	ident := pgx.Identifier{cfg.Publication}.Sanitize()
	if !pub.Insert {
		return setupErrorf("publication %q does not publish inserts: ALTER PUBLICATION %s SET (publish = 'insert')", cfg.Publication, ident)
	}
	if added := newOthers(pub.Others, rec); len(added) > 0 {
		names := make([]string, len(added))
		tables := make([]decoder.Table, len(added))
		for i, t := range added {
			names[i], tables[i] = t.Table.String(), t.Table
		}
		return setupErrorf("publication %q lists tables that are not outbox tables of this relay and were added to it after walrelay first streamed from it: %s; walrelay would stream their inserts and could publish none of them. If they are outbox tables, add them to source.SetupConfig.Tables; if not, remove them from the publication (ALTER PUBLICATION %s DROP TABLE %s)",
			cfg.Publication, strings.Join(names, ", "), ident, tableList(tables))
	}
	if len(pub.Others) > 0 && rec == nil {
		names := make([]string, len(pub.Others))
		for i, t := range pub.Others {
			names[i] = t.Table.String()
		}
		log.Warn("the publication lists tables that are not outbox tables of this relay (another subscriber's, in a shared publication): their inserts stream to walrelay and are not published (counted in walrelay_unmapped_inserts_total); walrelay records them, and refuses a table added to the publication later. If one is an outbox, add it to source.SetupConfig.Tables",
			zap.String("publication", cfg.Publication), zap.Strings("tables", names))
	}
	if pub.AllTables {
		log.Warn("publication is FOR ALL TABLES: the inserts of every table of the database stream to walrelay, which publishes only the outbox tables' and counts the others in walrelay_unmapped_inserts_total; prefer a publication FOR TABLE the outbox tables",
			zap.String("publication", cfg.Publication))
	}
	for _, t := range pub.Tables {
		switch {
		case t.AsPartitions || t.Partitioned && !t.Published && !pub.ViaRoot:
			return setupErrorf("publication %q would send the rows of partitioned outbox table %s under its partitions' names, which walrelay does not map: run ALTER PUBLICATION %s SET (publish_via_partition_root = true)", cfg.Publication, t.Table, ident)
		case t.Published:
			if err := checkPublished(cfg, t, log); err != nil {
				return err
			}
		}
	}
	missing := unpublished(pub)
	if len(missing) == 0 {
		return nil
	}
	sql := addTablesSQL(cfg, missing)
	switch {
	case pub.Owned && !cfg.CreatePublication:
		return setupErrorf("publication %q lacks outbox tables: run %s, or turn on source.SetupConfig.CreatePublication", cfg.Publication, sql)
	case !pub.Owned && !cfg.AlterPublication:
		return setupErrorf("publication %q lacks outbox tables and was not created by walrelay (it may be shared with other subscribers): run %s yourself, or turn on source.SetupConfig.AlterPublication to let walrelay do it", cfg.Publication, sql)
	}
	return nil
}

// unpublished are the outbox tables pub does not publish.
func unpublished(pub Publication) []PublishedTable {
	var missing []PublishedTable
	for _, t := range pub.Tables {
		if !t.Published {
			missing = append(missing, t)
		}
	}
	return missing
}

// addTablesSQL is the ALTER PUBLICATION that adds tables to cfg's
// publication.
func addTablesSQL(cfg SetupConfig, tables []PublishedTable) string {
	var names []decoder.Table
	for _, t := range tables {
		names = append(names, t.Table)
	}
	return fmt.Sprintf("ALTER PUBLICATION %s ADD TABLE %s", pgx.Identifier{cfg.Publication}.Sanitize(), tableList(names))
}

// checkPublished refuses a column list that leaves out a mapped column and,
// unless allowed, a row filter; an allowed row filter is logged.
func checkPublished(cfg SetupConfig, t PublishedTable, log *zap.Logger) error {
	ident := pgx.Identifier{cfg.Publication}.Sanitize()
	table := pgx.Identifier{t.Table.Schema, t.Table.Name}.Sanitize()
	if t.Columns != nil {
		for _, c := range cfg.Columns {
			if !slices.Contains(t.Columns, c) {
				return setupErrorf("publication %q does not publish column %q of outbox table %s, which walrelay maps (its column list: %s): add the column to the list (ALTER PUBLICATION %s DROP TABLE %s, then ALTER PUBLICATION %s ADD TABLE %s (%s)), or map another column (decoder.Mapping)",
					cfg.Publication, c, t.Table, strings.Join(t.Columns, ", "), ident, table, ident, table, identList(append(slices.Clone(t.Columns), c)))
			}
		}
	}
	if t.RowFilter != "" {
		if !cfg.AllowRowFilter {
			return setupErrorf("publication %q has a row filter on outbox table %s (WHERE %s): rows it filters out are never published and the slot moves past them; remove it (ALTER PUBLICATION %s DROP TABLE %s, then ALTER PUBLICATION %s ADD TABLE %s), or accept it with source.SetupConfig.AllowRowFilter",
				cfg.Publication, t.Table, t.RowFilter, ident, table, ident, table)
		}
		log.Warn("publication row filter: outbox rows it filters out are never published (source.SetupConfig.AllowRowFilter)",
			zap.String("publication", cfg.Publication), zap.String("table", t.Table.String()), zap.String("row_filter", t.RowFilter))
	}
	return nil
}

func createPublication(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, pub Publication, log *zap.Logger) error {
	ident := pgx.Identifier{cfg.Publication}.Sanitize()
	sql := fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (%s)", ident, tableList(cfg.Tables), createOptions(pub.version))
	if !cfg.CreatePublication {
		return setupErrorf("publication %q does not exist: create it with %s, or turn on source.SetupConfig.CreatePublication", cfg.Publication, sql)
	}
	// The mark goes in with the publication, so that no publication
	// walrelay created is ever without it.
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sql); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, fmt.Sprintf("COMMENT ON PUBLICATION %s IS '%s: walrelay adds the outbox tables it lacks'", ident, ownerMark))
		return err
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == "42710" || pgErr.Code == "23505") {
			// Another walrelay created it at the same moment: check
			// what it created.
			return ensurePublication(ctx, conn, cfg, nil, log)
		}
		return publicationError(ctx, conn, cfg, "create", sql, err)
	}
	log.Info("created publication", zap.String("publication", cfg.Publication), zap.String("sql", sql))
	return nil
}

// addTables runs sql (ALTER PUBLICATION … ADD TABLE) and, when the slot
// exists already, warns per table about the rows it holds: the stream
// carries only rows written after the change.
func addTables(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, sql string, tables []PublishedTable, log *zap.Logger) error {
	counts := make([]int64, len(tables))
	// Counted in the transaction that adds the tables: the rows committed
	// before it are the ones the stream will not carry.
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sql); err != nil {
			return err
		}
		for i, t := range tables {
			q := "SELECT count(*) FROM " + pgx.Identifier{t.Table.Schema, t.Table.Name}.Sanitize()
			if err := tx.QueryRow(ctx, q).Scan(&counts[i]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return publicationError(ctx, conn, cfg, "alter", sql, err)
	}
	log.Info("added tables to publication", zap.String("publication", cfg.Publication), zap.String("sql", sql))
	if _, err := slot.ReadInfo(ctx, conn, cfg.Slot); errors.Is(err, slot.ErrNoSlot) {
		// The slot is created after this: its first start is when rows
		// already present are dealt with, as for a new publication.
		return nil
	}
	for i, t := range tables {
		if counts[i] == 0 {
			continue
		}
		// A command line, not the field a library names elsewhere: a fix
		// field is for an operator to paste into a shell, and the rows of
		// one table are published once by walrelay snapshot (an embedder
		// calls relay.PublishSnapshot with relay.Config.Tables).
		fix := "walrelay snapshot --table " + t.Table.String()
		log.Warn("added table to the publication: the rows it already holds will not be streamed, only rows written from now on; publish them once with the fix",
			zap.String("publication", cfg.Publication), zap.String("table", t.Table.String()),
			zap.Int64("rows_not_streamed", counts[i]), zap.String("fix", fix))
	}
	return nil
}

// publicationError turns a refused CREATE or ALTER PUBLICATION into a
// setup error naming the privileges it needs.
func publicationError(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, verb, sql string, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		return fmt.Errorf("%s publication %q: %w", verb, cfg.Publication, err)
	}
	if verb == "alter" {
		return setupErrorf("cannot add tables to publication %q: %s; that needs ownership of the publication and of the tables: run %s as a role that owns both, then restart walrelay",
			cfg.Publication, pgErr.Message, sql)
	}
	var db, role string
	if err := conn.QueryRow(ctx, "SELECT current_database(), current_user").Scan(&db, &role); err != nil {
		db, role = "<database>", "<role>"
	}
	return setupErrorf("cannot create publication %q: %s; creating a publication needs CREATE on the database and ownership of the outbox tables: GRANT CREATE ON DATABASE %s TO %s and make it the tables' owner, or run %s as a role that has both, then restart walrelay",
		cfg.Publication, pgErr.Message, pgx.Identifier{db}.Sanitize(), pgx.Identifier{role}.Sanitize(), sql)
}

func tableList(ts []decoder.Table) string {
	parts := make([]string, len(ts))
	for i, t := range ts {
		parts[i] = pgx.Identifier{t.Schema, t.Name}.Sanitize()
	}
	return strings.Join(parts, ", ")
}

func identList(names []string) string {
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = pgx.Identifier{n}.Sanitize()
	}
	return strings.Join(parts, ", ")
}
