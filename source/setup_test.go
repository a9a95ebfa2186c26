package source

// setup_test.go: the decisions of setup.go that need no database: which
// records describe the same source, what a changed publication means for
// the slot, which slots are refused, the slot's creation command.

import (
	"strings"
	"testing"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

func TestSameSource(t *testing.T) {
	base := Record{Slot: "s", Publication: "pub", PublicationOID: 10, PublicationXmin: "700", SystemID: "7300",
		Tables: []RecordedTable{{Table: outboxTable, OID: 20, MemberOID: 30}}, ConfirmedLSN: 100}
	moved := base
	moved.ConfirmedLSN, moved.UpdatedAt = 900, moved.UpdatedAt.AddDate(0, 0, 1)
	if !sameSource(base, moved) {
		t.Error("a record that only confirmed further is another source")
	}
	for what, change := range map[string]func(*Record){
		"publication":     func(r *Record) { r.Publication = "other" },
		"publication OID": func(r *Record) { r.PublicationOID = 11 },
		"publication row": func(r *Record) { r.PublicationXmin = "701" },
		"system":          func(r *Record) { r.SystemID = "7301" },
		"table OID":       func(r *Record) { r.Tables = []RecordedTable{{Table: outboxTable, OID: 21, MemberOID: 30}} },
		"membership":      func(r *Record) { r.Tables = []RecordedTable{{Table: outboxTable, OID: 20, MemberOID: 31}} },
		"another table":   func(r *Record) { r.Tables = append(r.Tables, RecordedTable{Table: otherTable}) },
	} {
		other := base
		other.Tables = append([]RecordedTable(nil), base.Tables...)
		change(&other)
		if sameSource(base, other) {
			t.Errorf("another %s is the same source", what)
		}
	}
}

func TestCreateSlotCommand(t *testing.T) {
	for _, tc := range []struct {
		name     string
		failover bool
		want     string
	}{
		{"walrelay", false, `CREATE_REPLICATION_SLOT "walrelay" LOGICAL pgoutput NOEXPORT_SNAPSHOT`},
		{`My "Slot"`, false, `CREATE_REPLICATION_SLOT "My ""Slot""" LOGICAL pgoutput NOEXPORT_SNAPSHOT`},
		{"walrelay", true, `CREATE_REPLICATION_SLOT "walrelay" LOGICAL pgoutput (SNAPSHOT 'nothing', FAILOVER true)`},
	} {
		if got := createSlotCommand(tc.name, tc.failover); got != tc.want {
			t.Errorf("createSlotCommand(%q, %v) = %s, want %s", tc.name, tc.failover, got, tc.want)
		}
	}
}

// What a publication changed since the record means for the slot: each
// replacement or removal is a gap from since; an ALTER that still
// publishes the outbox only a warning.
func TestPublicationGap(t *testing.T) {
	const since = decoder.LSN(0x16B3748)
	rec := Record{Publication: "pub", PublicationOID: 10, PublicationXmin: "700"}
	recorded := map[decoder.Table]RecordedTable{outboxTable: {Table: outboxTable, OID: 20, MemberOID: 30}}
	now := func(change func(*Publication)) Publication {
		p := Publication{Name: "pub", Exists: true, OID: 10, Insert: true, xmin: "700",
			Tables: []PublishedTable{{Table: outboxTable, OID: 20, MemberOID: 30, Published: true}}}
		if change != nil {
			change(&p)
		}
		return p
	}
	table := func(change func(*PublishedTable)) func(*Publication) {
		return func(p *Publication) { change(&p.Tables[0]) }
	}
	for _, tc := range []struct {
		name   string
		pub    Publication
		gap    string // part of GapError.What; empty: no gap
		fix    string // part of GapError.Fix
		warned string
	}{
		{name: "unchanged", pub: now(nil)},
		{name: "dropped", pub: now(func(p *Publication) { p.Exists, p.OID = false, 0 }), gap: `publication "pub" was dropped after`},
		{name: "dropped and created again", pub: now(func(p *Publication) { p.OID = 11 }), gap: "(OID 10, now 11)"},
		{name: "no more inserts", pub: now(func(p *Publication) { p.Insert = false }),
			gap: "no longer publishes inserts", fix: `ALTER PUBLICATION "pub" SET (publish = 'insert')`},
		{name: "altered, still publishing", pub: now(func(p *Publication) { p.xmin = "701" }), warned: "altered while walrelay was not streaming"},
		{name: "table dropped and created again", pub: now(table(func(t *PublishedTable) { t.OID = 21 })),
			gap: "outbox table public.outbox was dropped and created again"},
		{name: "table removed", pub: now(table(func(t *PublishedTable) { t.Published, t.MemberOID = false, 0 })),
			gap: `outbox table public.outbox was removed from publication "pub" after`},
		{name: "table removed and added again", pub: now(table(func(t *PublishedTable) { t.MemberOID = 31 })),
			gap: "removed from publication \"pub\" and added again"},
		{name: "partitioned, sent as partitions", pub: now(table(func(t *PublishedTable) { t.Published, t.AsPartitions, t.MemberOID = false, true, 0 }))},
		{name: "covered by FOR ALL TABLES now", pub: now(func(p *Publication) {
			p.AllTables = true
			p.Tables[0].MemberOID = 0
		})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log, logs := observed()
			gap := publicationGap(SetupConfig{Publication: "pub"}, rec, recorded, tc.pub, since, log)
			switch {
			case tc.gap == "" && gap != nil:
				t.Fatalf("gap %q", gap.What)
			case tc.gap != "" && gap == nil:
				t.Fatalf("no gap, want %q", tc.gap)
			case gap != nil:
				if !strings.Contains(gap.What, tc.gap) || gap.Since != since || !strings.Contains(gap.Fix, tc.fix) {
					t.Errorf("gap %q since %s fix %q; want %q since %s fix %q", gap.What, gap.Since, gap.Fix, tc.gap, since, tc.fix)
				}
			}
			if got := logs.FilterMessageSnippet(tc.warned).Len(); tc.warned != "" && got != 1 || tc.warned == "" && logs.Len() != 0 {
				t.Errorf("warnings %v, want %q", logs.All(), tc.warned)
			}
		})
	}
}

func TestCheckSlotInfo(t *testing.T) {
	cfg := SetupConfig{Slot: "walrelay"}
	good := slot.Info{Name: "walrelay", SlotType: "logical", Plugin: "pgoutput", Database: "shop", WALStatus: "reserved"}
	if err := checkSlotInfo(cfg, good, "shop"); err != nil {
		t.Fatalf("a usable slot refused: %v", err)
	}
	for _, tc := range []struct {
		name   string
		change func(*slot.Info)
		db     string
		want   string
	}{
		{"physical", func(i *slot.Info) { i.SlotType, i.Plugin = "physical", "" }, "shop", "is a physical slot"},
		{"another plugin", func(i *slot.Info) { i.Plugin = "wal2json" }, "shop", `uses plugin "wal2json", not pgoutput`},
		{"another database", func(i *slot.Info) { i.Database = "billing" }, "shop", `belongs to database "billing", not "shop"`},
	} {
		info := good
		tc.change(&info)
		wantRefusal(t, checkSlotInfo(cfg, info, tc.db), `replication slot "walrelay"`, tc.want)
	}
	// An invalidated slot of the right kind is ensureSlot's to replace.
	lost := good
	lost.WALStatus = "lost"
	if err := checkSlotInfo(cfg, lost, "shop"); err != nil {
		t.Errorf("an invalidated pgoutput slot refused: %v", err)
	}
}
