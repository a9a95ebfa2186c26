package doctor

// status.go: the slot's health verdict, as `walrelay status` prints it:
// the slot's figures, what a failover would do to it, the time it has
// left, what holds it (with StatusOptions.Explain), and the problems that
// make it unhealthy apart from the warnings that only need a look.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/slot"
)

// StatusOptions say which slot to judge, and by what.
type StatusOptions struct {
	Slot string
	// Record is walrelay's record of the slot; nil when there is none.
	Record *Recorded
	// MaxLagBytes makes a confirmed lag above it a problem; 0 disables.
	MaxLagBytes int64
	// RequireActive makes a slot no relay streams from a problem, not a
	// warning.
	RequireActive bool
	// StandbyURLs are the standbys whose copies of the slot are read
	// (ReadFailover).
	StandbyURLs []string
	// DecodedOnStandby says the slot, on a hot standby, is decoded there
	// (relay.Config.PrimaryURL): its own, not a copy of the primary's,
	// even while no relay streams from it.
	DecodedOnStandby bool
	// PrimaryUnreachable, with DecodedOnStandby, is why the primary could
	// not be reached or takes no writes; empty when it was reached.
	PrimaryUnreachable string
	// Explain names what holds the slot (Status.Explain).
	Explain bool
	// RateWindow is how long the server's WAL position is watched, when
	// max_slot_wal_keep_size limits the slot, to measure the time left
	// before invalidation; 0 skips it.
	RateWindow time.Duration
	// PlannedOutage is the relay outage the slot must survive: less time
	// left than that is a warning; 0 disables.
	PlannedOutage time.Duration
	// Relay is what the running relay reports of itself (its /status),
	// read at RelayURL: each hold on delivery is a problem. Nil when not
	// read; RelayUnreadable then says why, when it was tried.
	Relay           *holds.Status
	RelayURL        string
	RelayUnreadable string
}

// Status is a slot's health, as status prints it (its JSON is status
// --json's).
type Status struct {
	Slot              string `json:"slot"`
	Plugin            string `json:"plugin"`
	Database          string `json:"database"`
	Active            bool   `json:"active"`
	ActivePID         *int32 `json:"active_pid"`
	RestartLSN        string `json:"restart_lsn"`
	ConfirmedFlushLSN string `json:"confirmed_flush_lsn"`
	CurrentLSN        string `json:"current_lsn"`
	RetainedWALBytes  int64  `json:"retained_wal_bytes"`
	ConfirmedLagBytes int64  `json:"confirmed_lag_bytes"`
	WALStatus         string `json:"wal_status"`
	SafeWALSize       *int64 `json:"safe_wal_size"`
	// WALRate is the server's WAL rate over StatusOptions.RateWindow, and
	// TimeToInvalidation how long safe_wal_size lasts at it; both are
	// measured only when max_slot_wal_keep_size limits the slot.
	WALRate            *float64 `json:"wal_rate_bytes_per_second"`
	TimeToInvalidation *float64 `json:"time_to_invalidation_seconds"`
	// InactiveSince is PostgreSQL 17+'s inactive_since; RecordUpdatedAt
	// when walrelay last moved its record, the nearest an older server has.
	InactiveSince   *time.Time `json:"inactive_since"`
	RecordUpdatedAt *time.Time `json:"record_updated_at"`
	// InvalidationReason is why PostgreSQL invalidated the slot (empty
	// when it is not), InvalidationSource where the reason comes from.
	InvalidationReason string `json:"invalidation_reason"`
	InvalidationSource string `json:"invalidation_source"`
	// Failover says what a failover of the primary does to the slot.
	Failover string `json:"failover"`
	// StandbyReplay is, when the slot is on a hot standby, how far its
	// replay is behind what it received: part of the relay's lag (null
	// on a primary).
	StandbyReplay *StandbyReplay `json:"standby_replay"`
	// Creating is, while a relay creates the slot, what the creation waits
	// for (null otherwise): the slot's figures are then empty.
	Creating *CreationStatus `json:"creating"`
	// Relay is what the running relay reports of itself
	// (StatusOptions.Relay: ready or why not, and what holds delivery);
	// null when it was not read.
	Relay *holds.Status `json:"relay"`
	// Explain is what holds the slot, with StatusOptions.Explain (null
	// without).
	Explain  []Cause  `json:"explain"`
	Healthy  bool     `json:"healthy"`
	Problems []string `json:"problems"`
	// Warnings need a look but do not make the slot unhealthy.
	Warnings []string `json:"warnings"`
}

// CreationStatus is a creation of the slot under way (Creation).
type CreationStatus struct {
	WalsenderPID int32 `json:"walsender_pid"`
	// CreatingSlot is the slot the walsender creates: the slot, or the
	// initial snapshot's temporary slot.
	CreatingSlot  string  `json:"creating_slot"`
	WaitedSeconds float64 `json:"waited_seconds"`
	// WaitXid is the xid it waits on now (0 between two rounds).
	WaitXid    int64  `json:"wait_xid"`
	WaitingFor string `json:"waiting_for"`
	Fix        string `json:"fix"`
}

// notStreamed is the warning (or, with StatusOptions.RequireActive, the
// problem) of a slot no client reads: it holds WAL and nothing is
// published.
const notStreamed = "no relay is streaming from this slot: it keeps WAL and nothing is published until one does (start relay.Relay.Run, or drop the slot with walrelay's record of it if no relay is to stream from it again)"

// ReadStatus reads the slot's status on conn and judges its health. A
// slot that is gone though walrelay's record says it streamed from it is
// a *slot.GapError (SlotGoneError); a slot that does not exist otherwise
// is slot.ErrNoSlot, unless a relay is creating it.
func ReadStatus(ctx context.Context, conn *pgx.Conn, o StatusOptions) (Status, error) {
	info, err := slot.ReadInfo(ctx, conn, o.Slot)
	if errors.Is(err, slot.ErrNoSlot) || err == nil && info.Active && info.ConfirmedLSN == 0 {
		// Missing, or in pg_replication_slots without a consistent point
		// yet: a relay may be creating it, waiting for transactions.
		cr, err := ReadCreation(ctx, conn, o.Slot)
		if err != nil {
			return Status{}, err
		}
		if cr != nil {
			return o.creating(cr), nil
		}
	}
	if errors.Is(err, slot.ErrNoSlot) && o.Record != nil {
		return Status{}, SlotGoneError(o.Slot, *o.Record, o.DecodedOnStandby)
	}
	if err != nil {
		return Status{}, err
	}
	failover, err := ReadFailover(ctx, conn, info, o.StandbyURLs)
	if err != nil {
		return Status{}, err
	}
	failover.DecodedHere = failover.DecodedHere || failover.Local != nil && o.DecodedOnStandby
	settings, err := readSettings(ctx, conn)
	if err != nil {
		return Status{}, err
	}
	st := Status{
		Slot: info.Name, Plugin: info.Plugin, Database: info.Database, Active: info.Active, ActivePID: info.ActivePID,
		RestartLSN: info.RestartLSN.String(), ConfirmedFlushLSN: info.ConfirmedLSN.String(), CurrentLSN: info.CurrentLSN.String(),
		RetainedWALBytes: info.RetainedWALBytes, ConfirmedLagBytes: info.LagBytes, WALStatus: info.WALStatus,
		SafeWALSize: info.SafeWALSize, InactiveSince: info.InactiveSince, Problems: []string{}, Warnings: []string{},
	}
	if o.Record != nil {
		st.RecordUpdatedAt = &o.Record.UpdatedAt
	}
	st.judge(o, info, settings)
	if st.StandbyReplay, err = ReadStandbyReplay(ctx, conn); err != nil {
		return Status{}, err
	}
	if r := st.StandbyReplay; r != nil && r.Paused {
		// A paused replay holds every new event: it counts as lag does.
		st.Problems = append(st.Problems, "replay is paused on the standby the slot is on: nothing committed since reaches the relay (SELECT pg_wal_replay_resume() on the standby)")
	} else if r != nil && o.MaxLagBytes > 0 && r.LagBytes > o.MaxLagBytes {
		st.Problems = append(st.Problems, fmt.Sprintf("the standby the slot is on has %s of WAL received and not replayed, above doctor.StatusOptions.MaxLagBytes %s: commits reach the relay only once replayed (look for replay conflicts and slow I/O on the standby)", BytesText(r.LagBytes), BytesText(o.MaxLagBytes)))
	}
	st.judgeRelay(o)
	if o.PrimaryUnreachable != "" {
		st.Problems = append(st.Problems, "the primary relay.Config.PrimaryURL names is unreachable or takes no writes ("+o.PrimaryUnreachable+"): the relay's heartbeat and record are not written; if it failed over, repoint relay.Config.PrimaryURL to the new primary")
	}
	if err := st.timeLeft(ctx, conn, o, info, settings); err != nil {
		return Status{}, err
	}
	text, warn := failover.Describe()
	st.Failover = text
	if warn {
		st.Warnings = append(st.Warnings, text)
	}
	if o.Explain {
		facts, err := ReadFacts(ctx, conn, info)
		if err != nil {
			return Status{}, err
		}
		st.Explain = facts.explain(explainOptions{Record: o.Record})
		if r := st.StandbyReplay; r != nil {
			if c, ok := r.Cause(); ok {
				st.Explain = append([]Cause{c}, st.Explain...)
			}
		}
		if o.PrimaryUnreachable != "" {
			st.Explain = append([]Cause{PrimaryUnreachableCause(o.PrimaryUnreachable)}, st.Explain...)
		}
		if o.Relay != nil {
			st.Explain = append(HoldCauses(o.Relay.Holds, time.Now()), st.Explain...)
		}
		st.Explain = append(st.Explain, failover.Causes()...)
		if st.Explain == nil {
			st.Explain = []Cause{}
		}
	}
	if o.MaxLagBytes > 0 && info.LagBytes > o.MaxLagBytes {
		st.Problems = append(st.Problems, fmt.Sprintf("confirmed lag %s exceeds doctor.StatusOptions.MaxLagBytes %s", BytesText(info.LagBytes), BytesText(o.MaxLagBytes)))
	}
	st.Healthy = len(st.Problems) == 0
	return st, nil
}

// judgeRelay adds what the running relay reports of itself: each hold on
// delivery a problem, as is a relay not ready for another reason; a
// relay that could not be asked is a warning (status may run where the
// relay's listener is not reachable).
func (st *Status) judgeRelay(o StatusOptions) {
	st.Relay = o.Relay
	switch {
	case o.Relay != nil:
		for _, h := range o.Relay.Holds {
			st.Problems = append(st.Problems, fmt.Sprintf("the relay reports delivery held by %s since %s (%s): %s", h.Dependency, h.Since.UTC().Format(time.RFC3339), h.Reason, h.Message))
		}
		if !o.Relay.Ready && len(o.Relay.Holds) == 0 {
			st.Problems = append(st.Problems, "the relay reports itself not ready: "+o.Relay.NotReady)
		}
	case o.RelayUnreadable != "":
		st.Warnings = append(st.Warnings, fmt.Sprintf("the relay's /status at %s could not be read (%s): what holds delivery is not known here", o.RelayURL, o.RelayUnreadable))
	}
}

// HoldCauses are the holds a relay reports, as causes --explain names
// first: a hold on delivery holds the slot behind it too.
func HoldCauses(hs []holds.Hold, now time.Time) []Cause {
	var cs []Cause
	for _, h := range hs {
		cs = append(cs, Cause{Kind: "delivery_held", Holds: "delivery, and the slot: every event after the one waiting waits too (commit order)",
			Text: fmt.Sprintf("the relay reports %s holding delivery (%s) for %s", h.Dependency, h.Reason, DurationText(now.Sub(h.Since))),
			Fix:  h.Message})
	}
	return cs
}

// judge adds the problems and warnings the slot's row and the record
// show: a slot nobody streams from, one invalidated, a relay that refused
// to go on, a slot past max_slot_wal_keep_size.
func (st *Status) judge(o StatusOptions, info slot.Info, settings Settings) {
	if !info.Active && !info.Invalidated() {
		if o.RequireActive {
			st.Problems = append(st.Problems, notStreamed)
		} else {
			st.Warnings = append(st.Warnings, notStreamed)
		}
	}
	if info.Invalidated() {
		inv := invalidationOf(info, settings)
		st.InvalidationReason, st.InvalidationSource = inv.Reason, inv.Source
		since := info.ConfirmedLSN
		if o.Record != nil {
			since = max(since, o.Record.ConfirmedLSN)
		}
		st.Problems = append(st.Problems, InvalidatedError(info, settings, since).Error())
	} else if o.Record != nil && o.Record.Stopped != "" {
		st.Problems = append(st.Problems, fmt.Sprintf("walrelay stopped at %s because %s: it refuses to go on until the gap is accepted (source.SetupConfig.AcceptGap)", o.Record.StoppedAt, o.Record.Stopped))
	}
	if info.WALStatus == "unreserved" {
		st.Problems = append(st.Problems, fmt.Sprintf("wal_status = unreserved: the slot needs WAL past max_slot_wal_keep_size = %s, which PostgreSQL removes at its next checkpoint, invalidating the slot, unless the relay confirms first; get the relay confirming now, or raise max_slot_wal_keep_size (ALTER SYSTEM SET max_slot_wal_keep_size = ...; SELECT pg_reload_conf())", settings.MaxSlotWALKeepSize))
	}
}

// creating is the status of a creation of the slot under way: like a slot
// no relay streams from, a warning, or with RequireActive a problem.
func (o StatusOptions) creating(cr *Creation) Status {
	st := Status{Slot: o.Slot, Problems: []string{}, Warnings: []string{}, Creating: &CreationStatus{
		WalsenderPID: cr.PID, CreatingSlot: cr.Creating, WaitedSeconds: cr.Waited.Seconds(), WaitXid: cr.WaitXid,
		WaitingFor: cr.WaitingFor(), Fix: cr.Fix(),
	}}
	msg := fmt.Sprintf("the slot is not created yet: walrelay is creating it and has waited %s for transactions to end (see waiting_for)", DurationText(cr.Waited))
	if o.RequireActive {
		st.Problems = append(st.Problems, msg)
	} else {
		st.Warnings = append(st.Warnings, msg)
	}
	if o.Explain {
		st.Explain = cr.Causes()
	}
	st.Healthy = len(st.Problems) == 0
	return st
}

// timeLeft measures the WAL rate over RateWindow when
// max_slot_wal_keep_size limits the slot, and warns when the slot's safe
// WAL, or idle_replication_slot_timeout, lasts less than PlannedOutage.
func (st *Status) timeLeft(ctx context.Context, conn *pgx.Conn, o StatusOptions, info slot.Info, s Settings) error {
	plan := o.PlannedOutage
	if d := s.IdleSlotTimeoutDur; d > 0 && !info.Invalidated() {
		switch {
		case !info.Active && info.InactiveSince != nil:
			st.Warnings = append(st.Warnings, fmt.Sprintf("idle_replication_slot_timeout = %s invalidates the slot, inactive since %s, at the first checkpoint after %s (in %s) unless a relay streams from it first",
				s.IdleSlotTimeout, info.InactiveSince.UTC().Format(time.RFC3339), info.InactiveSince.Add(d).UTC().Format(time.RFC3339), DurationText(max(info.InactiveSince.Add(d).Sub(info.Now), 0))))
		case plan > 0 && d < plan:
			st.Warnings = append(st.Warnings, fmt.Sprintf("idle_replication_slot_timeout = %s invalidates the slot once no relay streams from it that long, less than doctor.StatusOptions.PlannedOutage %s: set it to 0 or above %s", s.IdleSlotTimeout, DurationText(plan), DurationText(plan)))
		}
	}
	if info.SafeWALSize == nil || info.Invalidated() || o.RateWindow <= 0 {
		return nil
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(o.RateWindow):
	}
	var at string
	var now time.Time
	err := conn.QueryRow(ctx, "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)::text, now()").Scan(&at, &now)
	if err != nil {
		return fmt.Errorf("read the WAL position: %w", err)
	}
	lsn, err := slot.ParseLSN(at)
	if err != nil {
		return err
	}
	dt := now.Sub(info.Now).Seconds()
	if dt <= 0 || lsn < info.CurrentLSN {
		return nil
	}
	rate := float64(lsn-info.CurrentLSN) / dt
	st.WALRate = &rate
	if rate == 0 {
		return nil
	}
	left := float64(*info.SafeWALSize) / rate
	st.TimeToInvalidation = &left
	if d := time.Duration(left * float64(time.Second)); plan > 0 && d < plan {
		st.Warnings = append(st.Warnings, fmt.Sprintf("at the server's WAL rate (%s/s over %s) the slot's safe_wal_size of %s lasts about %s: max_slot_wal_keep_size = %s invalidates it that soon if it stops moving, less than doctor.StatusOptions.PlannedOutage %s; keep the relay confirming, and raise max_slot_wal_keep_size to at least %s if the disk holds it",
			BytesText(int64(rate)), DurationText(o.RateWindow), BytesText(*info.SafeWALSize), DurationText(d), s.MaxSlotWALKeepSize, DurationText(plan), BytesText(int64(rate*plan.Seconds()))))
	}
	return nil
}
