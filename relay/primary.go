package relay

// primary.go: whether the relay reaches the primary of the hot standby it
// decodes on (Config.PrimaryURL), where it writes its heartbeat and
// record. Decoding needs no primary: when it is gone (failed over to
// another server, with PrimaryURL naming the old one alone) the relay
// streams on with what the standby replays, and says so once, with the
// fix, rather than a failure line every beat and every poll.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/slot"
)

// primaryCheckTimeout bounds reaching the primary at a poll: a primary
// whose machine vanished may leave a connection hanging rather than
// refused.
const primaryCheckTimeout = 10 * time.Second

// primaryWatch is what the slot poller knows of the primary between polls.
type primaryWatch struct {
	down   bool
	warned time.Time
	// recordFails counts the record writes that failed in a row, on a
	// primary that took a connection; recordWarned is when that was
	// last logged at WARN.
	recordFails  int
	recordWarned time.Time
}

// reachPrimary returns a connection to the primary at url that takes
// writes, conn itself while it still works, or nil when there is none;
// it sets walrelay_standby_primary_reachable and logs when the primary
// becomes unreachable (again every heartbeat.FailureWarnEvery while it
// stays so) and when it is back.
func (p *slotPoller) reachPrimary(ctx context.Context, conn *pgx.Conn, url string, pw *primaryWatch) *pgx.Conn {
	cctx, cancel := context.WithTimeout(ctx, primaryCheckTimeout)
	defer cancel()
	conn, err := primaryTakingWrites(cctx, conn, url)
	if ctx.Err() != nil {
		return conn
	}
	if err == nil {
		p.metrics.StandbyPrimaryReachable.Set(1)
		if pw.down {
			p.log.Info("the primary (relay.Config.PrimaryURL) is reachable again: the heartbeat and walrelay's record are written there again",
				zap.String("primary", slot.Redact(url)))
		}
		pw.down = false
		return conn
	}
	p.metrics.StandbyPrimaryReachable.Set(0)
	now := time.Now()
	if !pw.down || now.Sub(pw.warned) >= heartbeat.FailureWarnEvery {
		p.log.Warn("the primary (relay.Config.PrimaryURL) is unreachable or takes no writes: the heartbeat and walrelay's record cannot be written, so a quiet outbox no longer moves the slot and a refusal after a failover would name an older position; decoding goes on with what this standby replays. "+
			"If the primary failed over to another server: repoint relay.Config.PrimaryURL to the new primary and restart the relay, or give a multi-host URL naming every node with target_session_attrs=read-write, which follows the primary without a restart (and repoint the standby's primary_conninfo and primary_slot_name)",
			zap.String("primary", slot.Redact(url)), zap.String("slot", p.cfg.Slot), zap.Error(err))
		pw.warned = now
	} else {
		p.log.Debug("the primary is still unreachable", zap.Error(err))
	}
	pw.down = true
	return nil
}

// recordFailed logs a record write that failed on a primary that took a
// connection: at WARN at the first failure in a row and every
// heartbeat.FailureWarnEvery after.
func (pw *primaryWatch) recordFailed(log *zap.Logger, err error) {
	pw.recordFails++
	now := time.Now()
	if pw.recordFails == 1 || now.Sub(pw.recordWarned) >= heartbeat.FailureWarnEvery {
		pw.recordWarned = now
		log.Warn("cannot move walrelay's record forward; a refusal after a failover would name an older position; retrying at every poll",
			zap.Int("failures_in_a_row", pw.recordFails), zap.Error(err))
		return
	}
	log.Debug("cannot move walrelay's record forward", zap.Int("failures_in_a_row", pw.recordFails), zap.Error(err))
}

// primaryTakingWrites returns conn, or a new connection to url when conn
// is nil or closed, once its server answered that it takes writes; else
// nil and why not.
func primaryTakingWrites(ctx context.Context, conn *pgx.Conn, url string) (*pgx.Conn, error) {
	var err error
	if conn == nil || conn.IsClosed() {
		if conn, err = slot.Connect(ctx, url); err != nil {
			return nil, err
		}
	}
	var inRecovery bool
	// A single-host URL may name a server that came back as a standby; a
	// multi-host one with target_session_attrs=read-write never connects
	// to one, but a connection made earlier may outlive its server's
	// demotion.
	if err = conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err == nil && inRecovery {
		err = errors.New("the server is a hot standby now: it takes no writes")
	}
	if err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	return conn, nil
}

// primaryAtStart explains a start that failed (err) while decoding on a
// standby whose primary cannot be reached or takes no writes: the start
// needs it (its checks, walrelay's record), and the fix is to repoint
// Config.PrimaryURL. err as it is when the primary answers.
func (r *Relay) primaryAtStart(ctx context.Context, err error) error {
	if r.cfg.PrimaryURL == "" || r.live.promoted.Load() || ctx.Err() != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, primaryCheckTimeout)
	defer cancel()
	conn, perr := primaryTakingWrites(cctx, nil, r.cfg.PrimaryURL)
	if perr == nil {
		conn.Close(context.Background())
		r.metrics.StandbyPrimaryReachable.Set(1)
		return err
	}
	if ctx.Err() != nil {
		return err
	}
	r.metrics.StandbyPrimaryReachable.Set(0)
	return fmt.Errorf("the primary relay.Config.PrimaryURL names is unreachable or takes no writes, and a start decoding on its standby needs it (its checks, walrelay's record); if it failed over to another server, repoint relay.Config.PrimaryURL to the new primary, or give a multi-host URL naming every node with target_session_attrs=read-write: %w", err)
}
