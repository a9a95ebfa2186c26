package inbox

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// DDL creates the inbox table, its attempts table and its offsets table
// (named table, table_attempts and table_offsets; "schema.table" is
// allowed) when they are missing. Run it again after upgrading: it only
// adds what is missing.
//
// The inbox row is written in the handler's transaction; its primary key
// is what turns a second copy of a message into a no-op. The attempts row
// is written outside it, because it must survive the handler's rollback.
// The offsets row, the group's next offset in each partition, is written
// in the handler's transaction too, so that the database's position and
// its effects can only be lost together (see the package documentation).
func DDL(table string) string {
	t, a, o := tableNames(table)
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
);
CREATE TABLE IF NOT EXISTS %s (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      int         NOT NULL,
    next_offset    bigint      NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition)
);`, t, idx, t, a, o)
}

func lastPart(table string) string {
	if i := strings.LastIndexByte(table, '.'); i >= 0 {
		return table[i+1:]
	}
	return table
}

// tableNames are the quoted names of the inbox, attempts and offsets
// tables.
func tableNames(table string) (inbox, attempts, offsets string) {
	parts := strings.SplitN(table, ".", 2)
	suffixed := func(suffix string) string {
		a := append([]string(nil), parts...)
		a[len(a)-1] += suffix
		return pgx.Identifier(a).Sanitize()
	}
	return pgx.Identifier(parts).Sanitize(), suffixed("_attempts"), suffixed("_offsets")
}
