package slot

// failover.go: whether a failover of the primary keeps the slot.
//
// Before PostgreSQL 17 a logical slot lives on the primary only: after a
// failover the new primary has none, and the record (record.go) makes
// walrelay refuse to go on there. From 17 a failover slot is copied to
// standbys that run with sync_replication_slots = on, and
// synchronized_standby_slots on the primary holds logical decoding back
// until the standbys named there have the WAL: without it a standby may be
// behind what walrelay already published, and after its promotion Kafka
// holds events of transactions the new primary never had.

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Failover is what a failover of the slot's server would do to the slot.
type Failover struct {
	// Supported: the server has failover slots (PostgreSQL 17+).
	Supported bool
	// Slot: the slot is a failover slot.
	Slot bool
	// StandbySlots are the physical slots synchronized_standby_slots
	// names; Missing those of them that do not exist or no standby
	// streams from.
	StandbySlots, Missing []string
	// Standbys is the number of physical standbys streaming from the
	// server now.
	Standbys int
}

// Protected reports whether a promoted standby has the slot at a position
// no later than the WAL it received: a failover slot, held back by
// synchronized_standby_slots whose standbys all stream.
func (f Failover) Protected() bool {
	return f.Slot && len(f.StandbySlots) > 0 && len(f.Missing) == 0
}

// ReadFailover reads the failover state of a slot whose row is info.
func ReadFailover(ctx context.Context, conn *pgx.Conn, info Info) (Failover, error) {
	var f Failover
	var version int
	var standbySlots string
	// pg_stat_replication shows a role without pg_read_all_stats (the
	// relay's least-privileged one) the pid of another role's walsender
	// and nothing else: a row without a state is counted as streaming.
	err := conn.QueryRow(ctx, `SELECT current_setting('server_version_num')::int, coalesce(current_setting('synchronized_standby_slots', true), ''),
			(SELECT count(*) FROM pg_stat_replication WHERE coalesce(state, 'streaming') = 'streaming' AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = pg_stat_replication.pid AND s.slot_type = 'logical'))`).
		Scan(&version, &standbySlots, &f.Standbys)
	if err != nil {
		return f, fmt.Errorf("read the failover settings: %w", err)
	}
	f.Supported = version >= failoverSlots
	f.Slot = info.Failover != nil && *info.Failover
	for _, s := range strings.Split(standbySlots, ",") {
		if s = strings.TrimSpace(s); s != "" {
			f.StandbySlots = append(f.StandbySlots, s)
		}
	}
	if len(f.StandbySlots) == 0 {
		return f, nil
	}
	rows, err := conn.Query(ctx, `SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' AND active AND slot_name = ANY($1)`, f.StandbySlots)
	if err != nil {
		return f, fmt.Errorf("read the standbys' slots: %w", err)
	}
	active, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return f, fmt.Errorf("read the standbys' slots: %w", err)
	}
	for _, s := range f.StandbySlots {
		if !slices.Contains(active, s) {
			f.Missing = append(f.Missing, s)
		}
	}
	return f, nil
}

// Describe says in one sentence what a failover would do to the slot, and
// whether that needs the operator's attention.
func (f Failover) Describe() (text string, warn bool) {
	switch {
	case !f.Supported && f.Standbys > 0:
		return fmt.Sprintf("PostgreSQL before 17 keeps logical slots on the primary only: a failover to one of its %d standbys loses the slot, and walrelay then refuses to go on until the gap is accepted (PostgreSQL 17's failover slots carry the slot over)", f.Standbys), true
	case !f.Supported:
		return "no standby streams from this server; PostgreSQL before 17 has no failover slots", false
	case !f.Slot:
		return "the slot is not a failover slot: a failover loses it (turn on slot.SetupConfig.Failover, or ALTER_REPLICATION_SLOT ... (FAILOVER true))", f.Standbys > 0
	case len(f.StandbySlots) == 0:
		return "failover slot, but synchronized_standby_slots is empty: a standby may be behind what walrelay published, and after a failover to it Kafka would hold events of transactions the new primary never had; set synchronized_standby_slots on the primary to the standbys' physical slots (and sync_replication_slots = on, hot_standby_feedback = on on the standbys)", true
	case len(f.Missing) > 0:
		return fmt.Sprintf("failover slot, but no standby streams from %s, named in synchronized_standby_slots: PostgreSQL holds walrelay's stream back until it does", strings.Join(f.Missing, ", ")), true
	default:
		return fmt.Sprintf("failover slot, held back by synchronized_standby_slots = %s until those standbys have the WAL: a promoted standby keeps the slot", strings.Join(f.StandbySlots, ", ")), false
	}
}
