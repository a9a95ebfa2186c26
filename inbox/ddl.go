package inbox

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// DDL creates the inbox table and its attempts table (named table and
// table_attempts; "schema.table" is allowed) when they are missing.
//
// The inbox row is written in the handler's transaction; its primary key
// is what turns a second copy of a message into a no-op. The attempts row
// is written outside it, because it must survive the handler's rollback.
func DDL(table string) string {
	t, a := tableNames(table)
	idx := pgx.Identifier{lastPart(table) + "_processed_at"}.Sanitize()
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    outcome      text        NOT NULL DEFAULT 'processed',
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS %s ON %s (consumer, processed_at);
CREATE TABLE IF NOT EXISTS %s (
    consumer   text        NOT NULL,
    message_id text        NOT NULL,
    attempts   int         NOT NULL,
    last_error text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);`, t, idx, t, a)
}

func lastPart(table string) string {
	if i := strings.LastIndexByte(table, '.'); i >= 0 {
		return table[i+1:]
	}
	return table
}

// tableNames are the quoted names of the inbox and attempts tables.
func tableNames(table string) (string, string) {
	parts := strings.SplitN(table, ".", 2)
	a := append([]string(nil), parts...)
	a[len(a)-1] += "_attempts"
	return pgx.Identifier(parts).Sanitize(), pgx.Identifier(a).Sanitize()
}
