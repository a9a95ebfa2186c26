// Package checkpoint is exactly-once delivery's record in Kafka of how far
// the events in Kafka reach in the PostgreSQL stream: Durable, written in
// each Kafka transaction beside the events it covers, and read back at
// start to skip what a crashed relay already committed (Skip). Counter
// counts the acknowledgements of records outside any PostgreSQL
// transaction (a snapshot's). Which WAL position may be confirmed to
// PostgreSQL is package confirm's.
package checkpoint

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/walrelay/walrelay/decoder"
)

// DurableVersion is the version of the checkpoint record format written
// by this walrelay. Readers accept this version and refuse newer ones.
const DurableVersion = 1

// Durable is a checkpoint stored in Kafka by exactly-once delivery, in the
// same Kafka transaction as the events it covers. It says exactly how far
// that transaction reaches in the PostgreSQL stream:
//
//   - every PostgreSQL transaction whose commit record starts before LSN
//     (the end LSN of the newest transaction fully included) is in Kafka;
//   - when a large PostgreSQL transaction is split across Kafka
//     transactions, Partial names it by the LSN of its commit record and
//     says how many of its outbox events (in stream order) are in.
//
// Record format (JSON, key = slot name, on a compacted topic):
//
//	{"version":1,"slot":"walrelay","system_id":"7713984148484868534",
//	 "timeline":1,"lsn":"0/16B3748","partial":{"commit_lsn":"0/16B3800","events":5000},
//	 "time":"2026-11-29T17:00:00Z"}
//
// "partial" is omitted when the checkpoint falls between transactions.
// "system_id" is the PostgreSQL system identifier (IDENTIFY_SYSTEM) of the
// cluster the LSNs belong to, as a decimal string, and "timeline" the
// timeline they are on; records written before either existed lack it and
// still read (same version: older readers ignore them). LSNs are PostgreSQL's text form. "time" is when it was written, for
// people.
type Durable struct {
	Version  int    `json:"version"`
	Slot     string `json:"slot"`
	SystemID string `json:"-"` // "" in records written before it was stored
	// Timeline is the PostgreSQL timeline the LSNs are on (0 in records
	// written before it was stored): after a failover the new primary's
	// WAL is the old one's only up to the point its timeline forked.
	Timeline int32       `json:"-"`
	LSN      decoder.LSN `json:"-"`
	Partial  *Partial    `json:"-"`
	Time     time.Time   `json:"time"`
}

// Partial is the part of one PostgreSQL transaction already in Kafka.
type Partial struct {
	CommitLSN decoder.LSN // the transaction's commit record (Begin's final LSN)
	Events    int         // its first Events outbox events are in Kafka
}

type durableJSON struct {
	Version  int          `json:"version"`
	Slot     string       `json:"slot"`
	System   string       `json:"system_id,omitempty"`
	Timeline int32        `json:"timeline,omitempty"`
	LSN      string       `json:"lsn"`
	Partial  *partialJSON `json:"partial,omitempty"`
	Time     time.Time    `json:"time"`
}

type partialJSON struct {
	CommitLSN string `json:"commit_lsn"`
	Events    int    `json:"events"`
}

// Marshal encodes d as the checkpoint record value.
func (d Durable) Marshal() []byte {
	j := durableJSON{Version: DurableVersion, Slot: d.Slot, System: d.SystemID, Timeline: d.Timeline, LSN: d.LSN.String(), Time: d.Time.UTC()}
	if d.Partial != nil {
		j.Partial = &partialJSON{CommitLSN: d.Partial.CommitLSN.String(), Events: d.Partial.Events}
	}
	b, _ := json.Marshal(j) // cannot fail: plain fields
	return b
}

// UnmarshalDurable decodes a checkpoint record value.
func UnmarshalDurable(b []byte) (Durable, error) {
	var j durableJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return Durable{}, fmt.Errorf("checkpoint record: %w", err)
	}
	if j.Version < 1 || j.Version > DurableVersion {
		return Durable{}, fmt.Errorf("checkpoint record version %d: this walrelay reads version %d; upgrade it", j.Version, DurableVersion)
	}
	d := Durable{Version: j.Version, Slot: j.Slot, SystemID: j.System, Timeline: j.Timeline, Time: j.Time}
	var err error
	if d.LSN, err = pglogrepl.ParseLSN(j.LSN); err != nil {
		return Durable{}, fmt.Errorf("checkpoint record lsn %q: %w", j.LSN, err)
	}
	if j.Partial != nil {
		p := &Partial{Events: j.Partial.Events}
		if p.CommitLSN, err = pglogrepl.ParseLSN(j.Partial.CommitLSN); err != nil {
			return Durable{}, fmt.Errorf("checkpoint record partial.commit_lsn %q: %w", j.Partial.CommitLSN, err)
		}
		if p.Events < 0 {
			return Durable{}, fmt.Errorf("checkpoint record partial.events %d is negative", p.Events)
		}
		d.Partial = p
	}
	return d, nil
}

// Verify checks that d can be the checkpoint of slot on the PostgreSQL
// system systemID whose WAL has reached serverWAL (IDENTIFY_SYSTEM's
// position). A checkpoint is trusted to skip events, so anyone able to
// write the checkpoint topic could otherwise make the relay skip events;
// a record of another slot or cluster, or ahead of the server, is refused
// with an error naming the fix. legacy reports a record without a system
// identifier (written by an older walrelay): accepted, the caller warns.
func (d Durable) Verify(slot, systemID string, serverWAL decoder.LSN) (legacy bool, err error) {
	const fix = "the relay refuses to skip events on its word: restrict WRITE on the checkpoint topic to the relay's principal, and if this checkpoint is not this slot's, start with a new checkpoint topic (router.Config.CheckpointTopic)"
	switch {
	case d.Slot != slot:
		return false, fmt.Errorf("checkpoint record under key %q names slot %q: %s", slot, d.Slot, fix)
	case d.SystemID != "" && d.SystemID != systemID:
		return false, fmt.Errorf("checkpoint of slot %q was written for PostgreSQL system %s, this server is system %s (another cluster, or a forged record): %s", slot, d.SystemID, systemID, fix)
	case d.LSN > serverWAL:
		return false, &AheadError{fmt.Errorf("checkpoint of slot %q is at %s, beyond the server's WAL position %s (another cluster, a restored backup, or a forged record): %s", slot, d.LSN, serverWAL, fix)}
	case d.Partial != nil && d.Partial.CommitLSN > serverWAL:
		return false, &AheadError{fmt.Errorf("checkpoint of slot %q names a transaction at %s, beyond the server's WAL position %s (another cluster, a restored backup, or a forged record): %s", slot, d.Partial.CommitLSN, serverWAL, fix)}
	}
	return d.SystemID == "", nil
}

// AheadError is Verify's refusal of a checkpoint beyond the server's WAL
// position. That position is only as new as the IDENTIFY_SYSTEM that
// reported it: one read before the slot was held can be older than what
// the slot's previous holder committed meanwhile, so such a caller reads
// the position again and verifies once more before the refusal is final.
type AheadError struct{ err error }

func (e *AheadError) Error() string { return e.err.Error() }

// Forked is d on a timeline that forked from d's at switchpoint (a
// failover): the WAL after switchpoint is another history, whose
// transactions d cannot vouch for, so what it covers is cut there. cut
// reports whether it reached past it.
func (d Durable) Forked(switchpoint decoder.LSN) (forked Durable, cut bool) {
	if d.LSN > switchpoint {
		d.LSN, cut = switchpoint, true
	}
	if d.Partial != nil && d.Partial.CommitLSN >= switchpoint {
		d.Partial, cut = nil, true
	}
	return d, cut
}

// Skip decides, from the checkpoint a relay found at start, which events
// PostgreSQL resends were already delivered. It is the exactly-once side
// of "the slot may be behind the checkpoint after a crash".
type Skip struct {
	d     Durable
	valid bool
	// current transaction
	skipAll bool
	skipN   int
}

// NewSkip returns a Skip for d; ok false means no checkpoint (skip nothing).
func NewSkip(d Durable, ok bool) *Skip { return &Skip{d: d, valid: ok} }

// Begin starts a transaction whose commit record is at commitLSN (the
// Begin message's final LSN).
func (s *Skip) Begin(commitLSN decoder.LSN) {
	s.skipAll, s.skipN = false, 0
	if !s.valid {
		return
	}
	switch {
	case commitLSN < s.d.LSN:
		// Its commit record starts before the end of a transaction that is
		// fully in Kafka: it committed earlier, so it is fully in too.
		s.skipAll = true
	case s.d.Partial != nil && commitLSN == s.d.Partial.CommitLSN:
		s.skipN = s.d.Partial.Events
	}
}

// Event reports whether the next outbox event of the current transaction
// was already delivered.
func (s *Skip) Event() bool {
	if s.skipAll {
		return true
	}
	if s.skipN > 0 {
		s.skipN--
		return true
	}
	return false
}
