package doctor

// standby.go: the replay of a hot standby a relay decodes on (PostgreSQL
// 16+): decoding sees a commit only once the standby replayed it, so its
// replay delay is part of the relay's lag, and a paused replay stops the
// relay's stream without anything looking wrong on the slot.

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// StandbyReplay is the replay of the standby a slot is on; nil on a
// primary.
type StandbyReplay struct {
	ReceiveLSN string `json:"receive_lsn"`
	ReplayLSN  string `json:"replay_lsn"`
	// LagBytes is WAL received but not replayed yet; LagSeconds how long
	// ago the last replayed transaction committed on the primary, while
	// there is WAL to replay (0 when caught up).
	LagBytes   int64   `json:"lag_bytes"`
	LagSeconds float64 `json:"lag_seconds"`
	Paused     bool    `json:"paused"`
	// Receiver is the standby's wal receiver (pg_stat_wal_receiver's
	// status: streaming, or absent without one) and Upstream the server it
	// streams from, as the standby names it (sender_host:sender_port):
	// for a standby of a standby (cascading), not the primary.
	Receiver string `json:"wal_receiver,omitempty"`
	Upstream string `json:"upstream,omitempty"`
}

// ReadStandbyReplay reads the replay on conn; nil when conn's server is
// not in recovery.
func ReadStandbyReplay(ctx context.Context, conn *pgx.Conn) (*StandbyReplay, error) {
	var inRecovery bool
	var r StandbyReplay
	err := conn.QueryRow(ctx, `SELECT pg_is_in_recovery(),
		       coalesce(pg_last_wal_receive_lsn()::text, ''), coalesce(pg_last_wal_replay_lsn()::text, ''),
		       CASE WHEN pg_is_in_recovery() THEN pg_is_wal_replay_paused() ELSE false END,
		       coalesce(greatest(pg_last_wal_receive_lsn() - pg_last_wal_replay_lsn(), 0), 0)::bigint,
		       CASE WHEN pg_last_wal_receive_lsn() IS NULL OR pg_last_wal_receive_lsn() <= pg_last_wal_replay_lsn() THEN 0
		            ELSE coalesce(extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp()), 0) END::float8`).
		Scan(&inRecovery, &r.ReceiveLSN, &r.ReplayLSN, &r.Paused, &r.LagBytes, &r.LagSeconds)
	if err != nil {
		return nil, fmt.Errorf("read the standby's replay: %w", err)
	}
	if !inRecovery {
		return nil, nil
	}
	err = conn.QueryRow(ctx, `SELECT coalesce((SELECT status FROM pg_stat_wal_receiver), 'absent'),
		       coalesce((SELECT sender_host || ':' || sender_port FROM pg_stat_wal_receiver), '')`).Scan(&r.Receiver, &r.Upstream)
	if err != nil {
		return nil, fmt.Errorf("read the standby's wal receiver: %w", err)
	}
	return &r, nil
}

func secondsDuration(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// Text is the replay for people.
func (r StandbyReplay) Text() string {
	s := fmt.Sprintf("%s behind what the standby received (%s), replayed to %s", BytesText(r.LagBytes), DurationText(secondsDuration(r.LagSeconds)), r.ReplayLSN)
	if r.Paused {
		s += "; PAUSED"
	}
	switch {
	case r.Receiver == "streaming" && r.Upstream != "":
		s += "; streams from " + r.Upstream
	case r.Receiver != "" && r.Receiver != "streaming":
		s += "; NOT STREAMING (wal receiver " + r.Receiver + ")"
	}
	return s
}

// Cause is the replay as --explain names it, when it holds the relay
// back: paused, or behind.
func (r StandbyReplay) Cause() (Cause, bool) {
	switch {
	case r.Paused:
		return Cause{Kind: "standby_replay_paused", Holds: "the relay's stream: nothing committed since reaches the slot",
			Text: fmt.Sprintf("replay is paused on the standby the slot is on (pg_is_wal_replay_paused()), at %s with %s received and waiting: decoding sees only replayed WAL", r.ReplayLSN, BytesText(r.LagBytes)),
			Fix:  "on the standby, SELECT pg_wal_replay_resume() (it was paused by pg_wal_replay_pause(), or by recovery_target_action = pause at a recovery target)"}, true
	case r.Receiver != "" && r.Receiver != "streaming":
		return Cause{Kind: "standby_not_streaming", Holds: "the relay's stream: nothing the primary commits reaches the standby",
			Text: fmt.Sprintf("the standby the slot is on does not stream (pg_stat_wal_receiver: %s), replayed to %s: decoding sees only WAL the standby receives", r.Receiver, r.ReplayLSN),
			Fix:  "check the standby's primary_conninfo and its log, that its upstream runs, and that its primary_slot_name is a physical slot there (for a standby of a standby, on the standby it streams from); a standby fed by restore_command only gets WAL as the archive does"}, true
	case r.LagBytes > behindBytes:
		return Cause{Kind: "standby_replay_behind", Holds: "the relay's lag: commits reach the slot only once replayed",
			Text: fmt.Sprintf("the standby the slot is on replays %s behind what it received (%s): the delay adds to the relay's lag", BytesText(r.LagBytes), DurationText(secondsDuration(r.LagSeconds))),
			Fix:  "look for replay conflicts and slow I/O on the standby (pg_stat_database_conflicts, max_standby_streaming_delay); recovery_min_apply_delay delays it on purpose"}, true
	}
	return Cause{}, false
}

// PrimaryUnreachableCause is the cause --explain names first when the
// slot is decoded on a hot standby whose primary (relay.Config.PrimaryURL)
// cannot be reached or takes no writes, why being the error met: decoding
// goes on without it, but the relay's heartbeat and record, written
// there, do not.
func PrimaryUnreachableCause(why string) Cause {
	return Cause{Kind: "primary_unreachable", Holds: "the relay's heartbeat and record: a quiet outbox no longer moves the slot",
		Text: "the primary relay.Config.PrimaryURL names is unreachable or takes no writes (" + why + "): the relay decodes what this standby replays, which needs no primary, but cannot write its heartbeat or walrelay's record there",
		Fix: "if the primary failed over to another server: repoint relay.Config.PrimaryURL to the new primary and restart the relay, or give a multi-host URL naming every node with target_session_attrs=read-write, which follows the primary; repoint the standby too " +
			"(on it, ALTER SYSTEM SET primary_conninfo and primary_slot_name, SELECT pg_reload_conf(); the physical slot made on the new primary)"}
}
