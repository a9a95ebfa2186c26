package slot

import (
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// The publication names of another walsender are read from its
// START_REPLICATION command as pg_stat_activity shows it.
func TestPublicationNamesOfStartReplication(t *testing.T) {
	for query, want := range map[string][]string{
		`START_REPLICATION SLOT "s" LOGICAL 0/0 (proto_version '1', publication_names '"walrelay_outbox"', messages 'true')`: {"walrelay_outbox"},
		`START_REPLICATION SLOT s LOGICAL 0/16B3748 ("proto_version" '1', "publication_names" 'dbz_publication')`:            {"dbz_publication"},
		`START_REPLICATION SLOT s LOGICAL 0/0 (proto_version '1', publication_names '"a,b", c, "Q""x"')`:                     {"a,b", "c", `Q"x`},
		`START_REPLICATION SLOT s LOGICAL 0/0 (publication_names 'MixedCase')`:                                               {"mixedcase"},
	} {
		m := publicationNames.FindStringSubmatch(query)
		if m == nil {
			t.Errorf("no publication_names found in %s", query)
			continue
		}
		if got := splitPublicationNames(m[1]); !slices.Equal(got, want) {
			t.Errorf("publication names of %s = %q, want %q", query, got, want)
		}
	}
}

// Only a name walrelay chose carries the topics tag; the tag tells
// templates apart and fits application_name.
func TestTagApplicationName(t *testing.T) {
	cfg := &pgconn.Config{RuntimeParams: map[string]string{"application_name": "walrelay"}}
	tagApplicationName(cfg, "outbox.event.{aggregate_type}")
	got := cfg.RuntimeParams["application_name"]
	if got != topicsTagPrefix+topicsTag("outbox.event.{aggregate_type}") || len(got) > 63 {
		t.Errorf("application_name %q", got)
	}
	if topicsTag("a.{aggregate_type}") == topicsTag("b.{aggregate_type}") {
		t.Error("two templates with one tag")
	}
	mine := &pgconn.Config{RuntimeParams: map[string]string{"application_name": "orders-relay"}}
	tagApplicationName(mine, "outbox.event.{aggregate_type}")
	if mine.RuntimeParams["application_name"] != "orders-relay" {
		t.Errorf("an operator's application_name was replaced: %q", mine.RuntimeParams["application_name"])
	}
}
