package inbox

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/jackc/pgx/v5/pgxpool"
)

func TestNewNamesTheMissingField(t *testing.T) {
	pool := &pgxpool.Pool{} // never used: New only checks it is there
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{Topics: []string{"t"}, DB: pool}, "Group"},
		{Config{Group: "g", DB: pool}, "Topics"},
		{Config{Group: "g", Topics: []string{"t"}}, "DB"},
	} {
		if _, err := New(c.cfg, noop); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New(%+v) = %v, want an error naming %s", c.cfg, err, c.want)
		}
	}
	c, err := New(Config{Group: "g", Topics: []string{"t"}, DB: pool}, noop)
	if err != nil {
		t.Fatal(err)
	}
	if c.cfg.Name != "g" || c.cfg.DeadLetterTopic != "g.dlq" || c.cfg.MaxAttempts != 5 || c.inbox != `"inbox"` || c.attempt != `"inbox_attempts"` {
		t.Errorf("defaults: %+v, tables %s %s", c.cfg, c.inbox, c.attempt)
	}
}

func TestTableNamesWithSchema(t *testing.T) {
	in, at, off := tableNames("shipping.inbox")
	if in != `"shipping"."inbox"` || at != `"shipping"."inbox_attempts"` || off != `"shipping"."inbox_offsets"` {
		t.Errorf("got %s, %s and %s", in, at, off)
	}
	if ddl := DDL("shipping.inbox"); !strings.Contains(ddl, `INDEX IF NOT EXISTS "inbox_processed_at" ON "shipping"."inbox"`) {
		t.Errorf("the index must be named without the schema (it lives in the table's):\n%s", ddl)
	}
}

func TestIdempotencyKeyPartsDoNotRunTogether(t *testing.T) {
	if IdempotencyKey("a", "bc", "d") == IdempotencyKey("ab", "c", "d") {
		t.Error("different consumer/message splits gave the same key")
	}
}

var noop Handler = func(ctx context.Context, tx pgx.Tx, m *Message) error { return nil }

// TestWithDefaults: the batch knobs' defaults, as Config's docs name
// them, and a value given is kept (negative MaxBatchTime: no bound).
func TestWithDefaults(t *testing.T) {
	d := Config{Group: "g"}.WithDefaults()
	if d.MaxBatchRecords != 500 || d.MaxBatchBytes != 1<<20 || d.MaxBatchTime != 100*time.Millisecond || d.Workers != 4 ||
		d.MaxPollRecords != 5000 || d.CommitInterval != time.Second {
		t.Errorf("defaults %+v", d)
	}
	set := Config{Group: "g", MaxBatchRecords: 1, MaxBatchTime: -1, Workers: 16}.WithDefaults()
	if set.MaxBatchRecords != 1 || set.MaxBatchTime != -1 || set.Workers != 16 {
		t.Errorf("values given were not kept: %+v", set)
	}
}
