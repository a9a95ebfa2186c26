package source

// watch.go: noticing, while streaming, that the publication stopped
// publishing an outbox table, before the slot is confirmed past what it
// skipped.
//
// pgoutput reads the publication as of each change it decodes. An ALTER
// PUBLICATION ... SET (publish = ...), an outbox table dropped from the
// publication, or dropped and created again (PostgreSQL takes a dropped
// table out of its publications), makes it skip the table's inserts from
// that commit on, without a word; the relay would confirm keepalives past
// them and the slot would no longer hold their WAL. So the relay confirms
// a position only once a check has found the publication intact at or
// after it.
//
// A check reads the server's WAL position L first, then, in one statement
// and so one snapshot S, the catalog rows that decide what is published.
// A change committed before L is either visible in S, or was still
// finishing when S was taken (its commit record written, its transaction
// not yet visible, as while a synchronous commit waits for a standby):
// then the catalog row it replaces or deletes is visible in S with that
// transaction as its xmax, one S counts as in progress. Such a check says
// nothing (the next one will), and a check that sees every row settled and
// intact vouches for everything before L.

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// Watch checks that a publication still publishes the recorded outbox
// tables. It is used by one goroutine at a time.
type Watch struct {
	cfg     SetupConfig
	rec     Record
	version int
	// pubXmin is the publication row's xmin seen last: it changes with
	// every ALTER PUBLICATION ... SET, harmless ones included.
	pubXmin string
	log     *zap.Logger
}

// NewWatch watches what rec says the slot streams from, as cfg requires
// it (the columns, whether a row filter is allowed).
func NewWatch(cfg SetupConfig, rec Record, log *zap.Logger) *Watch {
	return &Watch{cfg: cfg, rec: rec, log: log}
}

// watchRow is one recorded outbox table as the check's snapshot shows it.
type watchRow struct {
	snapshot                   string
	pubOID                     *uint32
	pubXmin, pubXmax           *string
	insert, allTables, viaRoot *bool
	relOID                     *uint32
	relXmax, nsXmax            *string
	relKind, schema, name      *string
	memberOID                  *uint32
	memberXmax                 *string
	rowFilter                  *string
	columns                    []string
	schemaMember               *uint32
	schemaMemberXmax           *string
}

// Check returns the WAL position up to which the publication is known to
// have published the outbox tables as recorded; ok is false when a change
// to them was still in progress (try again soon). A *slot.GapError says what
// changed (its Since is for the caller to set: the last position it
// confirmed); other errors are the connection's.
func (w *Watch) Check(ctx context.Context, conn *pgx.Conn) (at decoder.LSN, ok bool, err error) {
	if w.version == 0 {
		if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&w.version); err != nil {
			return 0, false, fmt.Errorf("read server version: %w", err)
		}
	}
	var l string
	if err := conn.QueryRow(ctx, "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END::text").Scan(&l); err != nil {
		return 0, false, fmt.Errorf("read the WAL position: %w", err)
	}
	if at, err = slot.ParseLSN(l); err != nil {
		return 0, false, err
	}
	rows, err := w.read(ctx, conn)
	if err != nil {
		return 0, false, err
	}
	snap, err := parseSnapshot(rows[0].snapshot)
	if err != nil {
		return 0, false, err
	}
	for _, r := range rows {
		for _, x := range []*string{r.pubXmax, r.relXmax, r.nsXmax, r.memberXmax, r.schemaMemberXmax} {
			if x != nil && snap.inProgress(*x) {
				return 0, false, nil
			}
		}
	}
	if gap := w.judge(rows); gap != nil {
		return 0, false, gap
	}
	if x := *rows[0].pubXmin; w.pubXmin != "" && x != w.pubXmin {
		w.log.Warn("publication altered while streaming; it still publishes the outbox tables' inserts", zap.String("publication", w.cfg.Publication))
	}
	w.pubXmin = *rows[0].pubXmin
	return at, true, nil
}

// read is the check's one statement: every recorded table's catalog rows,
// with the statement's snapshot.
func (w *Watch) read(ctx context.Context, conn *pgx.Conn) ([]watchRow, error) {
	oids := make([]uint32, len(w.rec.Tables))
	for i, t := range w.rec.Tables {
		oids[i] = t.OID
	}
	viaRoot := "p.pubviaroot"
	if w.version < 130000 {
		viaRoot = "false"
	}
	filter, columns, schemaJoin, schemaCols := "NULL::text", "NULL::text[]", "", "NULL::oid, NULL::text"
	if w.version >= 150000 {
		filter = "pg_get_expr(r.prqual, r.prrelid)"
		columns = "(SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a WHERE a.attrelid = r.prrelid AND a.attnum = ANY(r.prattrs::int2[]))"
		schemaJoin = "LEFT JOIN pg_publication_namespace pn ON pn.pnpubid = p.oid AND pn.pnnspid = c.relnamespace"
		schemaCols = "pn.oid, pn.xmax::text"
	}
	q := `SELECT pg_current_snapshot()::text, p.oid, p.xmin::text, p.xmax::text, p.pubinsert, p.puballtables, ` + viaRoot + `,
			c.oid, c.xmax::text, n.xmax::text, c.relkind::text, n.nspname::text, c.relname::text,
			r.oid, r.xmax::text, ` + filter + `, ` + columns + `, ` + schemaCols + `
		FROM unnest($2::oid[]) WITH ORDINALITY AS t(relid, ord)
		LEFT JOIN pg_publication p ON p.pubname = $1
		LEFT JOIN pg_class c ON c.oid = t.relid
		LEFT JOIN pg_namespace n ON n.oid = c.relnamespace
		LEFT JOIN pg_publication_rel r ON r.prpubid = p.oid AND r.prrelid = t.relid
		` + schemaJoin + `
		ORDER BY t.ord`
	rs, err := conn.Query(ctx, q, w.cfg.Publication, oids)
	if err != nil {
		return nil, fmt.Errorf("read publication %q: %w", w.cfg.Publication, err)
	}
	defer rs.Close()
	var out []watchRow
	for rs.Next() {
		var r watchRow
		if err := rs.Scan(&r.snapshot, &r.pubOID, &r.pubXmin, &r.pubXmax, &r.insert, &r.allTables, &r.viaRoot,
			&r.relOID, &r.relXmax, &r.nsXmax, &r.relKind, &r.schema, &r.name,
			&r.memberOID, &r.memberXmax, &r.rowFilter, &r.columns, &r.schemaMember, &r.schemaMemberXmax); err != nil {
			return nil, fmt.Errorf("read publication %q: %w", w.cfg.Publication, err)
		}
		out = append(out, r)
	}
	if err := rs.Err(); err != nil {
		return nil, fmt.Errorf("read publication %q: %w", w.cfg.Publication, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("read publication %q: no outbox table recorded", w.cfg.Publication)
	}
	return out, nil
}

// judge returns what changed, or nil when the rows still publish every
// recorded table's inserts under its own name.
func (w *Watch) judge(rows []watchRow) *slot.GapError {
	pub := w.cfg.Publication
	ident := pgx.Identifier{pub}.Sanitize()
	first := rows[0]
	switch {
	case first.pubOID == nil:
		return &slot.GapError{What: fmt.Sprintf("publication %q was dropped while walrelay streamed from it", pub)}
	case *first.pubOID != w.rec.PublicationOID:
		return &slot.GapError{What: fmt.Sprintf("publication %q was dropped and created again while walrelay streamed from it (OID %d, now %d)", pub, w.rec.PublicationOID, *first.pubOID)}
	case !*first.insert:
		return &slot.GapError{What: fmt.Sprintf("publication %q stopped publishing inserts while walrelay streamed from it", pub),
			Fix: fmt.Sprintf("restore it with ALTER PUBLICATION %s SET (publish = 'insert')", ident)}
	}
	for i, r := range rows {
		t := w.rec.Tables[i]
		member := *first.allTables || r.memberOID != nil || r.schemaMember != nil
		switch {
		case r.relOID == nil:
			return &slot.GapError{What: fmt.Sprintf("outbox table %s was dropped while walrelay streamed from it", t.Table)}
		case *r.schema != t.Table.Schema || *r.name != t.Table.Name:
			return &slot.GapError{What: fmt.Sprintf("outbox table %s was renamed to %s while walrelay streamed from it: its inserts arrive under a name source.SetupConfig.Tables does not list", t.Table, decoder.Table{Schema: *r.schema, Name: *r.name})}
		case !member:
			return &slot.GapError{What: fmt.Sprintf("outbox table %s was removed from publication %q while walrelay streamed from it", t.Table, pub)}
		case t.MemberOID != 0 && r.memberOID != nil && *r.memberOID != t.MemberOID:
			return &slot.GapError{What: fmt.Sprintf("outbox table %s was removed from publication %q and added again while walrelay streamed from it", t.Table, pub)}
		case *r.relKind == "p" && !*first.viaRoot:
			return &slot.GapError{What: fmt.Sprintf("publication %q stopped publishing partitioned outbox table %s via its root (publish_via_partition_root = false) while walrelay streamed from it: its rows arrive under the partitions' names", pub, t.Table),
				Fix: fmt.Sprintf("restore it with ALTER PUBLICATION %s SET (publish_via_partition_root = true)", ident)}
		case r.rowFilter != nil && !w.cfg.AllowRowFilter:
			return &slot.GapError{What: fmt.Sprintf("publication %q got a row filter on outbox table %s (WHERE %s) while walrelay streamed from it: rows it filters out are not published", pub, t.Table, *r.rowFilter)}
		}
		if r.columns != nil {
			for _, c := range w.cfg.Columns {
				if !slices.Contains(r.columns, c) {
					return &slot.GapError{What: fmt.Sprintf("publication %q got a column list on outbox table %s without column %q, which walrelay maps, while walrelay streamed from it", pub, t.Table, c)}
				}
			}
		}
	}
	return nil
}

// snapshot is pg_current_snapshot() with its transaction ids cut to the
// 32 bits a tuple's xmax holds.
type snapshot struct {
	xmin, xmax uint32
	xip        []uint32
}

func parseSnapshot(s string) (snapshot, error) {
	var snap snapshot
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return snap, fmt.Errorf("snapshot %q: want xmin:xmax:xip", s)
	}
	cut := func(v string) (uint32, error) {
		n, err := strconv.ParseUint(v, 10, 64)
		return uint32(n), err
	}
	var err error
	if snap.xmin, err = cut(parts[0]); err != nil {
		return snap, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if snap.xmax, err = cut(parts[1]); err != nil {
		return snap, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if parts[2] != "" {
		for _, x := range strings.Split(parts[2], ",") {
			v, err := cut(x)
			if err != nil {
				return snap, fmt.Errorf("snapshot %q: %w", s, err)
			}
			snap.xip = append(snap.xip, v)
		}
	}
	return snap, nil
}

// inProgress reports whether the transaction id xid (a tuple's xmax, as
// text) had not finished for the snapshot: it may have committed since,
// at a WAL position before the check's. A finished one that a visible row
// names as its xmax aborted, or only locked the row: harmless. 0 is none.
func (s snapshot) inProgress(xid string) bool {
	n, err := strconv.ParseUint(xid, 10, 32)
	if err != nil || n == 0 {
		return err != nil // unreadable: assume the worst, look again
	}
	x := uint32(n)
	// Transaction ids compare modulo 2^32, as PostgreSQL's do.
	if int32(x-s.xmax) >= 0 {
		return true
	}
	return slices.Contains(s.xip, x)
}
