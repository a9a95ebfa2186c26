package source

import (
	"strings"
	"testing"

	"github.com/walrelay/walrelay/decoder"
)

func TestSnapshotInProgress(t *testing.T) {
	s, err := parseSnapshot("750:760:752,755")
	if err != nil {
		t.Fatal(err)
	}
	for xid, want := range map[string]bool{
		"0":    false, // no deleter
		"740":  false, // finished before the snapshot: it aborted (a visible row)
		"751":  false, // finished, between xmin and xmax, not in xip
		"752":  true,  // running for the snapshot: may have committed since
		"755":  true,
		"760":  true, // at xmax: not yet finished for the snapshot
		"9000": true, // after: may have begun before the scan read the row
		"junk": true, // unreadable: look again rather than vouch
	} {
		if got := s.inProgress(xid); got != want {
			t.Errorf("inProgress(%s) = %v, want %v", xid, got, want)
		}
	}
	// Around the 32-bit wrap: xids compare modulo 2^32, the snapshot's
	// 64-bit ids cut to 32 bits (xmax 2^33+3 is 3).
	w, err := parseSnapshot("8589934590:8589934595:")
	if err != nil {
		t.Fatal(err)
	}
	for xid, want := range map[string]bool{"4294967295": false, "1": false, "3": true, "4": true} {
		if got := w.inProgress(xid); got != want {
			t.Errorf("across the wrap: inProgress(%s) = %v, want %v", xid, got, want)
		}
	}
	if _, err := parseSnapshot("1:2"); err == nil {
		t.Error("a snapshot without its xip part parsed")
	}
}

func u32(v uint32) *uint32 { return &v }
func str(v string) *string { return &v }
func bln(v bool) *bool     { return &v }

// intactRow is a recorded table's row of a check that finds it published.
func intactRow() watchRow {
	return watchRow{
		snapshot: "10:10:", pubOID: u32(100), pubXmin: str("5"), pubXmax: str("0"),
		insert: bln(true), allTables: bln(false), viaRoot: bln(true),
		relOID: u32(200), relXmax: str("0"), nsXmax: str("0"), relKind: str("r"), schema: str("public"), name: str("outbox"),
		memberOID: u32(300), memberXmax: str("0"),
	}
}

func TestWatchJudge(t *testing.T) {
	w := NewWatch(SetupConfig{Publication: "pub", Columns: []string{"id", "payload"}},
		Record{PublicationOID: 100, Tables: []RecordedTable{{Table: decoder.Table{Schema: "public", Name: "outbox"}, OID: 200, MemberOID: 300}}}, nil)
	if gap := w.judge([]watchRow{intactRow()}); gap != nil {
		t.Fatalf("an intact publication judged changed: %v", gap)
	}
	for name, tc := range map[string]struct {
		edit func(r *watchRow)
		want string
	}{
		"dropped":            {func(r *watchRow) { r.pubOID = nil }, "was dropped"},
		"recreated":          {func(r *watchRow) { r.pubOID = u32(101) }, "dropped and created again"},
		"publish update":     {func(r *watchRow) { r.insert = bln(false) }, "stopped publishing inserts"},
		"table dropped":      {func(r *watchRow) { r.relOID = nil }, "outbox table public.outbox was dropped"},
		"table renamed":      {func(r *watchRow) { r.name = str("outbox_old") }, "renamed to public.outbox_old"},
		"removed":            {func(r *watchRow) { r.memberOID = nil }, "was removed from publication"},
		"removed and re-add": {func(r *watchRow) { r.memberOID = u32(301) }, "and added again"},
		"via root off":       {func(r *watchRow) { r.relKind = str("p"); r.viaRoot = bln(false) }, "publish_via_partition_root = false"},
		"row filter":         {func(r *watchRow) { r.rowFilter = str("(seq > 0)") }, "row filter"},
		"column list":        {func(r *watchRow) { r.columns = []string{"id"} }, `without column "payload"`},
	} {
		r := intactRow()
		tc.edit(&r)
		gap := w.judge([]watchRow{r})
		if gap == nil || !strings.Contains(gap.Error(), tc.want) {
			t.Errorf("%s: judged %v, want a gap naming %q", name, gap, tc.want)
		}
	}
	// FOR ALL TABLES and TABLES IN SCHEMA publish without a membership row.
	r := intactRow()
	r.memberOID, r.allTables = nil, bln(true)
	if gap := w.judge([]watchRow{r}); gap != nil {
		t.Errorf("FOR ALL TABLES judged changed: %v", gap)
	}
	r = intactRow()
	r.memberOID, r.schemaMember = nil, u32(400)
	if gap := w.judge([]watchRow{r}); gap != nil {
		t.Errorf("TABLES IN SCHEMA judged changed: %v", gap)
	}
}
