package doctor

// invalidation.go: a slot PostgreSQL invalidated, and the way on.
//
// An invalidated slot keeps no WAL and nothing can stream from it again:
// it is something walrelay streamed from that is gone for good, like a
// slot lost in a failover. So it is refused as a gap (*slot.GapError,
// naming PostgreSQL's reason and the setting behind it), and the way on is
// the one for every gap: accepting it (source.SetupConfig.AcceptGap),
// which here drops the invalidated slot and creates a new one at the
// current position, recording the gap, then a snapshot of the rows still
// in the outbox (relay.PublishSnapshot). A slot that is gone altogether
// is refused the same way (SlotGoneError).

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// invalidation says why PostgreSQL invalidated a slot, and what to set so
// that the next one lasts.
type invalidation struct {
	// Reason is PostgreSQL's word (wal_removed, idle_timeout, rows_removed,
	// wal_level_insufficient) or, when an older server cannot tell two
	// apart, both ("rows_removed or wal_level_insufficient").
	Reason string
	// Source says Reason as the server has it: "invalidation_reason = X"
	// (17+), or Reason and what an older server reports instead.
	Source string
	// Cause says, with the setting behind it, what happened.
	Cause string
	// Prevent is the setting that keeps the next slot.
	Prevent string
}

// invalidationOf tells why the slot of info was invalidated. PostgreSQL 17+
// reports invalidation_reason. 16 reports wal_status = lost (and
// conflicting = true for any invalidated logical slot, so that says
// nothing): a conflict with recovery (rows_removed or
// wal_level_insufficient, not which) happens only on a standby and keeps
// restart_lsn, wal_removed clears it. Before 16 the only way to lose a
// slot is max_slot_wal_keep_size (wal_removed).
func invalidationOf(i slot.Info, s Settings) invalidation {
	var inv invalidation
	switch {
	case i.InvalidationReason != "":
		inv.Reason, inv.Source = i.InvalidationReason, "invalidation_reason = "+i.InvalidationReason
	case i.ServerVersion >= 170000:
		// The WAL is gone and the next checkpoint sets the reason.
		inv.Reason = "wal_removed"
		inv.Source = inv.Reason + ": wal_status = lost before PostgreSQL set invalidation_reason"
	case i.ServerVersion >= 160000 && s.InRecovery && i.RestartLSN != 0:
		// 16 says conflicting = true for every invalidated logical slot,
		// but only wal_removed clears restart_lsn, and only a standby
		// conflicts with recovery.
		inv.Reason = "rows_removed or wal_level_insufficient"
		inv.Source = inv.Reason + ": PostgreSQL 16 reports wal_status = lost on a standby with restart_lsn kept, a conflict with recovery, not which"
	case i.ServerVersion >= 160000:
		inv.Reason = "wal_removed"
		inv.Source = inv.Reason + ": PostgreSQL 16 reports wal_status = lost; with restart_lsn cleared, or on a primary, only max_slot_wal_keep_size invalidates a slot"
	default:
		inv.Reason = "wal_removed"
		inv.Source = inv.Reason + ": PostgreSQL before 16 reports wal_status = lost, and only max_slot_wal_keep_size invalidates a slot there"
	}
	switch inv.Reason {
	case "wal_removed":
		inv.Cause = fmt.Sprintf("it needed more WAL than max_slot_wal_keep_size = %s while no relay confirmed, and PostgreSQL removed it", s.MaxSlotWALKeepSize)
		inv.Prevent = "raise max_slot_wal_keep_size to hold the WAL the server writes during a relay outage (or -1, no limit, if the disk holds it)"
	case "idle_timeout":
		inv.Cause = fmt.Sprintf("no client streamed from it for longer than idle_replication_slot_timeout = %s", s.IdleSlotTimeout)
		inv.Prevent = "set idle_replication_slot_timeout to 0 (never) or longer than a relay outage can last"
	case "rows_removed":
		inv.Cause = fmt.Sprintf("the primary removed catalog rows it still needed (hot_standby_feedback = %s here)", s.HotStandbyFeedback)
		inv.Prevent = "on the standby, set hot_standby_feedback = on and primary_slot_name, so that the primary keeps the rows"
	case "wal_level_insufficient":
		inv.Cause = fmt.Sprintf("wal_level on the primary was lowered below logical (wal_level = %s here)", s.WALLevel)
		inv.Prevent = "keep wal_level = logical on the primary"
	default:
		inv.Cause = fmt.Sprintf("on a standby, either the primary removed catalog rows it needed (hot_standby_feedback = %s here) or the primary's wal_level was lowered below logical", s.HotStandbyFeedback)
		inv.Prevent = "on the standby set hot_standby_feedback = on with a primary_slot_name, and keep wal_level = logical on the primary"
	}
	return inv
}

// InvalidatedError is the refusal for a slot PostgreSQL invalidated,
// whoever finds it (setup, the start of a stream, the slot watch): a
// *slot.GapError, since an invalidated slot is something walrelay
// streamed from that is gone for good. Events committed after since (the
// later of the slot's and walrelay's confirmed positions) may be missing.
// The way on is accepting the gap (which drops the lost slot and creates a
// new one, recording it), then a snapshot.
func InvalidatedError(info slot.Info, s Settings, since decoder.LSN) *slot.GapError {
	inv := invalidationOf(info, s)
	return &slot.GapError{
		What: fmt.Sprintf("replication slot %q was invalidated by PostgreSQL (%s): %s", info.Name, inv.Source, inv.Cause),
		// PostgreSQL keeps confirmed_flush_lsn of an invalidated slot.
		Since: max(since, info.ConfirmedLSN),
		Fix:   "nothing can stream from an invalidated slot again (accepting the gap, source.SetupConfig.AcceptGap, drops it and creates a new one); so that the next one lasts, " + inv.Prevent,
	}
}

// ReadInvalidatedError is InvalidatedError with the settings read on conn;
// when they cannot be read the refusal names the reason alone.
func ReadInvalidatedError(ctx context.Context, conn *pgx.Conn, info slot.Info, since decoder.LSN) *slot.GapError {
	s, err := readSettings(ctx, conn)
	if err != nil {
		s = Settings{MaxSlotWALKeepSize: "?", IdleSlotTimeout: "?", WALLevel: "?", HotStandbyFeedback: "?"}
	}
	return InvalidatedError(info, s, since)
}

// SlotGoneError is the refusal for a slot that no longer exists though
// walrelay's record rec describes it: lost in a failover, dropped by hand,
// or dropped by Patroni, which drops a slot its configuration does not
// name whenever it looks at the slots (a restart of PostgreSQL or of
// Patroni, a switchover, a failover) and no client streams from it. A
// slot no relay ever streamed from (rec.NeverStreamed: walrelay setup
// created it, and it was gone before walrelay run) is said to be so, with
// Patroni first among the causes. onStandby says walrelay decoded it on a
// hot standby, whose slot lives and dies with that server (no failover
// slot can be made there), so the fix is the standby's, not failover
// slots'. The gap is the same either way: nothing after rec's position
// reached Kafka from that slot.
func SlotGoneError(name string, rec Recorded, onStandby bool) *slot.GapError {
	where := fmt.Sprintf("its record in %s, written %s, has it confirmed at %s", rec.Table, rec.UpdatedAt.UTC().Format(time.RFC3339), rec.ConfirmedLSN)
	if rec.NeverStreamed {
		what := fmt.Sprintf("replication slot %q is gone, and no relay ever streamed from it: walrelay set it up (%s), and it was dropped before a relay started, or lost in a failover to a standby without a copy of it",
			name, where)
		fix := patroniDrops(name, onStandby) + "; else an operator or another tool dropped it (the PostgreSQL log says when)"
		if onStandby {
			fix += ", or the hot standby it was created on was rebuilt from a new base backup"
		}
		return &slot.GapError{What: what, Since: rec.ConfirmedLSN, Fix: fix}
	}
	fix := "a failover loses a slot unless it is a failover slot synchronized to the promoted standby (PostgreSQL 17+: source.SetupConfig.Failover, sync_replication_slots on the standby, synchronized_standby_slots on the primary) or a tool keeps a copy on the standby (Patroni's slots:); " + patroniDrops(name, onStandby)
	if onStandby {
		fix = "a slot decoded on a hot standby exists on that server alone: rebuilding the standby from a new base backup, or losing it, loses the slot; keep the standby's data directory (restart it, do not rebuild it) while walrelay decodes on it; " + patroniDrops(name, onStandby)
	}
	return &slot.GapError{
		What:  fmt.Sprintf("replication slot %q is gone, though walrelay streamed from it (%s)", name, where),
		Since: rec.ConfirmedLSN,
		Fix:   fix,
	}
}

// SlotDroppedError is the refusal for a slot that vanished between two
// streams of a running relay, which had confirmed up to since: dropped by
// an operator, by Patroni (a slot it does not know, while the relay
// reconnected), or lost in a failover; onStandby as for SlotGoneError.
func SlotDroppedError(name string, onStandby bool, since decoder.LSN) *slot.GapError {
	how := "by an operator, by Patroni while no client streamed from it, or lost in a failover: only a failover slot synchronized to the promoted standby (PostgreSQL 17+) or a copy a tool keeps there (Patroni's slots:) survives one"
	if onStandby {
		how = "by an operator, by Patroni while no client streamed from it, or with the hot standby it was decoded on: rebuilding or losing the standby loses its slot"
	}
	return &slot.GapError{
		What:  fmt.Sprintf("replication slot %q was dropped while walrelay streamed from it (%s)", name, how),
		Since: since,
		Fix:   patroniDrops(name, onStandby),
	}
}

// patroniDrops says that Patroni drops a slot its dynamic configuration
// does not name (when it looks at the slots: a restart of PostgreSQL or of
// Patroni, a switchover, a failover) if no client streams from it then,
// and the two ways to keep it. On a standby walrelay decodes on, only
// ignore_slots does: Patroni's permanent slots are the primary's, which it
// copies to replicas, over the standby's own.
func patroniDrops(name string, onStandby bool) string {
	keep := fmt.Sprintf("name it in its dynamic configuration (patronictl edit-config: slots: {%s: {type: logical, database: <the database>, plugin: pgoutput}}), which also has Patroni keep a copy on each replica that carries the slot through a failover, or exempt it (ignore_slots: [{name: %s}])", name, name)
	if onStandby {
		keep = fmt.Sprintf("exempt it (ignore_slots: [{name: %s}] in its dynamic configuration)", name)
	}
	return fmt.Sprintf("under Patroni, a slot its dynamic configuration does not name is dropped when no client streams from it and Patroni looks at the slots (a restart of PostgreSQL or of Patroni, a switchover, a failover; Patroni's log: \"Dropped unknown replication slot '%s'\"): %s", name, keep)
}
