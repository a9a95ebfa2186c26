package relay

// watch.go: the relay's eye on the source database changing under it: the
// publication watch that vouches for every position the session confirms,
// the refusals that stop the relay when something it streamed from was
// replaced or removed, and the failover state of the slot.

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// stuckCheckWarn is how long the publication watch may find a change to
// the publication in progress before it says that confirming waits on it.
const stuckCheckWarn = 10 * time.Second

// watchPublication checks the publication (source.Watch) whenever the
// session has positions to confirm beyond the last one vouched for, at
// most once per ConfirmDelay, and stops the relay with a *slot.GapError
// when it no longer publishes an outbox table the slot streamed from. A
// failed check (the connection) vouches for nothing and is tried again;
// one that finds the server shutting down ends the session.
func (r *Relay) watchPublication(ctx context.Context, stop context.CancelCauseFunc) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	var stuckSince time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.clearance.Wake():
		}
		for ctx.Err() == nil && r.clearance.Behind() {
			began := time.Now()
			if conn == nil || conn.IsClosed() {
				c, err := slot.Connect(ctx, r.cfg.PGURL)
				if err != nil {
					if ctx.Err() == nil {
						r.watchFailed(ctx, err, "cannot connect")
					}
					sleepCtx(ctx, time.Second)
					continue
				}
				conn = c
			}
			ok, err := r.vouch(ctx, conn)
			var gap *slot.GapError
			switch {
			case errors.As(err, &gap):
				r.refuse(ctx, conn, gap)
				stop(gap)
				return
			case err != nil:
				if ctx.Err() == nil {
					r.watchFailed(ctx, err, "the check failed")
				}
				conn.Close(context.Background())
				conn = nil
			case ok:
				stuckSince = time.Time{}
			case stuckSince.IsZero():
				stuckSince = began
			case time.Since(stuckSince) > stuckCheckWarn:
				r.log.Warn("a transaction changing the publication or an outbox table is still open: walrelay confirms nothing past its start until it ends (PostgreSQL would decode past it either way)",
					zap.String("publication", r.cfg.Publication), zap.Duration("for", time.Since(stuckSince).Round(time.Second)))
				stuckSince = time.Now()
			}
			sleepCtx(ctx, time.Until(began.Add(r.cfg.ConfirmDelay)))
		}
	}
}

// vouch runs one check of the publication on conn and moves verified
// forward when it vouches; ok is false when a change was in progress.
func (r *Relay) vouch(ctx context.Context, conn *pgx.Conn) (ok bool, err error) {
	r.watchMu.Lock()
	defer r.watchMu.Unlock()
	if r.watch == nil {
		r.watch = source.NewWatch(r.setupConfig(), r.record, r.log)
	}
	at, ok, err := r.watch.Check(ctx, conn)
	var gap *slot.GapError
	if errors.As(err, &gap) {
		gap.Since = r.Confirmed()
		return false, gap
	}
	if ok {
		r.clearance.Vouch(at)
	}
	return ok, err
}

// vouchFinal checks the publication once more as a session stops, so that
// a clean stop confirms everything Kafka acknowledged (the watch stops
// with the relay's context). A change found then is refused as always.
func (r *Relay) vouchFinal(ctx context.Context, pos decoder.LSN) {
	if pos <= r.clearance.Upto() || r.refused.Load() {
		return
	}
	conn, err := slot.Connect(ctx, r.cfg.PGURL)
	if err != nil {
		r.log.Warn("cannot check the publication before stopping: the last acknowledged events are confirmed at the next start", zap.Error(err))
		return
	}
	defer conn.Close(context.Background())
	var gap *slot.GapError
	if _, err := r.vouch(ctx, conn); errors.As(err, &gap) {
		r.refuse(ctx, conn, gap)
		r.log.Error("stopping: "+gap.Error(), zap.String("slot", r.cfg.Slot))
	}
}

// watchFailed logs a check that could not run, and ends the session when
// the server is shutting down: its walsender waits, before it exits, for
// the relay to confirm the server's last WAL, which cannot be vouched for
// while connections are refused; ending the stream lets the shutdown go on,
// and the next session resumes from the confirmed position. A backend
// ended alone (pg_terminate_backend, an idle timeout) answers the same
// class of error as a shutdown: a new connection that the server accepts
// tells it apart.
func (r *Relay) watchFailed(ctx context.Context, err error, what string) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "57") && r.shuttingDown(ctx, pgErr) {
		r.log.Info("publication watch: the server is shutting down; ending the stream so that its walsender can exit", zap.Error(err))
		if s := r.current.Load(); s != nil {
			select {
			case s.failed <- fmt.Errorf("the server is shutting down: %w", err):
			default:
			}
			s.stream.Interrupt()
		}
		return
	}
	if pgErr != nil && strings.HasPrefix(pgErr.Code, "57") {
		what = "its connection was ended by the server (pg_terminate_backend, or a timeout); reconnecting"
	}
	r.log.Warn("publication watch: "+what+"; nothing is confirmed until it can check the publication", zap.Error(err))
}

// shuttingDown reports whether the server refuses new connections because
// it is shutting down, err being the operator-intervention error (class
// 57) a connection met.
func (r *Relay) shuttingDown(ctx context.Context, err *pgconn.PgError) bool {
	if err.Code == "57P03" { // cannot_connect_now: refused at connection
		return true
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, cerr := slot.Connect(ctx, r.cfg.PGURL)
	if cerr != nil {
		return true // "shutting down" (57P03), or the listener already closed
	}
	conn.Close(context.Background())
	return false
}

// refuse writes down in the record why the relay stops, so that a restart
// refuses too, even after the change was undone. Failing that, the
// refusal still stops this relay; the log says the record could not be
// written.
// refusalWriteTimeout bounds connecting and writing the refusal into the
// record once the relay is stopping.
const refusalWriteTimeout = 15 * time.Second

func (r *Relay) refuse(ctx context.Context, conn *pgx.Conn, gap *slot.GapError) {
	if r.refused.Swap(true) {
		return // the same refusal, found again on the way out
	}
	r.metrics.GapRefusals.Inc()
	// The refusal stops the relay, which may cancel ctx while this runs:
	// the record is written anyway, within refusalWriteTimeout, or the
	// next start would name a vaguer cause.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refusalWriteTimeout)
	defer cancel()
	if conn == nil || conn.IsClosed() {
		c, err := slot.Connect(ctx, r.cfg.PGURL)
		if err != nil {
			r.log.Error("cannot write the refusal into walrelay's record; a restart may not refuse", zap.Error(err))
			return
		}
		defer c.Close(context.Background())
		conn = c
	}
	if err := source.RecordStop(ctx, conn, r.cfg.RecordSchema, r.cfg.Slot, gap.What, gap.Since); err != nil {
		r.log.Error("cannot write the refusal into walrelay's record; a restart may not refuse", zap.Error(err))
	}
}

// sessionGap turns what a stream reported of a vanished publication into
// the relay's refusal, and writes it down.
func (r *Relay) sessionGap(ctx context.Context, err error) error {
	var gone *slot.PublicationGoneError
	if !errors.As(err, &gone) {
		return err
	}
	gap := &slot.GapError{What: "publication " + quoted(gone.Publication) + " was dropped while walrelay streamed from it (the server: " + gone.Message + ")", Since: r.Confirmed()}
	r.refuse(ctx, nil, gap)
	return gap
}

func quoted(s string) string { return `"` + s + `"` }

// logFailover says at startup what a failover of the primary would do to
// the slot, and sets the failover metrics.
func (r *Relay) logFailover(ctx context.Context) {
	conn, err := slot.Connect(ctx, r.cfg.PGURL)
	if err != nil {
		return
	}
	defer conn.Close(context.Background())
	info, err := slot.ReadInfo(ctx, conn, r.cfg.Slot)
	if err != nil {
		return
	}
	f, err := doctor.ReadFailover(ctx, conn, info, r.cfg.StandbyURLs)
	if err != nil {
		r.log.Warn("cannot read the failover settings", zap.Error(err))
		return
	}
	r.recordFailover(f)
}

// recordFailover sets the failover metrics and logs what a failover would
// do whenever that changes (the startup line, and then a standby whose
// copy went stale, a switchover that left the old primary's slot behind):
// a line per change, not per poll.
func (r *Relay) recordFailover(f doctor.Failover) {
	r.metrics.SlotFailover.Set(b2f(f.Slot))
	r.metrics.SlotFailoverProtected.Set(b2f(f.Protected()))
	text, warn := f.Describe()
	key := figures.ReplaceAllString(text, "#")
	r.failoverMu.Lock()
	said := r.failoverSaid == key
	r.failoverSaid = key
	r.failoverMu.Unlock()
	if said {
		return
	}
	if warn {
		r.log.Warn("failover: "+text, zap.String("slot", r.cfg.Slot))
	} else {
		r.log.Info("failover: "+text, zap.String("slot", r.cfg.Slot))
	}
}

// figures are the positions and byte counts of a failover line, which
// move at every poll without changing what it says.
var figures = regexp.MustCompile(`[0-9A-F]+/[0-9A-F]+|[0-9.]+ (B|KiB|MiB|GiB|TiB)( \([0-9]+ bytes\))?`)

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
