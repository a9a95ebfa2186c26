package doctor

import (
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/walrelay/walrelay/decoder"
)

func withCopy(c Copy, f func(*Copy)) Copy {
	f(&c)
	return c
}

func TestFailoverDescribeAndProtected(t *testing.T) {
	current := Copy{Standby: "postgres@b:5432/app", PrimarySlot: "sb", SyncSlots: true, Exists: true, Synced: true, ConfirmedLSN: 0x1000, PrimaryConfirmed: 0x2000}
	stale := current
	stale.Standby, stale.Synced, stale.ConfirmedLSN = "postgres@a:5432/app", false, 0x800
	protected := Failover{Name: "walrelay", Supported: true, Slot: true, StandbySlots: []string{"sb"}, Standbys: 1, Checked: true, Copies: []Copy{current}}
	with := func(f func(*Failover)) Failover {
		g := protected
		g.Copies = append([]Copy(nil), protected.Copies...)
		f(&g)
		return g
	}
	copyWith := func(f func(*Copy)) Failover {
		return with(func(g *Failover) { f(&g.Copies[0]) })
	}
	// kept15 is a copy Patroni keeps on a PostgreSQL 15 standby.
	kept15 := Copy{Standby: "postgres@b:5432/app", Version: 150000, Exists: true, ConfirmedLSN: 0x1000, PrimaryConfirmed: 0x3000}
	for _, tc := range []struct {
		name      string
		f         Failover
		protected bool
		warn      bool
		want      []string
		not       []string
	}{
		{name: "every copy synchronized and current", f: protected, protected: true,
			want: []string{"the copies on postgres@b:5432/app are synchronized and current: a promoted standby keeps the slot"}},
		{name: "standbys' copies not read", f: with(func(g *Failover) { g.Checked, g.Copies = false, nil }), warn: true,
			want: []string{"held back by synchronized_standby_slots = sb", "not the standbys' copies", "relay.Config.StandbyURLs", "synced must be true"},
			not:  []string{"a promoted standby keeps the slot"}},
		{name: "a standby's own slot of the same name (the rejoined old primary)",
			f: with(func(g *Failover) { g.Standbys = 2; g.Copies = append(g.Copies, stale) }), warn: true,
			want: []string{`standby postgres@a:5432/app has a slot "walrelay" of its own (synced = false, confirmed at 0/800, 6.0 KiB (6144 bytes) behind the primary's 0/2000)`,
				"sending every event since again", "SELECT pg_drop_replication_slot('walrelay') on that standby"},
			not: []string{"postgres@b:5432/app"}},
		{name: "copy ahead of the primary's slot", f: copyWith(func(c *Copy) { c.ConfirmedLSN = 0x3000 }), warn: true,
			want: []string{"confirmed at 0/3000, 4.0 KiB (4096 bytes) past the primary's 0/2000", "which are lost", "remove the directory pg_replslot/walrelay"}},
		{name: "copy not persisted", f: copyWith(func(c *Copy) { c.Temporary = true }), warn: true, want: []string{"temporary = true"}},
		{name: "copy invalidated", f: copyWith(func(c *Copy) { c.Invalidation = "rows_removed" }), warn: true, want: []string{"invalidated (rows_removed)"}},
		{name: "sync off with a synced copy", f: copyWith(func(c *Copy) { c.SyncSlots = false }), warn: true, want: []string{"nothing keeps it current"}},
		{name: "no copy", f: copyWith(func(c *Copy) { c.Exists = false }), warn: true, want: []string{"has no copy of the slot yet"}},
		{name: "no copy, sync off", f: copyWith(func(c *Copy) { c.Exists, c.SyncSlots = false, false }), warn: true, want: []string{"sync_replication_slots is off there"}},
		{name: "standby unreachable", f: copyWith(func(c *Copy) { c.Err = errors.New("connection refused") }), warn: true,
			want: []string{"could not be read", "connection refused"}},
		{name: "fewer copies read than standbys stream", f: with(func(g *Failover) { g.Standbys = 2 }), warn: true,
			want: []string{"of the 2 standbys streaming walrelay read the copies of 1"}},
		{name: "every URL given is a primary", f: with(func(g *Failover) { g.Copies = nil }), warn: true,
			want: []string{"of the 1 standbys streaming walrelay read the copies of 0"}},
		{name: "a standby named in synchronized_standby_slots does not stream", f: with(func(g *Failover) { g.Missing = []string{"sb"} }), warn: true,
			want: []string{"no standby streams from sb"}},
		{name: "synchronized_standby_slots empty", f: with(func(g *Failover) { g.StandbySlots = nil }), warn: true, want: []string{"synchronized_standby_slots is empty"}},
		{name: "not a failover slot, standbys' copies not read", f: with(func(g *Failover) { g.Slot, g.Checked, g.Copies = false, false, nil }), warn: true,
			want: []string{"not a failover slot: a failover loses it", "unless a tool keeps a copy of it on the standbys"}},
		{name: "not a failover slot, only pg_receivewal streams",
			f:    Failover{Name: "walrelay", Supported: true, Archivers: 1},
			want: []string{"not a failover slot", "1 WAL stream(s) of clients that replay nothing, such as pg_receivewal, are not counted as standbys"}},
		{name: "before 17, a standby and pg_receivewal",
			f: Failover{Name: "walrelay", Standbys: 1, Archivers: 2}, warn: true,
			want: []string{"a failover to one of its 1 standbys loses the slot", "2 WAL stream(s) of clients that replay nothing",
				"unless a tool keeps a copy of the slot there (Patroni does for a slot named under slots:", "relay.Config.StandbyURLs"}},
		// A copy a tool keeps (Patroni's permanent slots: the state file
		// copied from the primary, moved with pg_replication_slot_advance):
		// a failover keeps the slot and resends what the copy lags.
		{name: "before 17, a tool's copy on the one standby",
			f: Failover{Name: "walrelay", Standbys: 1, Checked: true, Copies: []Copy{kept15}},
			want: []string{"but standby postgres@b:5432/app keeps a copy of the slot that slot synchronization did not make (a tool's, such as Patroni's permanent slots), confirmed at 0/1000, 8.0 KiB (8192 bytes) behind the primary's 0/3000: a failover to it keeps the slot and resumes from the copy's position, sending the events after it again",
				"nothing before PostgreSQL 17 holds decoding back"},
			not: []string{"loses the slot", "refuses"}},
		{name: "before 17, a tool's copy where the primary's slot is",
			f:    Failover{Name: "walrelay", Standbys: 1, Checked: true, Copies: []Copy{withCopy(kept15, func(c *Copy) { c.ConfirmedLSN = 0x3000 })}},
			want: []string{"confirmed at 0/3000, 0 B behind the primary's 0/3000: a failover to it keeps the slot"}, not: []string{"loses the slot"}},
		{name: "before 17, standbys read, none with a copy",
			f: Failover{Name: "walrelay", Standbys: 1, Checked: true, Copies: []Copy{withCopy(kept15, func(c *Copy) { c.Exists = false })}}, warn: true,
			want: []string{"standby postgres@b:5432/app has no copy of the slot: PostgreSQL before 17 keeps none on a standby, so a failover to it loses the slot", "Patroni does for a slot named under slots:"},
			not:  []string{"sync_replication_slots"}},
		{name: "before 17, a tool's copy on one of two standbys",
			f: Failover{Name: "walrelay", Standbys: 2, Checked: true, Copies: []Copy{kept15}}, warn: true,
			want: []string{"of the 2 standbys streaming walrelay read a copy of the slot on 1", "a failover to another loses the slot"}},
		{name: "before 17, every standby URL a primary's",
			f: Failover{Name: "walrelay", Standbys: 1, Checked: true}, warn: true,
			want: []string{"a failover to one of its 1 standbys loses the slot", "reached a server that takes writes"}},
		{name: "before 17, a slot of the same name and another plugin",
			f: Failover{Name: "walrelay", Standbys: 1, Checked: true, Copies: []Copy{withCopy(kept15, func(c *Copy) { c.Mismatch = "a slot of plugin test_decoding, not pgoutput" })}}, warn: true,
			want: []string{`has a slot "walrelay" that is a slot of plugin test_decoding, not pgoutput, no copy of walrelay's: a failover to it cannot stream from it`}},
		{name: "before 17, a tool's copy past the primary's slot",
			f: Failover{Name: "walrelay", Standbys: 1, Checked: true, Copies: []Copy{withCopy(kept15, func(c *Copy) { c.ConfirmedLSN = 0x4000 })}}, warn: true,
			want: []string{"confirmed at 0/4000, 4.0 KiB (4096 bytes) past the primary's 0/3000", "skips the events between", "pg_drop_replication_slot('walrelay')"}},
		{name: "before 17, a tool's copy invalidated",
			f: Failover{Name: "walrelay", Standbys: 1, Checked: true, Copies: []Copy{withCopy(kept15, func(c *Copy) { c.Invalidation = "wal_removed" })}}, warn: true,
			want: []string{"invalidated (wal_removed)"}, not: []string{"keeps a copy"}},
		{name: "17, not a failover slot, a tool's copy",
			f:    Failover{Name: "walrelay", Supported: true, Standbys: 1, Checked: true, Copies: []Copy{withCopy(kept15, func(c *Copy) { c.Version = 170000 })}},
			want: []string{"the slot is not a failover slot", "keeps a copy of the slot that slot synchronization did not make", "synchronized_standby_slots holds back only a failover slot's decoding"},
			not:  []string{"loses"}},
		{name: "17, a failover slot held back, a tool's copy where sync_replication_slots is off",
			f: with(func(g *Failover) {
				g.Copies = []Copy{withCopy(kept15, func(c *Copy) { c.Version, c.PrimarySlot = 170000, "sb" })}
			}),
			want: []string{"held back by synchronized_standby_slots = sb", "keeps a copy of the slot that slot synchronization did not make", ": a promoted standby keeps the slot"},
			not:  []string{"synchronized and current"}},
		{name: "status on a standby before 17 with a tool's copy",
			f:    Failover{Name: "walrelay", Local: &Copy{Version: 150000, Exists: true, ConfirmedLSN: 0x1000}},
			want: []string{"this server is a standby, and this standby keeps a copy of the slot that slot synchronization did not make", "confirmed at 0/1000: a failover to it keeps the slot", "relay.Config.StandbyURLs"}},
		{name: "status on a standby before 17 without one",
			f: Failover{Name: "walrelay", Local: &Copy{Version: 150000}}, warn: true,
			want: []string{"this standby has no copy of the slot: PostgreSQL before 17 keeps none"}},
		{name: "before 17, only pg_receivewal",
			f:    Failover{Name: "walrelay", Archivers: 1},
			want: []string{"no standby streams from this server", "such as pg_receivewal"}, not: []string{"standbys loses"}},
		{name: "status on the rejoined old primary itself",
			f: Failover{Name: "walrelay", Supported: true, Slot: true, Local: &Copy{SyncSlots: true, Exists: true, ConfirmedLSN: 0x800}}, warn: true,
			want: []string{`this standby has a slot "walrelay" of its own (synced = false, confirmed at 0/800)`, "pg_drop_replication_slot('walrelay') on this standby"}},
		{name: "status on a standby with a current copy",
			f:    Failover{Name: "walrelay", Supported: true, Slot: true, Local: &Copy{SyncSlots: true, Exists: true, Synced: true}},
			want: []string{"this server is a standby with a synchronized copy"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			text, warn := tc.f.Describe()
			if warn != tc.warn {
				t.Errorf("warn = %v, want %v: %s", warn, tc.warn, text)
			}
			if got := tc.f.Protected(); got != tc.protected {
				t.Errorf("Protected() = %v, want %v: %s", got, tc.protected, text)
			}
			for _, w := range tc.want {
				if !strings.Contains(text, w) {
					t.Errorf("the text lacks %q:\n%s", w, text)
				}
			}
			for _, w := range tc.not {
				if strings.Contains(text, w) {
					t.Errorf("the text has %q:\n%s", w, text)
				}
			}
			// status --explain names each copy that does not protect the
			// slot, with its fix apart.
			causes := tc.f.Causes()
			copies := tc.f.Copies
			if tc.f.Local != nil {
				copies = []Copy{*tc.f.Local}
			}
			bad := 0
			for _, c := range copies {
				if c.Problem(tc.f.Name) != "" {
					bad++
				}
			}
			if len(causes) != bad {
				t.Errorf("%d causes for %d copies that do not protect the slot: %+v", len(causes), bad, causes)
			}
			for _, c := range causes {
				if c.Kind != "standby_slot" || c.Text == "" || c.Fix == "" {
					t.Errorf("cause %+v", c)
				}
			}
		})
	}
}

// The relay logs the failover line again only when its words change, its
// positions and byte counts left out (relay's figures): a copy a tool
// moves in steps, now level with the primary's slot and now behind it, is
// the same line.
func TestFailoverKeptCopyWordsStable(t *testing.T) {
	figures := regexp.MustCompile(`[0-9A-F]+/[0-9A-F]+|[0-9.]+ (B|KiB|MiB|GiB|TiB)( \([0-9]+ bytes\))?`)
	line := func(copyAt decoder.LSN) string {
		c := Copy{Standby: "postgres@b:5432/app", Version: 150000, Exists: true, ConfirmedLSN: copyAt, PrimaryConfirmed: 0x3000}
		text, _ := Failover{Name: "walrelay", Standbys: 1, Checked: true, Copies: []Copy{c}}.Describe()
		return figures.ReplaceAllString(text, "#")
	}
	if level, behind := line(0x3000), line(0x1000); level != behind {
		t.Errorf("the line's words change with the copy's lag:\n%s\n%s", level, behind)
	}
}
