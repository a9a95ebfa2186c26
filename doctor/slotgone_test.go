package doctor

import (
	"strings"
	"testing"
	"time"
)

// TestSlotGoneWording: the refusal of a slot that is gone says whether a
// relay ever streamed from it, as walrelay's record knows. One never
// streamed from was not lost under a running relay: it names what drops a
// slot nobody streams from (Patroni without slots: or ignore_slots, an
// operator), Patroni's own log line and both settings. Either way the gap
// starts at the record's position.
func TestSlotGoneWording(t *testing.T) {
	rec := Recorded{Table: `"walrelay"."slots"`, ConfirmedLSN: 0x5000, UpdatedAt: time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)}
	never := rec
	never.NeverStreamed = true
	for _, tc := range []struct {
		name      string
		err       error
		want, not []string
	}{
		{name: "never streamed from",
			err: SlotGoneError("walrelay", never, false),
			want: []string{`replication slot "walrelay" is gone, and no relay ever streamed from it: walrelay set it up (its record in "walrelay"."slots", written 2026-12-01T10:00:00Z, has it confirmed at 0/5000)`,
				`Patroni's log: "Dropped unknown replication slot 'walrelay'"`,
				"slots: {walrelay: {type: logical, database: <the database>, plugin: pgoutput}}", "ignore_slots: [{name: walrelay}]",
				"an operator", "events committed after 0/5000 may be missing", "walrelay setup --accept-gap"},
			not: []string{"though walrelay streamed from it", "a failover loses a slot unless"}},
		{name: "streamed from",
			err: SlotGoneError("walrelay", rec, false),
			want: []string{`replication slot "walrelay" is gone, though walrelay streamed from it`, "failover slot synchronized to the promoted standby",
				"a tool keeps a copy on the standby (Patroni's slots:)", "Dropped unknown replication slot 'walrelay'", "ignore_slots: [{name: walrelay}]",
				"events committed after 0/5000 may be missing"},
			not: []string{"no relay ever streamed"}},
		{name: "never streamed from, on a hot standby",
			err:  SlotGoneError("walrelay", never, true),
			want: []string{"no relay ever streamed from it", "ignore_slots: [{name: walrelay}]", "rebuilt from a new base backup"},
			not:  []string{"slots: {walrelay:"}},
		{name: "streamed from, on a hot standby",
			err:  SlotGoneError("walrelay", rec, true),
			want: []string{"is gone, though walrelay streamed from it", "rebuilding the standby from a new base backup, or losing it, loses the slot", "ignore_slots: [{name: walrelay}]"},
			not:  []string{"failover slot synchronized"}},
		{name: "dropped between two streams",
			err: SlotDroppedError("walrelay", false, 0x44),
			want: []string{`replication slot "walrelay" was dropped while walrelay streamed from it (by an operator, by Patroni while no client streamed from it, or lost in a failover`,
				"events committed after 0/44 may be missing", "slots: {walrelay:"}},
		{name: "dropped between two streams, on a hot standby",
			err:  SlotDroppedError("walrelay", true, 0x44),
			want: []string{"rebuilding or losing the standby loses its slot", "ignore_slots: [{name: walrelay}]"},
			not:  []string{"slots: {walrelay:"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			text := tc.err.Error()
			for _, w := range tc.want {
				if !strings.Contains(text, w) {
					t.Errorf("the refusal lacks %q:\n%s", w, text)
				}
			}
			for _, w := range tc.not {
				if strings.Contains(text, w) {
					t.Errorf("the refusal has %q:\n%s", w, text)
				}
			}
			if strings.Contains(text, "\n") {
				t.Errorf("the refusal spans lines:\n%s", text)
			}
		})
	}
}
