package source

// preflight.go: what walrelay checks before it creates anything, for
// mistakes that would otherwise show up late, or never: an endpoint that
// cannot replicate (a hot standby, a connection pooler), a database whose
// text cannot be published as UTF-8, an outbox "table" that is a view, a
// mapped column PostgreSQL does not replicate or --binary cannot render,
// too few free replication slots for the initial snapshot, and another
// walrelay already streaming the same publication to the same topics.
//
// Each refusal is a *slot.SetupError naming the fix, found within the first
// queries of a start: before the publication or a slot exists, so a
// refused start leaves nothing behind, and before any retry loop.

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// checkEndpoint refuses an endpoint walrelay cannot stream from: a
// connection pooler in front of PostgreSQL that cannot pass a replication
// connection (pgbouncer), a hot standby, or a database in SQL_ASCII (text
// of no known encoding). It runs first, on conn to cfg.URL. The pooler is
// looked for before conn runs a query: through a pooler in transaction
// mode, a server connection may still hold prepared statements of an
// earlier client, on which the first query would fail instead.
func checkEndpoint(ctx context.Context, conn *pgx.Conn, cfg SetupConfig) (standby bool, err error) {
	if err := checkReplicationConnection(ctx, cfg.URL); err != nil {
		return false, err
	}
	var inRecovery bool
	var version int
	var encoding, db string
	err = conn.QueryRow(ctx, `SELECT pg_is_in_recovery(), current_setting('server_version_num')::int,
		current_setting('server_encoding'), current_database()`).Scan(&inRecovery, &version, &encoding, &db)
	if err != nil {
		return false, fmt.Errorf("read server state: %w", err)
	}
	target := slot.Redact(cfg.URL)
	switch {
	case inRecovery && version < StandbyDecoding:
		return false, setupErrorf("PostgreSQL at %s is a hot standby (pg_is_in_recovery() is true): PostgreSQL %d cannot decode logically on a standby, nor create a publication there; point source.SetupConfig.URL at the primary (PostgreSQL 16+ decodes on a standby, with source.SetupConfig.PrimaryURL naming its primary)", target, version/10000)
	case inRecovery && cfg.PrimaryURL == "":
		return false, setupErrorf("PostgreSQL at %s is a hot standby (pg_is_in_recovery() is true): to decode on it, name its primary in source.SetupConfig.PrimaryURL (walrelay writes its heartbeat, publication and record there); or point source.SetupConfig.URL at the primary", target)
	case !inRecovery && cfg.PrimaryURL != "":
		// A standby walrelay decoded on and that was promoted since keeps
		// the slot: it is now a primary of its own, written to directly.
		var promoted bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)", cfg.Slot).Scan(&promoted); err != nil {
			return false, fmt.Errorf("look up replication slot %q: %w", cfg.Slot, err)
		}
		if promoted {
			break
		}
		return false, setupErrorf("source.SetupConfig.PrimaryURL is set, but PostgreSQL at %s (source.SetupConfig.URL) is not a hot standby (pg_is_in_recovery() is false): leave source.SetupConfig.PrimaryURL out to stream from this primary, or point source.SetupConfig.URL at a hot standby of it", target)
	}
	if encoding == "SQL_ASCII" {
		return false, setupErrorf("database %q has encoding SQL_ASCII: PostgreSQL stores its text as bytes of no known encoding, which walrelay cannot convert to the UTF-8 its records carry; move the outbox to a database created with ENCODING 'UTF8' (or any encoding PostgreSQL converts to UTF-8, such as LATIN1)", db)
	}
	return inRecovery, nil
}

// checkReplicationConnection opens a replication connection and runs
// IDENTIFY_SYSTEM, to find, before anything is created, an endpoint that
// answers normal connections but no replication: pgbouncer refuses the
// replication startup parameter ("unsupported startup parameter"), and a
// pooler told to ignore it hands out a normal backend, which does not know
// IDENTIFY_SYSTEM. Any other failure is left to the checks and the stream
// that follow, which say what they find.
func checkReplicationConnection(ctx context.Context, url string) error {
	rconn, err := slot.ReplicationConn(ctx, url)
	var why string
	switch {
	case err != nil && strings.Contains(err.Error(), "unsupported startup parameter"):
		why = "it refuses the replication connection's startup parameters"
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			why += " (" + pgErr.Message + ")"
		}
	case err != nil:
		return nil
	default:
		defer rconn.Close(context.Background())
		_, err := pglogrepl.IdentifySystem(ctx, rconn)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42601" {
			return nil
		}
		why = "its replication connection is a normal session, which does not know IDENTIFY_SYSTEM"
	}
	return setupErrorf("the endpoint of source.SetupConfig.URL (%s) is a connection pooler, not PostgreSQL: %s. Logical replication cannot pass through a pooler such as pgbouncer: point source.SetupConfig.URL at PostgreSQL itself (its own host and port), bypassing the pooler", slot.Redact(url), why)
}

// checkOutbox refuses outbox tables and a configuration that could never
// stream, and warns about another relay streaming the same publication to
// the same topics. It runs after the tables and columns are known to
// exist, before the publication and the slot are made.
func checkOutbox(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, log *zap.Logger) error {
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return fmt.Errorf("read server version: %w", err)
	}
	for _, t := range cfg.Tables {
		if err := checkRelKind(ctx, conn, t); err != nil {
			return err
		}
		if err := checkColumns(ctx, conn, cfg, t, version); err != nil {
			return err
		}
	}
	if err := checkFreeSlots(ctx, conn, cfg); err != nil {
		return err
	}
	warnSameTopics(ctx, conn, cfg, log)
	return nil
}

// checkRelKind refuses an outbox that is not a table: a publication
// publishes tables only, and PostgreSQL refuses to add anything else to
// one (so creating the publication would fail on every retry).
func checkRelKind(ctx context.Context, conn *pgx.Conn, t decoder.Table) error {
	ident := pgx.Identifier{t.Schema, t.Name}.Sanitize()
	var kind string
	if err := conn.QueryRow(ctx, "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)", ident).Scan(&kind); err != nil {
		return fmt.Errorf("look up table %s: %w", t, err)
	}
	what := map[string]string{"v": "a view", "m": "a materialized view", "f": "a foreign table", "S": "a sequence", "c": "a composite type", "i": "an index", "I": "an index"}[kind]
	switch {
	case kind == "r" || kind == "p":
		return nil
	case what == "":
		what = fmt.Sprintf("not a table (relkind %q)", kind)
	}
	return setupErrorf("outbox table %s is %s: a publication publishes only tables' rows, so none of its rows could ever stream; name the table the writers insert into in source.SetupConfig.Tables (for a view, SELECT pg_get_viewdef('%s'::regclass) shows the table it reads)", t, what, ident)
}

// checkColumns refuses mapped columns the stream cannot carry: a generated
// column, which pgoutput leaves out of every row before PostgreSQL 18 (and
// from 18 on unless the publication publishes it), while the snapshot
// reads it; and, with --binary, a column of a type the decoder cannot
// render from pgoutput's binary format.
func checkColumns(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, t decoder.Table, version int) error {
	ident := pgx.Identifier{t.Schema, t.Name}.Sanitize()
	generated := "''"
	if version >= 120000 { // generated columns came with PostgreSQL 12
		generated = "a.attgenerated::text"
	}
	rows, err := conn.Query(ctx, `SELECT a.attname, a.atttypid, format_type(a.atttypid, a.atttypmod), `+generated+`
		FROM pg_attribute a WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY($2)
		ORDER BY a.attnum`, ident, cfg.Columns)
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", t, err)
	}
	type col struct {
		name, typ, gen string
		oid            uint32
	}
	cols, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (col, error) {
		var c col
		err := r.Scan(&c.name, &c.oid, &c.typ, &c.gen)
		return c, err
	})
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", t, err)
	}
	for _, c := range cols {
		if c.gen != "" {
			if err := checkGenerated(ctx, conn, cfg, t, c.name, version); err != nil {
				return err
			}
		}
		if cfg.Binary && !decoder.BinaryRenders(c.oid) {
			return setupErrorf("source.SetupConfig.Binary: column %q of outbox table %s has type %s (OID %d), whose binary form walrelay cannot render as text; start without source.SetupConfig.Binary, or make the column text, varchar, bytea, json, jsonb, uuid or an integer type",
				c.name, t, c.typ, c.oid)
		}
	}
	return nil
}

// checkGenerated refuses a mapped generated column unless the publication
// publishes it (PostgreSQL 18+: publish_generated_columns = stored, or the
// column named in the table's column list).
func checkGenerated(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, t decoder.Table, column string, version int) error {
	table := pgx.Identifier{t.Schema, t.Name}.Sanitize()
	colIdent := pgx.Identifier{column}.Sanitize()
	fix := fmt.Sprintf("make it an ordinary column that the writers (or a BEFORE INSERT trigger) fill: ALTER TABLE %s ALTER COLUMN %s DROP EXPRESSION; or map another column (decoder.Mapping)", table, colIdent)
	if version < 180000 {
		return setupErrorf("column %q of outbox table %s is a generated column: PostgreSQL %d leaves generated columns out of logical replication, so every streamed row would lack it; %s",
			column, t, version/10000, fix)
	}
	var published bool
	err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3 AND $4 = ANY(attnames))`,
		cfg.Publication, t.Schema, t.Name, column).Scan(&published)
	if err != nil {
		return fmt.Errorf("read publication %q of %s: %w", cfg.Publication, t, err)
	}
	if published {
		return nil
	}
	pub := pgx.Identifier{cfg.Publication}.Sanitize()
	return setupErrorf("column %q of outbox table %s is a generated column, which publication %q does not publish, so every streamed row would lack it: run ALTER PUBLICATION %s SET (publish_generated_columns = stored) (or create the publication with that option); or %s",
		column, t, cfg.Publication, pub, fix)
}

// dropSlotCommand, then a slot's name, drops a slot nothing reads. A
// command, not a field, where the library names fields: no library
// function drops a slot, and walrelay drop (cmd/walrelay) does it as a
// slot must be dropped, after counting the rows it still holds and with
// walrelay's record of it (source.DropRecord).
const dropSlotCommand = "walrelay drop --slot "

// checkFreeSlots refuses to start when the slot must be created and the
// server has too few free replication slots for it: creating it with the
// initial snapshot takes two at once (a temporary slot exports the
// snapshot and the slot is copied from it once the rows are published),
// so without this check the rows are published first and the copy then
// fails on "all replication slots are in use".
func checkFreeSlots(ctx context.Context, conn *pgx.Conn, cfg SetupConfig) error {
	if !cfg.CreateSlot {
		return nil
	}
	if _, err := slot.ReadInfo(ctx, conn, cfg.Slot); !errors.Is(err, slot.ErrNoSlot) {
		return nil // it exists (or the slot checks that follow say why not)
	}
	need := 1
	if cfg.Snapshot != nil {
		need = 2
	}
	var limit, used int
	var names []string
	err := conn.QueryRow(ctx, `SELECT current_setting('max_replication_slots')::int, count(*), coalesce(array_agg(slot_name::text ORDER BY slot_name), '{}')
		FROM pg_replication_slots`).Scan(&limit, &used, &names)
	if err != nil {
		return fmt.Errorf("read replication slots: %w", err)
	}
	if limit-used >= need {
		return nil
	}
	if len(names) > 5 {
		names = append(names[:5], "…")
	}
	what := fmt.Sprintf("creating replication slot %q needs 1 free", cfg.Slot)
	if need == 2 {
		what = fmt.Sprintf("creating replication slot %q with its initial snapshot needs 2 free at once (a temporary slot for the snapshot, then the slot)", cfg.Slot)
	}
	fix := "drop slots nothing reads (" + dropSlotCommand + "<name>), or raise max_replication_slots and restart PostgreSQL"
	if need == 2 {
		fix += ", or start with source.SetupConfig.Snapshot=nil (no snapshot of the rows already there)"
	}
	return setupErrorf("max_replication_slots is %d and %d slots exist (%s): %s; %s", limit, used, strings.Join(names, ", "), what, fix)
}

// publicationNames finds the publication_names option in the text of a
// START_REPLICATION command, as pg_stat_activity shows a walsender's.
var publicationNames = regexp.MustCompile(`(?i)"?publication_names"?\s+'((?:[^']|'')*)'`)

// warnSameTopics warns when another slot of this database is being
// streamed by a walrelay (its application_name carries the topics tag) from
// the same publication to the same topic template: both relays publish
// every event, so consumers get each one twice. Two relays on one slot are
// an active one and a standby and are fine; two slots are not. Only
// streaming slots can be seen, and only a walrelay that named its
// connection itself; nothing is refused (a move from one slot to another
// runs two for a while on purpose).
func warnSameTopics(ctx context.Context, conn *pgx.Conn, cfg SetupConfig, log *zap.Logger) {
	if cfg.TopicTemplate == "" {
		return
	}
	rows, err := conn.Query(ctx, `SELECT s.slot_name::text, coalesce(a.application_name, ''), coalesce(a.query, '')
		FROM pg_replication_slots s JOIN pg_stat_activity a ON a.pid = s.active_pid
		WHERE s.active AND s.slot_type = 'logical' AND s.plugin = 'pgoutput' AND s.database = current_database() AND s.slot_name <> $1`, cfg.Slot)
	if err != nil {
		log.Debug("cannot read the other replication slots' walsenders", zap.Error(err))
		return
	}
	type other struct{ Slot, App, Query string }
	others, err := pgx.CollectRows(rows, pgx.RowToStructByPos[other])
	if err != nil {
		log.Debug("cannot read the other replication slots' walsenders", zap.Error(err))
		return
	}
	tag := slot.TopicsAppName(cfg.TopicTemplate)
	for _, o := range others {
		if o.App != tag {
			continue
		}
		m := publicationNames.FindStringSubmatch(o.Query)
		if m == nil || !slices.Contains(splitPublicationNames(strings.ReplaceAll(m[1], "''", "'")), cfg.Publication) {
			continue
		}
		log.Warn("another walrelay streams the same publication to the same topics from another slot: both publish every event, so consumers receive each one twice; stop one of the relays and drop its slot, or give them different publications (source.SetupConfig.Publication) or topic templates (source.SetupConfig.TopicTemplate)",
			zap.String("slot", cfg.Slot), zap.String("other_slot", o.Slot), zap.String("publication", cfg.Publication),
			zap.String("topic_template", cfg.TopicTemplate), zap.String("fix", dropSlotCommand+o.Slot))
	}
}

// splitPublicationNames splits pgoutput's publication_names value, a
// comma-separated list of identifiers (double-quoted or not).
func splitPublicationNames(s string) []string {
	var out []string
	for _, part := range splitOutsideQuotes(s) {
		part = strings.TrimSpace(part)
		if len(part) >= 2 && part[0] == '"' && part[len(part)-1] == '"' {
			part = strings.ReplaceAll(part[1:len(part)-1], `""`, `"`)
		} else {
			part = strings.ToLower(part)
		}
		out = append(out, part)
	}
	return out
}

// splitOutsideQuotes splits s at the commas outside double quotes.
func splitOutsideQuotes(s string) []string {
	var out []string
	quoted, start := false, 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '"':
			quoted = !quoted
		case ',':
			if !quoted {
				out = append(out, s[start:i])
				start = i + 1
			}
		}
	}
	return append(out, s[start:])
}
