package relay

// standby.go: what the slot poller reads of a hot standby the relay
// decodes on (Config.PrimaryURL): whether it was promoted, and how far its
// replay is behind what it received, the part of the relay's lag that
// PostgreSQL adds before decoding sees a commit.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/doctor"
)

// watchStandby reads the standby's replay on conn, the standby, for the
// metrics, and notices its promotion: from then on the relay writes to it.
func (p *slotPoller) watchStandby(ctx context.Context, conn *pgx.Conn) {
	if p.cfg.PrimaryURL == "" || p.live.promoted.Load() {
		return
	}
	var inRecovery, paused bool
	var lagBytes int64
	var lagSeconds float64
	err := conn.QueryRow(ctx, `SELECT pg_is_in_recovery(),
		       CASE WHEN pg_is_in_recovery() THEN pg_is_wal_replay_paused() ELSE false END,
		       coalesce(greatest(pg_last_wal_receive_lsn() - pg_last_wal_replay_lsn(), 0), 0)::bigint,
		       CASE WHEN pg_last_wal_receive_lsn() IS NULL OR pg_last_wal_receive_lsn() <= pg_last_wal_replay_lsn() THEN 0
		            ELSE coalesce(extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp()), 0) END::float8`).
		Scan(&inRecovery, &paused, &lagBytes, &lagSeconds)
	if err != nil {
		if ctx.Err() == nil {
			p.log.Debug("cannot read the standby's replay", zap.Error(err))
		}
		return
	}
	if !inRecovery {
		p.replay.Clear()
		p.live.promoted.Store(true)
		p.metrics.StandbyReplayLagBytes.Clear()
		p.metrics.StandbyReplayLagSeconds.Clear()
		p.metrics.StandbyReplayPaused.Clear()
		p.metrics.StandbyPrimaryReachable.Clear() // it writes to itself from now on
		p.log.Warn("the standby the relay decodes on was promoted: the slot stays, and the relay writes its heartbeat and record to it from now on; leave relay.Config.PrimaryURL out at the next start",
			zap.String("slot", p.cfg.Slot))
		if p.cfg.ExactlyOnce {
			// The session's checkpoints name the timeline it started on;
			// a new session names the promoted server's, so that a later
			// start does not take them for the old primary's WAL past the
			// fork and publish what follows it again.
			p.live.endSession(errors.New("the standby was promoted: a new session records its new timeline in the checkpoints"))
		}
		return
	}
	p.metrics.StandbyReplayLagBytes.Set(float64(lagBytes))
	p.metrics.StandbyReplayLagSeconds.Set(lagSeconds)
	if paused {
		p.metrics.StandbyReplayPaused.Set(1)
	} else {
		p.metrics.StandbyReplayPaused.Set(0)
	}
	lag := time.Duration(lagSeconds * float64(time.Second))
	switch {
	case paused:
		p.replay.Hold("Paused", fmt.Sprintf("replay is paused on the standby the relay decodes on (%s of WAL received and not replayed): nothing committed since reaches the relay; resume it with SELECT pg_wal_replay_resume() on the standby", doctor.BytesText(lagBytes)))
	case p.cfg.ReadyMaxLag > 0 && lag > p.cfg.ReadyMaxLag:
		p.replay.Hold("Lagging", fmt.Sprintf("the standby the relay decodes on replays %s behind what it received (%s of WAL), more than relay.Config.ReadyMaxLag %s: decoding sees a commit only once replayed; look for a recovery conflict or a slow disk on the standby", lag.Round(time.Second), doctor.BytesText(lagBytes), p.cfg.ReadyMaxLag))
	default:
		p.replay.Clear()
	}
}
