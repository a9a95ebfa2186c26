package slot

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/walrelay/walrelay/decoder"
)

// ErrNoSlot is returned by ReadInfo when the slot does not exist.
var ErrNoSlot = errors.New("replication slot does not exist")

// Info is a slot's row of pg_replication_slots, with the server's current
// WAL position and the lags derived from it.
type Info struct {
	Name       string      `json:"slot_name"`
	Plugin     string      `json:"plugin"`
	SlotType   string      `json:"slot_type"`
	Database   string      `json:"database"`
	Active     bool        `json:"active"`
	ActivePID  *int32      `json:"active_pid"`
	RestartLSN decoder.LSN `json:"-"`
	// ConfirmedLSN is confirmed_flush_lsn: PostgreSQL does not resend
	// transactions that end at or before it.
	ConfirmedLSN decoder.LSN `json:"-"`
	CurrentLSN   decoder.LSN `json:"-"`
	WALStatus    string      `json:"wal_status"`
	// SafeWALSize is how much more WAL may be written before the slot is
	// in danger of invalidation; nil when max_slot_wal_keep_size is -1.
	SafeWALSize *int64 `json:"safe_wal_size"`
	// RetainedWALBytes is CurrentLSN - RestartLSN: WAL kept for the slot.
	RetainedWALBytes int64 `json:"retained_wal_bytes"`
	// LagBytes is CurrentLSN - ConfirmedLSN.
	LagBytes int64 `json:"confirmed_lag_bytes"`
	// Failover is whether the slot is a failover slot, and Synced whether
	// it is a standby's copy kept in step with the primary's (PostgreSQL
	// 17+; nil on older servers).
	Failover *bool `json:"failover"`
	Synced   *bool `json:"synced"`
}

// ReadInfo reads the slot's figures on a normal connection.
func ReadInfo(ctx context.Context, conn *pgx.Conn, slot string) (Info, error) {
	var i Info
	var restart, confirmed, current *string
	var walStatus *string
	// Columns newer servers have are read through to_jsonb, NULL where
	// the server lacks them: one query for every version.
	err := conn.QueryRow(ctx, `
		SELECT slot_name, coalesce(plugin, ''), slot_type, coalesce(database, ''), active, active_pid,
		       restart_lsn::text, confirmed_flush_lsn::text,
		       CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END::text,
		       wal_status, safe_wal_size, (to_jsonb(s)->>'failover')::bool, (to_jsonb(s)->>'synced')::bool
		FROM pg_replication_slots s WHERE slot_name = $1`, slot).Scan(
		&i.Name, &i.Plugin, &i.SlotType, &i.Database, &i.Active, &i.ActivePID,
		&restart, &confirmed, &current, &walStatus, &i.SafeWALSize, &i.Failover, &i.Synced)
	if errors.Is(err, pgx.ErrNoRows) {
		return Info{}, fmt.Errorf("slot %q: %w", slot, ErrNoSlot)
	}
	if err != nil {
		return Info{}, fmt.Errorf("read pg_replication_slots for %q: %w", slot, err)
	}
	for _, f := range []struct {
		s   *string
		lsn *decoder.LSN
	}{{restart, &i.RestartLSN}, {confirmed, &i.ConfirmedLSN}, {current, &i.CurrentLSN}} {
		if f.s == nil {
			continue
		}
		if *f.lsn, err = ParseLSN(*f.s); err != nil {
			return Info{}, err
		}
	}
	if walStatus != nil {
		i.WALStatus = *walStatus
	}
	if i.RestartLSN != 0 && i.CurrentLSN > i.RestartLSN {
		i.RetainedWALBytes = int64(i.CurrentLSN - i.RestartLSN)
	}
	if i.ConfirmedLSN != 0 && i.CurrentLSN > i.ConfirmedLSN {
		i.LagBytes = int64(i.CurrentLSN - i.ConfirmedLSN)
	}
	return i, nil
}

// ParseLSN parses PostgreSQL's text form of an LSN ("16/B374D848").
func ParseLSN(s string) (decoder.LSN, error) {
	l, err := pglogrepl.ParseLSN(s)
	if err != nil {
		return 0, fmt.Errorf("parse LSN %q: %w", s, err)
	}
	return l, nil
}
