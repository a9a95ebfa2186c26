package slot

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/decoder"
)

// FailoverSlots is the first server_version_num with failover slots
// (PostgreSQL 17).
const FailoverSlots = 170000

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
	// CatalogXmin is the oldest transaction whose catalog rows the slot
	// keeps from vacuum; CatalogXminAge how many transactions ago it was
	// (age()). Nil without one.
	CatalogXmin    *int64 `json:"catalog_xmin"`
	CatalogXminAge *int64 `json:"catalog_xmin_age"`
	// InactiveSince is when the slot was last released by the client that
	// streamed from it (PostgreSQL 17+; nil while streamed, and on older
	// servers).
	InactiveSince *time.Time `json:"inactive_since"`
	// InvalidationReason is PostgreSQL's invalidation_reason (17+:
	// wal_removed, rows_removed, wal_level_insufficient, 18's idle_timeout);
	// empty when the server does not report it. Invalidated tells an
	// invalidated slot on every version.
	InvalidationReason string `json:"invalidation_reason"`
	// Conflicting is 16+'s conflicting: on 17+ invalidated by a conflict
	// with recovery (rows_removed or wal_level_insufficient); 16 sets it
	// for every invalidated logical slot.
	Conflicting *bool `json:"conflicting"`
	// ServerVersion is the server's server_version_num.
	ServerVersion int `json:"-"`
	// Now is the server's clock when the row was read.
	Now time.Time `json:"-"`
}

// Invalidated reports whether PostgreSQL invalidated the slot: its WAL or
// catalog rows are gone, and no client can stream from it again.
func (i Info) Invalidated() bool { return i.WALStatus == "lost" || i.InvalidationReason != "" }

// ReadInfo reads the slot's figures on a normal connection.
func ReadInfo(ctx context.Context, conn *pgx.Conn, slot string) (Info, error) {
	var i Info
	var restart, confirmed, current *string
	var walStatus, reason *string
	// Columns newer servers have are read through to_jsonb, NULL where
	// the server lacks them: one query for every version.
	err := conn.QueryRow(ctx, `
		SELECT slot_name, coalesce(plugin, ''), slot_type, coalesce(database, ''), active, active_pid,
		       restart_lsn::text, confirmed_flush_lsn::text,
		       CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END::text,
		       wal_status, safe_wal_size, (to_jsonb(s)->>'failover')::bool, (to_jsonb(s)->>'synced')::bool,
		       catalog_xmin::text::bigint, age(catalog_xmin), (to_jsonb(s)->>'inactive_since')::timestamptz,
		       to_jsonb(s)->>'invalidation_reason', (to_jsonb(s)->>'conflicting')::bool,
		       current_setting('server_version_num')::int, now()
		FROM pg_replication_slots s WHERE slot_name = $1`, slot).Scan(
		&i.Name, &i.Plugin, &i.SlotType, &i.Database, &i.Active, &i.ActivePID,
		&restart, &confirmed, &current, &walStatus, &i.SafeWALSize, &i.Failover, &i.Synced,
		&i.CatalogXmin, &i.CatalogXminAge, &i.InactiveSince, &reason, &i.Conflicting, &i.ServerVersion, &i.Now)
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
	if reason != nil {
		i.InvalidationReason = *reason
	}
	// An invalidated slot keeps no WAL (PostgreSQL 16+ may still show its
	// restart_lsn): counting retained WAL for it would say otherwise.
	if i.RestartLSN != 0 && i.CurrentLSN > i.RestartLSN && !i.Invalidated() {
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
