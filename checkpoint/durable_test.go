package checkpoint

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/walrelay/walrelay/decoder"
)

// TestDurableRoundTrip checks the documented record format both ways.
func TestDurableRoundTrip(t *testing.T) {
	ts := time.Date(2026, 11, 29, 17, 0, 0, 0, time.UTC)
	for _, d := range []Durable{
		{Slot: "walrelay", LSN: 0x16B3748, Time: ts},
		{Slot: "s", LSN: 0x16B3748, Partial: &Partial{CommitLSN: 0x16B3800, Events: 5000}, Time: ts},
		{Slot: "s", LSN: 0, Partial: &Partial{CommitLSN: 0x10, Events: 1}, Time: ts},
	} {
		b := d.Marshal()
		got, err := UnmarshalDurable(b)
		if err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if got.Slot != d.Slot || got.LSN != d.LSN || !got.Time.Equal(d.Time) || (got.Partial == nil) != (d.Partial == nil) ||
			d.Partial != nil && *got.Partial != *d.Partial || got.Version != DurableVersion {
			t.Errorf("round trip of %s = %+v", b, got)
		}
	}
	want := `{"version":1,"slot":"walrelay","lsn":"0/16B3748","partial":{"commit_lsn":"0/16B3800","events":5000},"time":"2026-11-29T17:00:00Z"}`
	d := Durable{Slot: "walrelay", LSN: 0x16B3748, Partial: &Partial{CommitLSN: 0x16B3800, Events: 5000}, Time: ts}
	if got := string(d.Marshal()); got != want {
		t.Errorf("Marshal = %s\nwant     %s", got, want)
	}
}

// TestUnmarshalDurableRejects refuses what it cannot trust.
func TestUnmarshalDurableRejects(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"version":2,"slot":"s","lsn":"0/1"}`, "version 2"},
		{`{"version":0,"slot":"s","lsn":"0/1"}`, "version 0"},
		{`{"version":1,"slot":"s","lsn":"nope"}`, "lsn"},
		{`{"version":1,"slot":"s","lsn":"0/1","partial":{"commit_lsn":"x","events":1}}`, "commit_lsn"},
		{`{"version":1,"slot":"s","lsn":"0/1","partial":{"commit_lsn":"0/2","events":-1}}`, "negative"},
		{`not json`, "checkpoint record"},
	} {
		if _, err := UnmarshalDurable([]byte(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("UnmarshalDurable(%s) = %v, want an error about %q", tc.in, err, tc.want)
		}
	}
}

// TestSkip walks PostgreSQL's resend after a crash: transactions wholly
// before the checkpoint are skipped, the partial one loses its first
// events, later ones go through; no checkpoint skips nothing.
func TestSkip(t *testing.T) {
	// Three transactions: T1 commit at 100 (ends 110), T2 commit at 200
	// (ends 210, fully in), T3 commit at 300 (3 of its 5 events in).
	d := Durable{LSN: 210, Partial: &Partial{CommitLSN: 300, Events: 3}}
	s := NewSkip(d, true)
	type txn struct {
		commit decoder.LSN
		events int
		want   []bool
	}
	for _, x := range []txn{
		{100, 2, []bool{true, true}},
		{200, 1, []bool{true}},
		{300, 5, []bool{true, true, true, false, false}},
		{400, 2, []bool{false, false}},
	} {
		s.Begin(x.commit)
		for i := range x.events {
			if got := s.Event(); got != x.want[i] {
				t.Errorf("txn %v event %d: skip %v, want %v", x.commit, i, got, x.want[i])
			}
		}
	}
	none := NewSkip(Durable{}, false)
	none.Begin(1)
	if none.Event() {
		t.Error("no checkpoint skipped an event")
	}
	// A transaction that commits exactly at the checkpoint's end is later.
	s = NewSkip(Durable{LSN: 210}, true)
	s.Begin(210)
	if s.Event() {
		t.Error("transaction committing at the checkpoint's end LSN was skipped")
	}
}

// The PostgreSQL system identifier rides in the record; a record written
// before it existed still reads, without one.
func TestDurableSystemID(t *testing.T) {
	ts := time.Date(2026, 11, 29, 17, 0, 0, 0, time.UTC)
	d := Durable{Slot: "walrelay", SystemID: "7713984148484868534", LSN: 0x16B3748, Time: ts}
	want := `{"version":1,"slot":"walrelay","system_id":"7713984148484868534","lsn":"0/16B3748","time":"2026-11-29T17:00:00Z"}`
	if got := string(d.Marshal()); got != want {
		t.Fatalf("Marshal = %s\nwant     %s", got, want)
	}
	if got, err := UnmarshalDurable([]byte(want)); err != nil || got.SystemID != d.SystemID {
		t.Fatalf("UnmarshalDurable = %+v, %v", got, err)
	}
	old, err := UnmarshalDurable([]byte(`{"version":1,"slot":"walrelay","lsn":"0/16B3748","time":"2026-11-29T17:00:00Z"}`))
	if err != nil || old.SystemID != "" || old.LSN != 0x16B3748 {
		t.Fatalf("record without system_id = %+v, %v", old, err)
	}
}

// Verify refuses a checkpoint that cannot be this slot's on this server:
// another slot, another system, a position the server has not reached.
func TestDurableVerify(t *testing.T) {
	const sys = "7713984148484868534"
	ok := Durable{Slot: "s", SystemID: sys, LSN: 0x100, Partial: &Partial{CommitLSN: 0x180, Events: 2}}
	if legacy, err := ok.Verify("s", sys, 0x200); err != nil || legacy {
		t.Fatalf("Verify(valid) = %v, %v", legacy, err)
	}
	if legacy, err := ok.Verify("s", sys, 0x180); err != nil || legacy {
		t.Fatalf("Verify(at the server's position) = %v, %v", legacy, err)
	}
	old := ok
	old.SystemID = ""
	if legacy, err := old.Verify("s", sys, 0x200); err != nil || !legacy {
		t.Fatalf("Verify(no system id) = %v, %v; want accepted as legacy", legacy, err)
	}
	for _, tc := range []struct {
		name   string
		d      Durable
		server decoder.LSN
		want   string
		ahead  bool // an *AheadError: the caller may read the position again
	}{
		{"other slot", Durable{Slot: "t", SystemID: sys, LSN: 0x100}, 0x200, `slot "t"`, false},
		{"other system", Durable{Slot: "s", SystemID: "42", LSN: 0x100}, 0x200, "system 42", false},
		{"lsn ahead", Durable{Slot: "s", SystemID: sys, LSN: 0x300}, 0x200, "0/300", true},
		{"partial ahead", Durable{Slot: "s", SystemID: sys, LSN: 0x100, Partial: &Partial{CommitLSN: 0x300, Events: 1}}, 0x200, "0/300", true},
		{"legacy lsn ahead", Durable{Slot: "s", LSN: 0x300}, 0x200, "0/300", true},
	} {
		_, err := tc.d.Verify("s", sys, tc.server)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "router.Config.CheckpointTopic") {
			t.Errorf("%s: Verify = %v, want a refusal mentioning %q and the fix", tc.name, err, tc.want)
		}
		var ahead *AheadError
		if errors.As(err, &ahead) != tc.ahead {
			t.Errorf("%s: Verify = %T, an *AheadError: %v", tc.name, err, tc.ahead)
		}
	}
}

func TestDurableTimelineRoundTripAndFork(t *testing.T) {
	d := Durable{Slot: "s", SystemID: "1", Timeline: 3, LSN: 0x5000, Partial: &Partial{CommitLSN: 0x5100, Events: 2}}
	got, err := UnmarshalDurable(d.Marshal())
	if err != nil || got.Timeline != 3 {
		t.Fatalf("timeline did not round-trip: %+v, %v", got, err)
	}
	// Forked before everything it covers: it holds.
	if f, cut := d.Forked(0x6000); cut || f.LSN != d.LSN || f.Partial == nil {
		t.Errorf("fork after the checkpoint cut it: %+v, %v", f, cut)
	}
	// Forked between the full part and the partial transaction.
	if f, cut := d.Forked(0x5080); !cut || f.LSN != 0x5000 || f.Partial != nil {
		t.Errorf("fork before the partial transaction's commit: %+v, %v; want LSN kept, partial dropped", f, cut)
	}
	// Forked before the checkpoint: cut at the fork.
	if f, cut := d.Forked(0x4000); !cut || f.LSN != 0x4000 || f.Partial != nil {
		t.Errorf("fork before the checkpoint: %+v, %v; want cut at 0/4000", f, cut)
	}
}
