package doctor

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

func ptr[T any](v T) *T { return &v }

// TestInvalidationReason: PostgreSQL's reason where the server reports it
// (17+), the nearest equivalent before, and the setting behind each.
func TestInvalidationReason(t *testing.T) {
	s := Settings{MaxSlotWALKeepSize: "1GB", IdleSlotTimeout: "10min", WALLevel: "replica", HotStandbyFeedback: "off"}
	for _, tc := range []struct {
		name   string
		info   slot.Info
		reason string
		want   []string
	}{
		{"17: wal_removed", slot.Info{ServerVersion: 170004, WALStatus: "lost", InvalidationReason: "wal_removed", Conflicting: ptr(false)},
			"wal_removed", []string{"invalidation_reason = wal_removed", "max_slot_wal_keep_size = 1GB"}},
		{"18: idle_timeout", slot.Info{ServerVersion: 180000, WALStatus: "lost", InvalidationReason: "idle_timeout", Conflicting: ptr(false)},
			"idle_timeout", []string{"invalidation_reason = idle_timeout", "idle_replication_slot_timeout = 10min", "set idle_replication_slot_timeout to 0"}},
		{"17: rows_removed", slot.Info{ServerVersion: 170000, WALStatus: "lost", InvalidationReason: "rows_removed", Conflicting: ptr(true)},
			"rows_removed", []string{"hot_standby_feedback = off", "hot_standby_feedback = on"}},
		{"17: wal_level_insufficient", slot.Info{ServerVersion: 170000, WALStatus: "lost", InvalidationReason: "wal_level_insufficient", Conflicting: ptr(true)},
			"wal_level_insufficient", []string{"wal_level = replica", "wal_level = logical"}},
		{"16: standby, restart_lsn kept", slot.Info{ServerVersion: 160003, WALStatus: "lost", Conflicting: ptr(true), RestartLSN: 0x500}, // with s.InRecovery below
			"rows_removed or wal_level_insufficient", []string{"PostgreSQL 16 reports wal_status = lost on a standby with restart_lsn kept", "hot_standby_feedback = on"}},
		{"16: primary", slot.Info{ServerVersion: 160003, WALStatus: "lost", Conflicting: ptr(true), RestartLSN: 0x500},
			"wal_removed", []string{"PostgreSQL 16 reports wal_status = lost", "max_slot_wal_keep_size = 1GB"}},
		{"16: standby, restart_lsn cleared", slot.Info{ServerVersion: 160003, WALStatus: "lost", Conflicting: ptr(true)},
			"wal_removed", []string{"with restart_lsn cleared", "max_slot_wal_keep_size = 1GB"}},
		{"17: lost before the checkpoint", slot.Info{ServerVersion: 170000, WALStatus: "lost", RestartLSN: 0x500},
			"wal_removed", []string{"before PostgreSQL set invalidation_reason", "max_slot_wal_keep_size = 1GB"}},
		{"15", slot.Info{ServerVersion: 150010, WALStatus: "lost"},
			"wal_removed", []string{"before 16 reports wal_status = lost", "max_slot_wal_keep_size = 1GB"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.info.Name = "s"
			if !tc.info.Invalidated() {
				t.Fatal("not invalidated")
			}
			s := s
			s.InRecovery = strings.Contains(tc.name, "standby")
			inv := invalidationOf(tc.info, s)
			if inv.Reason != tc.reason {
				t.Errorf("reason %q, want %q", inv.Reason, tc.reason)
			}
			tc.info.ConfirmedLSN = 0x1000
			g := InvalidatedError(tc.info, s, 0x800)
			msg := g.Error()
			for _, w := range append(tc.want, "events committed after 0/1000 may be missing", "walrelay setup --accept-gap", "relay.PublishSnapshot") {
				if !strings.Contains(msg, w) {
					t.Errorf("refusal lacks %q: %s", w, msg)
				}
			}
			if gap := new(slot.GapError); !errors.As(error(g), &gap) || !g.Fatal() {
				t.Error("the refusal is not a fatal gap")
			}
		})
	}
	if (slot.Info{WALStatus: "unreserved"}).Invalidated() {
		t.Error("an unreserved slot counts as invalidated")
	}
}

// facts is a streamed slot 100 MiB into the WAL with nothing holding it.
func facts() Facts {
	const cur = decoder.LSN(100 << 20)
	return Facts{
		Info: slot.Info{Name: "s", Active: true, ActivePID: ptr(int32(42)), CurrentLSN: cur, ConfirmedLSN: cur, RestartLSN: cur - 1000, RetainedWALBytes: 1000,
			CatalogXmin: ptr(int64(600)), CatalogXminAge: ptr(int64(105)), ServerVersion: 170000, Now: time.Unix(1000, 0)},
		walsender: &sender{PID: 42, ClientAddr: "10.0.0.5", SentLSN: cur, FlushLSN: cur},
		relays:    []relayConn{{PID: 7, ClientAddr: "10.0.0.5", State: RelayStreaming}},
		heartbeat: true,
		Settings:  Settings{IdleInTransactionTimeout: "0", MaxSlotWALKeepSize: "-1"},
	}
}

func kinds(cs []Cause) []string {
	var k []string
	for _, c := range cs {
		k = append(k, c.Kind)
	}
	return k
}

// TestExplainBranches covers what the integration tests cannot make
// happen on demand: a relay connected but not streaming, a walsender
// behind, another role's transaction, a standby's xmin, and transactions
// that do not hold the slot.
func TestExplainBranches(t *testing.T) {
	for _, tc := range []struct {
		name  string
		edit  func(*Facts)
		kinds string
		want  []string
	}{
		{"healthy", func(*Facts) {}, "", nil},
		{"relay connecting to kafka", func(f *Facts) {
			f.Info.Active, f.Info.ActivePID, f.walsender = false, nil, nil
			f.Info.InactiveSince = ptr(time.Unix(940, 0))
			f.relays[0].State = RelayConnectingKafka
			f.Settings.IdleSlotTimeout, f.Settings.IdleSlotTimeoutDur = "10min", 10*time.Minute
		}, "relay_not_streaming", []string{`says "connecting to kafka"`, "cannot reach Kafka", "inactive_since 1970-01-01T00:15:40Z, 1m ago", "kgo.SeedBrokers",
			"idle_replication_slot_timeout = 10min invalidates the slot", "1970-01-01T00:25:40Z"}},
		{"relay stopped before 17, with a record", func(f *Facts) {
			f.Info.Active, f.Info.ActivePID, f.walsender, f.relays = false, nil, nil, nil
		}, "relay_stopped", []string{"no walrelay process of this slot is connected", "walrelay last moved its record of the slot at 1970-01-01T00:15:00Z, 1m40s ago"}},
		{"walsender behind", func(f *Facts) {
			f.Info.ConfirmedLSN = 10 << 20
			f.Info.RestartLSN = 10<<20 - 100
			f.Info.LagBytes = 90 << 20
			f.walsender.SentLSN = 20 << 20
		}, "relay_behind", []string{"decoded only up to 0/1400000, 80.0 MiB", "large transaction"}},
		{"behind with heartbeats", func(f *Facts) {
			f.Info.ConfirmedLSN, f.Info.RestartLSN, f.Info.LagBytes = 10<<20, 10<<20-100, 90<<20
		}, "relay_behind", []string{"sends heartbeats but has confirmed only 0/A00000"}},
		{"quiet outbox", func(f *Facts) {
			f.Info.ConfirmedLSN, f.Info.RestartLSN, f.Info.LagBytes = 10<<20, 10<<20-100, 90<<20
			f.heartbeat = false
		}, "quiet_outbox", []string{"passed 90.0 MiB", "relay.Config.HeartbeatInterval"}},
		{"small lag blames nothing", func(f *Facts) {
			f.Info.LagBytes = 1 << 20
			f.heartbeat = false
		}, "", nil},
		{"open transactions", func(f *Facts) {
			f.Xacts = []Xact{
				{PID: 1, Xid: 690, XidAge: 15, Visible: true, Database: "app", User: "app", State: "idle in transaction", Query: "UPDATE t\nSET x = 1", Age: time.Minute, ClientAddr: "10.1.1.1"},
				{PID: 2, Xid: 701, XidAge: 4, Visible: true, Database: "app", State: "active", Query: "INSERT", Age: 10 * time.Second}, // normal traffic
			}
		}, "open_transaction", []string{"pid 1 in database \"app\" (user \"app\", from 10.1.1.1)", "open 1m, idle in transaction, xid 690", `"UPDATE t …"`, "catalog_xmin 600 stays at or before it", "pg_terminate_backend(1)"}},
		{"a transaction the slot's catalog_xmin is past", func(f *Facts) {
			f.Xacts = []Xact{{PID: 1, Xid: 590, XidAge: 115, Visible: true, Database: "app", State: "idle in transaction", Age: time.Hour}}
		}, "", nil},
		{"another role's transaction, restart_lsn far behind", func(f *Facts) {
			f.Info.RestartLSN = f.Info.ConfirmedLSN - 40<<20
			f.Xacts = []Xact{{PID: 9, Xid: 650, XidAge: 55, Database: "app", User: "batch"}}
		}, "open_transaction", []string{"pid 9 in database \"app\" (user \"batch\"; xid 650", "pg_read_all_stats", "40.0 MiB"}},
		{"another role's transaction, nothing held", func(f *Facts) {
			f.Xacts = []Xact{{PID: 9, Xid: 650, XidAge: 55, Database: "app", User: "batch"}}
		}, "", nil},
		{"prepared transactions", func(f *Facts) {
			f.Prepared = []PreparedXact{{GID: "o'1", Owner: "app", Database: "app", Xid: 600, XidAge: 105, Age: time.Hour}, {GID: "young", Xid: 699, XidAge: 6, Age: time.Second}}
		}, "prepared_transaction", []string{"prepared transaction 'o''1'", "COMMIT PREPARED 'o''1' or ROLLBACK PREPARED 'o''1'"}},
		{"other slots and a standby", func(f *Facts) {
			f.Slots = []OtherSlot{
				{Name: "phys", Type: "physical", Active: true, ActivePID: ptr(int32(5)), Standby: "replica1", RestartLSN: 1 << 20, RetainedWALBytes: 99 << 20, Xmin: ptr(int64(500)), XminAge: ptr(int64(205))},
				{Name: "lost", Type: "logical", WALStatus: "lost", RetainedWALBytes: 99 << 20},
				{Name: "young", Type: "logical", RestartLSN: 100<<20 - 10, RetainedWALBytes: 10, CatalogXmin: ptr(int64(703)), CatalogXminAge: ptr(int64(2))},
			}
			f.Standbys = []Standby{{PID: 8, ApplicationName: "replica2", Client: "10.0.0.9", Xmin: 400, XminAge: 305}}
		}, "replication_slot standby", []string{`replication slot "phys" (physical, streamed by pid 5 (standby "replica1")) keeps 99.0 MiB`, "holds xmin 500 (205 transactions ago)",
			"max_standby_streaming_delay", `standby "replica2" (walsender pid 8, from 10.0.0.9) holds xmin 400`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := facts()
			f.Info.LagBytes = int64(f.Info.CurrentLSN - f.Info.ConfirmedLSN)
			tc.edit(&f)
			causes := f.explain(explainOptions{Record: &Recorded{UpdatedAt: time.Unix(900, 0)}})
			if got := strings.Join(kinds(causes), " "); got != tc.kinds {
				t.Fatalf("causes %q, want %q: %+v", got, tc.kinds, causes)
			}
			var all []string
			for _, c := range causes {
				all = append(all, c.Text+" fix: "+c.Fix)
			}
			text := strings.Join(all, "\n")
			for _, w := range tc.want {
				if !strings.Contains(text, w) {
					t.Errorf("explain lacks %q:\n%s", w, text)
				}
			}
		})
	}
}

func TestDurationText(t *testing.T) {
	for d, want := range map[time.Duration]string{
		24 * time.Hour:                      "24h",
		90 * time.Minute:                    "1h30m",
		534 * time.Second:                   "8m54s",
		1500 * time.Millisecond:             "2s",
		0:                                   "0s",
		10 * time.Minute:                    "10m",
		26*time.Hour + 20*time.Second + 1e9: "26h",
		time.Hour + 30*time.Minute + 29*1e9: "1h30m",
	} {
		if got := DurationText(d); got != want {
			t.Errorf("DurationText(%s) = %q, want %q", d, got, want)
		}
	}
}

// TestUncut: a relay state PostgreSQL cut off with a long slot name is
// recognised while one state begins that way.
func TestUncut(t *testing.T) {
	for in, want := range map[string]string{
		"heartbea": relayHeartbeat, "h": relayHeartbeat, "waiting for k": RelayWaitingForKafka, "backp": RelayBackpressure,
		"st": "", "sta": "", "stan": RelayStandby, "star": RelayStarting, "str": RelayStreaming, "": "", "connecting": RelayConnectingKafka,
	} {
		if got := uncut(in); got != want {
			t.Errorf("uncut(%q) = %q, want %q", in, got, want)
		}
	}
	long := strings.Repeat("s", 50)
	if got := AppNameAsShown(HeartbeatAppName(long)); len(got) != 63 || uncut(strings.TrimPrefix(got, RelayAppName(long, ""))) != relayHeartbeat {
		t.Errorf("the heartbeat of a 50-character slot shows as %q", got)
	}
}
