package source

// publication_test.go: the decisions of publication.go that need no
// database (what is refused, what is said, the SQL each refusal names);
// test/integration checks the same against a real server.

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

var (
	outboxTable = decoder.Table{Schema: "public", Name: "outbox"}
	otherTable  = decoder.Table{Schema: "Sales", Name: "Order Events"}
)

// observed is a logger whose warnings the test reads.
func observed() (*zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.WarnLevel)
	return zap.New(core), logs
}

// wantRefusal fails unless err is a *slot.SetupError whose text holds every
// part of want.
func wantRefusal(t *testing.T, err error, want ...string) {
	t.Helper()
	if !slot.IsSetupError(err) {
		t.Fatalf("got %v (%T), want a setup refusal", err, err)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("refusal %q does not say %q", err, w)
		}
	}
}

func TestCreateOptions(t *testing.T) {
	for version, want := range map[int]string{
		120000: "publish = 'insert'", // publish_via_partition_root came with 13
		130000: "publish = 'insert', publish_via_partition_root = true",
		180000: "publish = 'insert', publish_via_partition_root = true",
	} {
		if got := createOptions(version); got != want {
			t.Errorf("createOptions(%d) = %q, want %q", version, got, want)
		}
	}
}

// Names are quoted as identifiers, whatever their case or characters.
func TestTableAndIdentLists(t *testing.T) {
	if got, want := tableList([]decoder.Table{outboxTable, otherTable}), `"public"."outbox", "Sales"."Order Events"`; got != want {
		t.Errorf("tableList = %s, want %s", got, want)
	}
	if got, want := identList([]string{"id", `we"ird`, "Payload"}), `"id", "we""ird", "Payload"`; got != want {
		t.Errorf("identList = %s, want %s", got, want)
	}
	if got, want := addTablesSQL(SetupConfig{Publication: "Pub"}, []PublishedTable{{Table: outboxTable}, {Table: otherTable}}),
		`ALTER PUBLICATION "Pub" ADD TABLE "public"."outbox", "Sales"."Order Events"`; got != want {
		t.Errorf("addTablesSQL = %s, want %s", got, want)
	}
}

func TestCheckPublished(t *testing.T) {
	cfg := SetupConfig{Publication: "pub", Columns: []string{"id", "aggregate_type", "payload"}}
	t.Run("every column", func(t *testing.T) {
		log, logs := observed()
		for _, cols := range [][]string{nil, {"id", "aggregate_type", "payload", "extra"}} {
			if err := checkPublished(cfg, PublishedTable{Table: outboxTable, Published: true, Columns: cols}, log); err != nil {
				t.Errorf("columns %q: %v", cols, err)
			}
		}
		if logs.Len() != 0 {
			t.Errorf("warned: %v", logs.All())
		}
	})
	t.Run("column list without a mapped column", func(t *testing.T) {
		err := checkPublished(cfg, PublishedTable{Table: outboxTable, Published: true, Columns: []string{"id", "aggregate_type"}}, zap.NewNop())
		wantRefusal(t, err, `column "payload"`, "public.outbox", "its column list: id, aggregate_type",
			`ALTER PUBLICATION "pub" DROP TABLE "public"."outbox"`, `ALTER PUBLICATION "pub" ADD TABLE "public"."outbox" ("id", "aggregate_type", "payload")`)
	})
	t.Run("row filter", func(t *testing.T) {
		pt := PublishedTable{Table: outboxTable, Published: true, RowFilter: "(type <> 'internal'::text)"}
		err := checkPublished(cfg, pt, zap.NewNop())
		wantRefusal(t, err, "row filter", "WHERE (type <> 'internal'::text)", "never published",
			`ALTER PUBLICATION "pub" DROP TABLE "public"."outbox", then ALTER PUBLICATION "pub" ADD TABLE "public"."outbox"`)

		allowed := cfg
		allowed.AllowRowFilter = true
		log, logs := observed()
		if err := checkPublished(allowed, pt, log); err != nil {
			t.Fatalf("allowed row filter refused: %v", err)
		}
		warned := logs.FilterMessageSnippet("row filter").All()
		if len(warned) != 1 || warned[0].ContextMap()["row_filter"] != pt.RowFilter || warned[0].ContextMap()["table"] != "public.outbox" {
			t.Errorf("want one warning naming the table and the filter, got %v", logs.All())
		}
	})
}

func TestPublicationRefusal(t *testing.T) {
	published := PublishedTable{Table: outboxTable, Published: true}
	lacking := PublishedTable{Table: otherTable}
	addOther := `ALTER PUBLICATION "pub" ADD TABLE "Sales"."Order Events"`
	for _, tc := range []struct {
		name    string
		cfg     SetupConfig
		pub     Publication
		refused []string // parts of the refusal; nil: accepted
		warned  string   // part of the one warning; empty: none
	}{
		{name: "as it should be",
			pub: Publication{Insert: true, Owned: true, Tables: []PublishedTable{published}}},
		{name: "no inserts",
			pub:     Publication{Insert: false, Tables: []PublishedTable{published}},
			refused: []string{"does not publish inserts", `ALTER PUBLICATION "pub" SET (publish = 'insert')`}},
		{name: "for all tables",
			pub:    Publication{Insert: true, AllTables: true, Tables: []PublishedTable{published}},
			warned: "FOR ALL TABLES"},
		{name: "partitioned, sent as its partitions",
			pub:     Publication{Insert: true, Tables: []PublishedTable{{Table: outboxTable, Partitioned: true, AsPartitions: true}}},
			refused: []string{"partitioned outbox table public.outbox", `ALTER PUBLICATION "pub" SET (publish_via_partition_root = true)`}},
		{name: "partitioned, not published, not via the root",
			cfg:     SetupConfig{CreatePublication: true},
			pub:     Publication{Insert: true, Owned: true, Tables: []PublishedTable{{Table: outboxTable, Partitioned: true}}},
			refused: []string{"publish_via_partition_root = true"}},
		{name: "partitioned, not published yet, via the root: added",
			cfg: SetupConfig{CreatePublication: true},
			pub: Publication{Insert: true, Owned: true, ViaRoot: true, Tables: []PublishedTable{{Table: outboxTable, Partitioned: true}}}},
		{name: "walrelay's, lacking a table, may add it",
			cfg: SetupConfig{CreatePublication: true},
			pub: Publication{Insert: true, Owned: true, Tables: []PublishedTable{published, lacking}}},
		{name: "walrelay's, lacking a table, may not create",
			pub:     Publication{Insert: true, Owned: true, Tables: []PublishedTable{published, lacking}},
			refused: []string{"lacks outbox tables", addOther}},
		{name: "another's, lacking a table",
			cfg:     SetupConfig{CreatePublication: true},
			pub:     Publication{Insert: true, Tables: []PublishedTable{published, lacking}},
			refused: []string{"not created by walrelay", "shared with other subscribers", addOther}},
		{name: "another's, lacking a table, may alter",
			cfg: SetupConfig{AlterPublication: true},
			pub: Publication{Insert: true, Tables: []PublishedTable{published, lacking}}},
		{name: "a published table's refusal comes before the missing ones",
			cfg:     SetupConfig{Columns: []string{"payload"}},
			pub:     Publication{Insert: true, Tables: []PublishedTable{lacking, {Table: outboxTable, Published: true, Columns: []string{"id"}}}},
			refused: []string{`column "payload"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Publication = "pub"
			log, logs := observed()
			err := publicationRefusal(tc.cfg, tc.pub, nil, log)
			if tc.refused != nil {
				wantRefusal(t, err, tc.refused...)
			} else if err != nil {
				t.Fatalf("refused: %v", err)
			}
			switch {
			case tc.warned == "" && logs.Len() != 0:
				t.Errorf("warned: %v", logs.All())
			case tc.warned != "" && logs.FilterMessageSnippet(tc.warned).Len() != 1:
				t.Errorf("want one warning saying %q, got %v", tc.warned, logs.All())
			}
		})
	}
}

// What ensurePublication adds once publicationRefusal accepted: the
// tables the publication does not publish, in the configured order.
func TestUnpublished(t *testing.T) {
	third := decoder.Table{Schema: "public", Name: "outbox2"}
	got := unpublished(Publication{Tables: []PublishedTable{{Table: otherTable}, {Table: outboxTable, Published: true}, {Table: third}}})
	if len(got) != 2 || got[0].Table != otherTable || got[1].Table != third {
		t.Errorf("unpublished = %v, want %s and %s", got, otherTable, third)
	}
}

// Without CreatePublication the refusal names the statement that would
// create it, before any query (the connection is not used).
func TestCreatePublicationRefusal(t *testing.T) {
	cfg := SetupConfig{Publication: "Outbox Pub", Tables: []decoder.Table{outboxTable, otherTable}}
	for version, with := range map[int]string{120000: "publish = 'insert'", 160000: "publish = 'insert', publish_via_partition_root = true"} {
		err := createPublication(context.Background(), nil, cfg, Publication{version: version}, zap.NewNop())
		wantRefusal(t, err, `publication "Outbox Pub" does not exist`,
			`CREATE PUBLICATION "Outbox Pub" FOR TABLE "public"."outbox", "Sales"."Order Events" WITH (`+with+`)`)
	}
}

// A refused ALTER PUBLICATION is a refusal naming the privileges; another
// failure stays an error retrying may fix, wrapping the server's.
func TestPublicationError(t *testing.T) {
	cfg := SetupConfig{Publication: "pub"}
	sql := `ALTER PUBLICATION "pub" ADD TABLE "public"."outbox"`
	denied := &pgconn.PgError{Code: "42501", Message: "must be owner of publication pub"}
	err := publicationError(context.Background(), nil, cfg, "alter", sql, denied)
	wantRefusal(t, err, "cannot add tables", "must be owner of publication pub", "ownership of the publication and of the tables", sql)

	for _, other := range []error{&pgconn.PgError{Code: "40P01", Message: "deadlock detected"}, errors.New("conn closed")} {
		err := publicationError(context.Background(), nil, cfg, "alter", sql, other)
		if slot.IsSetupError(err) || !errors.Is(err, other) || !strings.Contains(err.Error(), `alter publication "pub"`) {
			t.Errorf("publicationError(%v) = %v, want it wrapped, not a refusal", other, err)
		}
	}
}
