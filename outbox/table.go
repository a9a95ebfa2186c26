package outbox

import (
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Table describes an outbox table in the shape walrelay maps by default
// (id, aggregate_type, aggregate_id, type, payload).
type Table struct {
	// Name is "table" (in schema public) or "schema.table"; empty means
	// public.outbox, walrelay's default --tables.
	Name string
	// BytesPayload makes payload a bytea column (any bytes) instead of
	// jsonb (JSON text).
	BytesPayload bool
	// HeaderColumns are extra text columns that become record headers
	// when walrelay maps them (--header-column tenant=tenant).
	HeaderColumns []string
	// NoTraceColumns leaves the trace context columns, traceparent and
	// tracestate, out of DDL, and keeps the Writer from writing them. By
	// default the table has them (walrelay sends them as the record's W3C
	// trace headers); a table created without them works either way: the
	// Writer writes only the trace columns the table has.
	NoTraceColumns bool
}

func (t Table) schemaName() (string, string) {
	n := t.Name
	if n == "" {
		n = "public.outbox"
	}
	if s, name, ok := strings.Cut(n, "."); ok {
		return s, name
	}
	return "public", n
}

// name is the quoted, schema-qualified table name.
func (t Table) name() string {
	s, n := t.schemaName()
	return pgx.Identifier{s, n}.Sanitize()
}

func (t Table) hasHeader(c string) bool { return slices.Contains(t.HeaderColumns, c) }

func (t Table) check() error {
	for _, c := range t.HeaderColumns {
		if !columnName.MatchString(c) {
			return fmt.Errorf("outbox: header column %q: use a lower-case SQL name (letters, digits, _)", c)
		}
		switch c {
		case "id", "aggregate_type", "aggregate_id", "type", "payload", "created_at":
			return fmt.Errorf("outbox: header column %q is one of the outbox's own columns: choose another name", c)
		}
	}
	return nil
}

// DDL is the CREATE TABLE statement of the table: the outbox columns,
// the trace context columns (unless NoTraceColumns), then the
// HeaderColumns. With the zero Table it is exactly the statement in
// walrelay's deploy/outbox.sql and README.
func (t Table) DDL() string {
	payload := "jsonb"
	if t.BytesPayload {
		payload = "bytea"
	}
	var b strings.Builder
	fmt.Fprintf(&b, `CREATE TABLE %s (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    type           text        NOT NULL,
    payload        %s,
    created_at     timestamptz NOT NULL DEFAULT now()`, t.name(), payload)
	cols := t.HeaderColumns
	if !t.NoTraceColumns {
		cols = append(slices.Clone(traceColumns), slices.DeleteFunc(slices.Clone(cols), func(c string) bool { return slices.Contains(traceColumns, c) })...)
	}
	for _, c := range cols {
		fmt.Fprintf(&b, ",\n    %-14s text", c)
	}
	b.WriteString("\n);")
	return b.String()
}

// PublicationDDL is the CREATE PUBLICATION statement walrelay runs when
// the publication is missing (and allowed to create it): INSERTs only,
// so the delete of the write pattern is never sent.
func (t Table) PublicationDDL(publication string) string {
	return fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert');",
		pgx.Identifier{publication}.Sanitize(), t.name())
}
