package doctor

import (
	"strings"
	"testing"
)

func TestStandbyReplayCause(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    StandbyReplay
		kind string
	}{
		{"caught up", StandbyReplay{ReplayLSN: "0/3000000"}, ""},
		{"a little behind", StandbyReplay{LagBytes: 1 << 20, LagSeconds: 0.2}, ""},
		{"far behind", StandbyReplay{LagBytes: 64 << 20, LagSeconds: 30}, "standby_replay_behind"},
		{"paused", StandbyReplay{Paused: true, LagBytes: 8192}, "standby_replay_paused"},
		{"streaming", StandbyReplay{Receiver: "streaming", Upstream: "s1:5432"}, ""},
		{"not streaming", StandbyReplay{Receiver: "absent"}, "standby_not_streaming"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, ok := tc.r.Cause()
			if ok != (tc.kind != "") || c.Kind != tc.kind {
				t.Fatalf("Cause() = %q, %v; want %q", c.Kind, ok, tc.kind)
			}
			if tc.kind == "standby_replay_paused" && !strings.Contains(c.Fix, "pg_wal_replay_resume()") {
				t.Errorf("the fix does not name pg_wal_replay_resume(): %s", c.Fix)
			}
			if tc.r.Upstream != "" && !strings.Contains(tc.r.Text(), "streams from "+tc.r.Upstream) {
				t.Errorf("Text() does not name the upstream: %s", tc.r.Text())
			}
			if tc.kind == "standby_not_streaming" && !strings.Contains(tc.r.Text(), "NOT STREAMING") {
				t.Errorf("Text() does not say NOT STREAMING: %s", tc.r.Text())
			}
			if tc.r.Paused && !strings.Contains(tc.r.Text(), "PAUSED") {
				t.Errorf("Text() does not say PAUSED: %s", tc.r.Text())
			}
		})
	}
}

// A slot decoded on the standby is its own: neither described nor
// explained as a stale copy of the primary's to drop, nor as a copy a
// tool keeps.
func TestFailoverDecodedHere(t *testing.T) {
	f := Failover{Name: "walrelay", Supported: true, Local: &Copy{Exists: true, SyncSlots: true, Synced: false}}
	text, _ := f.Describe()
	if !strings.Contains(text, "of its own") {
		t.Fatalf("without DecodedHere the local slot, beside slot synchronization, should read as a stale copy, got: %s", text)
	}
	f.Local.SyncSlots = false
	if text, _ = f.Describe(); !strings.Contains(text, "keeps a copy of the slot that slot synchronization did not make") {
		t.Fatalf("without DecodedHere the local slot, without slot synchronization, should read as a copy a tool keeps, got: %s", text)
	}
	f.DecodedHere = true
	text, warn := f.Describe()
	if warn || !strings.Contains(text, "promoting this standby keeps the slot") {
		t.Errorf("Describe() = %q, warn %v", text, warn)
	}
	if c := f.Causes(); len(c) != 0 {
		t.Errorf("Causes() = %+v, want none", c)
	}
}

func TestPrimaryUnreachableCause(t *testing.T) {
	c := PrimaryUnreachableCause("connection refused")
	for _, want := range []string{"connection refused", "repoint relay.Config.PrimaryURL", "target_session_attrs=read-write", "primary_conninfo"} {
		if !strings.Contains(c.Text+" "+c.Fix, want) {
			t.Errorf("the cause does not say %q: %+v", want, c)
		}
	}
	if c.Kind != "primary_unreachable" {
		t.Errorf("kind %q", c.Kind)
	}
}
