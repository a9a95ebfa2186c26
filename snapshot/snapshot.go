// Package snapshot reads the rows already present in outbox tables and
// turns them into the same events the replication stream produces, for
// the initial snapshot (rows committed before the slot existed) and for
// `walrelay snapshot`.
//
// The rows are read in one REPEATABLE READ, READ ONLY transaction, at a
// snapshot exported by CREATE_REPLICATION_SLOT when one is given: then
// every row committed before the slot's consistent point is read, and every
// later one comes through the slot, none both ways. They are read through
// a cursor, a batch at a time, and handed to a Sender one by one, so memory
// stays bounded by the batch and the sender's own in-flight limit whatever
// the table's size.
//
// Values are the ones pgoutput sends: every mapped column in its type's
// text output form (fetched in the text result format, which is that
// output function's result), except a column of type bytea, which the
// stream decodes to its raw bytes and which is fetched in binary format
// (the raw bytes) here.
package snapshot

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
)

// oidBytea is bytea's type OID; only a column of exactly this type is
// decoded to raw bytes by the stream (a domain over bytea stays text).
const oidBytea = 17

// ErrQuery means PostgreSQL refused a snapshot query for a reason that
// retrying cannot fix: a syntax error in --snapshot-where or
// --snapshot-order, a missing table or column, a missing SELECT privilege.
var ErrQuery = errors.New("snapshot query refused")

// Sender takes the events of a snapshot. Send must hand ev to Kafka before
// it returns (blocking while the producer is full) and must not keep ev or
// its Headers slice, which are reused for the next row; the byte slices of
// ev are the sender's to keep.
type Sender interface {
	Send(ctx context.Context, ev *decoder.Event) error
}

// Config says which rows a snapshot reads and how they become events.
type Config struct {
	// Tables are read one after the other, in this order.
	Tables []decoder.Table
	// Mapping names the columns, as for the stream.
	Mapping decoder.Mapping
	// Where is an SQL condition rows must meet (e.g. "sent_at IS NULL");
	// empty reads every row. It is used as written, in a read-only
	// transaction.
	Where string
	// Order is an SQL ORDER BY list (e.g. "created_at, id"); empty orders
	// by the table's primary key, or leaves the order to PostgreSQL when
	// the table has none (logged).
	Order string
	// BatchRows is how many rows one FETCH reads (default 1000).
	BatchRows int
}

// Result is what a snapshot read.
type Result struct {
	// Rows is the number of rows handed to the sender, over all tables.
	Rows int64
	// Tables is the number of rows per table, in Config.Tables order.
	Tables []int64
	// Time is the record timestamp of every event: the start of the
	// reading transaction, which is when the snapshot was taken.
	Time time.Time
}

// Read reads the rows cfg names on conn, a normal (non-replication)
// connection, at the exported snapshot snapshotName (empty: a new snapshot
// of its own), and hands each row to send as an event. conn must not be
// in a transaction; Read leaves it out of one.
func Read(ctx context.Context, conn *pgx.Conn, snapshotName string, cfg Config, send Sender, log *zap.Logger) (Result, error) {
	if len(cfg.Tables) == 0 {
		return Result{}, errors.New("snapshot: no table")
	}
	if cfg.BatchRows <= 0 {
		cfg.BatchRows = 1000
	}
	tables := append([]decoder.Table(nil), cfg.Tables...) // Event.Table points into it
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return Result{}, fmt.Errorf("snapshot: begin: %w", err)
	}
	defer tx.Rollback(context.Background())
	if snapshotName != "" {
		// The first statement of the transaction, as PostgreSQL requires.
		if _, err := tx.Exec(ctx, "SET TRANSACTION SNAPSHOT "+quoteLiteral(snapshotName)); err != nil {
			return Result{}, fmt.Errorf("snapshot: import exported snapshot %s: %w", snapshotName, err)
		}
	}
	res := Result{Tables: make([]int64, len(tables))}
	if err := tx.QueryRow(ctx, "SELECT now()").Scan(&res.Time); err != nil {
		return Result{}, fmt.Errorf("snapshot: read the time: %w", err)
	}
	res.Time = res.Time.UTC()
	for i := range tables {
		n, err := readTable(ctx, tx, &tables[i], cfg, res.Time, send, log)
		res.Tables[i] = n
		res.Rows += n
		if err != nil {
			return res, err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("snapshot: end the reading transaction: %w", err)
	}
	return res, nil
}

// column is one selected column: the event field it fills.
type column struct {
	name  string
	bytea bool
	dst   *[]byte
}

// plan is the query of one table and where each value goes.
type plan struct {
	query string
	cols  []column
	ev    decoder.Event
}

// readTable reads one table through a cursor.
func readTable(ctx context.Context, tx pgx.Tx, t *decoder.Table, cfg Config, at time.Time, send Sender, log *zap.Logger) (int64, error) {
	p, err := planTable(ctx, tx, t, cfg, log)
	if err != nil {
		return 0, err
	}
	p.ev.Table, p.ev.CommitTime = t, at
	if _, err := tx.Exec(ctx, "DECLARE walrelay_snapshot NO SCROLL CURSOR FOR "+p.query); err != nil {
		return 0, queryError(t, err)
	}
	formats := make([]int16, len(p.cols))
	for i, c := range p.cols {
		if c.bytea {
			formats[i] = pgx.BinaryFormatCode
		}
	}
	fetch := fmt.Sprintf("FETCH FORWARD %d FROM walrelay_snapshot", cfg.BatchRows)
	var n int64
	for {
		rows, err := fetchBatch(ctx, tx.Conn().PgConn(), fetch, formats, p, send, t)
		n += rows
		if err != nil {
			return n, err
		}
		if rows < int64(cfg.BatchRows) {
			break
		}
	}
	if _, err := tx.Exec(ctx, "CLOSE walrelay_snapshot"); err != nil {
		return n, fmt.Errorf("snapshot of %s: close cursor: %w", t, err)
	}
	return n, nil
}

// fetchBatch runs one FETCH and sends its rows.
func fetchBatch(ctx context.Context, conn *pgconn.PgConn, fetch string, formats []int16, p *plan, send Sender, t *decoder.Table) (int64, error) {
	rr := conn.ExecParams(ctx, fetch, nil, nil, nil, formats)
	var n int64
	for rr.NextRow() {
		p.fill(rr.Values())
		if err := send.Send(ctx, &p.ev); err != nil {
			rr.Close()
			return n, err
		}
		n++
	}
	if _, err := rr.Close(); err != nil {
		return n, fmt.Errorf("snapshot of %s: fetch: %w", t, err)
	}
	return n, nil
}

// fill copies one row's values into a buffer of their own and points the
// event's fields into it, as the decoder does: nil for NULL, non-nil
// (possibly empty) otherwise, each capped at its length.
func (p *plan) fill(vals [][]byte) {
	size := 0
	for _, v := range vals {
		size += len(v)
	}
	buf := make([]byte, 0, size)
	for i, c := range p.cols {
		v := vals[i]
		if v == nil {
			*c.dst = nil
			continue
		}
		start := len(buf)
		buf = append(buf, v...)
		*c.dst = buf[start:len(buf):len(buf)]
	}
}

// planTable builds the query of one table: the mapped columns, the
// condition and the order.
func planTable(ctx context.Context, tx pgx.Tx, t *decoder.Table, cfg Config, log *zap.Logger) (*plan, error) {
	ident := pgx.Identifier{t.Schema, t.Name}.Sanitize()
	rows, err := tx.Query(ctx, "SELECT attname, atttypid FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped", ident)
	if err != nil {
		return nil, queryError(t, err)
	}
	types := map[string]uint32{}
	var name string
	var typ uint32
	if _, err := pgx.ForEachRow(rows, []any{&name, &typ}, func() error { types[name] = typ; return nil }); err != nil {
		return nil, queryError(t, err)
	}
	p := &plan{}
	m := cfg.Mapping
	headers := m.HeaderColumns()
	p.ev.Headers = make([]decoder.Header, len(headers))
	add := func(col string, dst *[]byte) { p.cols = append(p.cols, column{name: col, dst: dst}) }
	add(m.ID, &p.ev.ID)
	add(m.AggregateType, &p.ev.AggregateType)
	add(m.AggregateID, &p.ev.AggregateID)
	add(m.Payload, &p.ev.Payload)
	if m.Type != "" {
		add(m.Type, &p.ev.Type)
	}
	for i, h := range headers {
		p.ev.Headers[i].Key = h.Header
		if _, ok := types[h.Column]; ok || !h.Optional {
			add(h.Column, &p.ev.Headers[i].Value)
		} // else a table without the optional column: no header, as for a NULL
	}
	sel := make([]string, len(p.cols))
	for i := range p.cols {
		c := &p.cols[i]
		typ, ok := types[c.name]
		if !ok {
			return nil, fmt.Errorf("%w: snapshot of %s: no column %q: map an existing column (decoder.Mapping)", ErrQuery, t, c.name)
		}
		c.bytea = typ == oidBytea
		sel[i] = pgx.Identifier{c.name}.Sanitize()
	}
	q := "SELECT " + strings.Join(sel, ", ") + " FROM " + ident
	if cfg.Where != "" {
		q += " WHERE (" + cfg.Where + ")"
	}
	order := cfg.Order
	if order == "" {
		if order, err = primaryKey(ctx, tx, ident); err != nil {
			return nil, queryError(t, err)
		}
		if order == "" {
			log.Warn("outbox table has no primary key: snapshot rows come in the order PostgreSQL reads them; set snapshot.Config.Order for a defined order",
				zap.Stringer("table", t))
		}
	}
	if order != "" {
		q += " ORDER BY " + order
	}
	p.query = q
	return p, nil
}

// primaryKey returns the table's primary key columns as an ORDER BY list,
// or "" when it has none.
func primaryKey(ctx context.Context, tx pgx.Tx, ident string) (string, error) {
	rows, err := tx.Query(ctx, `SELECT a.attname FROM pg_index i
		JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
		WHERE i.indrelid = $1::regclass AND i.indisprimary
		ORDER BY array_position(i.indkey::int2[], a.attnum)`, ident)
	if err != nil {
		return "", err
	}
	cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", err
	}
	for i, c := range cols {
		cols[i] = pgx.Identifier{c}.Sanitize()
	}
	return strings.Join(cols, ", "), nil
}

// queryError marks errors of SQLSTATE class 42 (syntax error or access
// rule violation: a bad condition or order, a missing table, column or
// privilege) as ErrQuery, with the fix; other errors pass as they are.
func queryError(t *decoder.Table, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "42") {
		return fmt.Errorf("%w: snapshot of %s: %s (SQLSTATE %s): check the table, the column mapping (decoder.Mapping), the snapshot condition and order, and that the role may SELECT from the table",
			ErrQuery, t, pgErr.Message, pgErr.Code)
	}
	return fmt.Errorf("snapshot of %s: %w", t, err)
}

// quoteLiteral quotes s as an SQL string literal.
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
