package source

import (
	"slices"
	"testing"
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
