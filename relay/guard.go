package relay

// guard.go: the relay's guard over what the slot streams from. It owns
// walrelay's record of it (as prepare found and wrote it), the publication
// watch that vouches for every position confirmed (it feeds the process's
// confirm.Clearance), the refusals that stop the relay when something it
// streamed from was replaced or removed (written into the record, so that
// a restart refuses too), where the next stream starts and the timeline of
// the last one (a failover), the failover line, and whether a fenced relay
// still holds the slot.

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/confirm"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// guard is the relay's guard over what the slot streams from.
type guard struct {
	cfg      Config
	log      *zap.Logger
	metrics  *metrics.Metrics
	live     *live
	progress *confirm.Progress
	// clearance is how far the publication watch vouched for the
	// publication: guard writes it, sessions' confirmers read it.
	clearance *confirm.Clearance
	// watchHold is the publication_watch condition (package holds): held
	// while the watch cannot vouch, since nothing is confirmed past what
	// it vouched for.
	watchHold *holds.Condition

	// record is what the slot streams from, as prepare found and wrote it
	// down (source.Record); the publication watch checks it still holds.
	record source.Record
	// watch checks the publication still publishes what record says;
	// watchMu serialises its checks (the watch's goroutine, a stopping
	// session's last check).
	watch   *source.Watch
	watchMu sync.Mutex
	// refused is set once the relay stopped on a change under it
	// (refuse): nothing more is confirmed or refused again.
	refused atomic.Bool
	// slotSeen is set once a stream has started: from then on a missing
	// slot was dropped under us, and recreating it would skip data.
	slotSeen bool
	// firstStream is closed when the process's first stream starts
	// (recordStreamed waits for it).
	firstStream     chan struct{}
	firstStreamOnce sync.Once
	// timeline is the timeline of the last stream: a new one means a
	// failover, after which positions this process kept belong to the old
	// primary's history.
	timeline int32
	// failoverSaid is the failover line last logged, without its
	// figures (recordFailover).
	failoverMu   sync.Mutex
	failoverSaid string
	// resendWarned: the warning that the slot is behind walrelay's record
	// was logged (once a process).
	resendWarned bool
	// slotHolder tells a fenced relay whether it still holds the slot:
	// holdsSlot, or a fake in unit tests.
	slotHolder slotHolder
	// coverage says how the publication covers a table the relay does not
	// map (session.go, unmapped): readCoverage, or a fake in unit tests.
	coverage func(ctx context.Context, oid uint32) (source.Coverage, error)
}

// stuckCheckWarn is how long the publication watch may find a change to
// the publication in progress before it says that confirming waits on it.
const stuckCheckWarn = 10 * time.Second

// watchPublication checks the publication (source.Watch) whenever the
// session has positions to confirm beyond the last one vouched for, at
// most once per ConfirmDelay, and stops the relay with a *slot.GapError
// when it no longer publishes an outbox table the slot streamed from. A
// failed check (the connection) vouches for nothing and is tried again;
// one that finds the server shutting down ends the session.
func (g *guard) watchPublication(ctx context.Context, stop context.CancelCauseFunc) {
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
		case <-g.clearance.Wake():
		}
		for ctx.Err() == nil && g.clearance.Behind() {
			began := time.Now()
			if conn == nil || conn.IsClosed() {
				c, err := slot.Connect(ctx, g.cfg.PGURL)
				if err != nil {
					if ctx.Err() == nil {
						g.watchFailed(ctx, err, "cannot connect")
					}
					sleepCtx(ctx, time.Second)
					continue
				}
				conn = c
			}
			stopHang := g.watchHold.HoldAfter(stuckCheckWarn, "NotAnswering", fmt.Sprintf(
				"a check of publication %q has not been answered for %s: PostgreSQL is stopped, frozen or cut off; nothing is confirmed until a check answers", g.cfg.Publication, stuckCheckWarn))
			ok, err := g.vouch(ctx, conn)
			stopHang()
			var gap *slot.GapError
			switch {
			case errors.As(err, &gap):
				g.refuse(ctx, conn, gap)
				stop(gap)
				return
			case err != nil:
				if ctx.Err() == nil {
					g.watchFailed(ctx, err, "the check failed")
				}
				conn.Close(context.Background())
				conn = nil
			case ok:
				stuckSince = time.Time{}
				g.watchHold.Clear()
			case stuckSince.IsZero():
				stuckSince = began
			case time.Since(stuckSince) > stuckCheckWarn:
				g.watchHold.Hold("ChangeInProgress", fmt.Sprintf(
					"a transaction changing publication %q or an outbox table has been open for %s: walrelay confirms nothing past its start until it ends (PostgreSQL would decode past it either way); end it, or find it in pg_stat_activity",
					g.cfg.Publication, time.Since(stuckSince).Round(time.Second)))
			}
			sleepCtx(ctx, time.Until(began.Add(g.cfg.ConfirmDelay)))
		}
	}
}

// vouch runs one check of the publication on conn and moves verified
// forward when it vouches; ok is false when a change was in progress.
func (g *guard) vouch(ctx context.Context, conn *pgx.Conn) (ok bool, err error) {
	g.watchMu.Lock()
	defer g.watchMu.Unlock()
	if g.watch == nil {
		g.watch = source.NewWatch(g.cfg.setupConfig(), g.record, g.log)
	}
	at, ok, err := g.watch.Check(ctx, conn)
	var gap *slot.GapError
	if errors.As(err, &gap) {
		gap.Since = g.progress.Confirmed()
		return false, gap
	}
	if ok {
		g.clearance.Vouch(at)
	}
	return ok, err
}

// vouchFinal checks the publication once more as a session stops, so that
// a clean stop confirms everything Kafka acknowledged (the watch stops
// with the relay's context). A change found then is refused as always.
func (g *guard) vouchFinal(ctx context.Context, pos decoder.LSN) {
	if pos <= g.clearance.Upto() || g.refused.Load() {
		return
	}
	conn, err := slot.Connect(ctx, g.cfg.PGURL)
	if err != nil {
		g.log.Warn("cannot check the publication before stopping: the last acknowledged events are confirmed at the next start", zap.Error(err))
		return
	}
	defer conn.Close(context.Background())
	var gap *slot.GapError
	if _, err := g.vouch(ctx, conn); errors.As(err, &gap) {
		g.refuse(ctx, conn, gap)
		g.log.Error("stopping: "+gap.Error(), zap.String("slot", g.cfg.Slot))
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
func (g *guard) watchFailed(ctx context.Context, err error, what string) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "57") && g.shuttingDown(ctx, pgErr) {
		g.log.Info("publication watch: the server is shutting down; ending the stream so that its walsender can exit", zap.Error(err))
		g.live.endSession(fmt.Errorf("the server is shutting down: %w", err))
		return
	}
	if pgErr != nil && strings.HasPrefix(pgErr.Code, "57") {
		what = "its connection was ended by the server (pg_terminate_backend, or a timeout); reconnecting"
	}
	g.watchHold.Hold("CheckFailed", "publication watch: "+what+"; nothing is confirmed until it can check the publication: "+err.Error())
}

// shuttingDown reports whether the server refuses new connections because
// it is shutting down, err being the operator-intervention error (class
// 57) a connection met.
func (g *guard) shuttingDown(ctx context.Context, err *pgconn.PgError) bool {
	if err.Code == "57P03" { // cannot_connect_now: refused at connection
		return true
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, cerr := slot.Connect(ctx, g.cfg.PGURL)
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

func (g *guard) refuse(ctx context.Context, conn *pgx.Conn, gap *slot.GapError) {
	if g.refused.Swap(true) {
		return // the same refusal, found again on the way out
	}
	g.metrics.GapRefusals.Inc()
	// The refusal stops the relay, which may cancel ctx while this runs:
	// the record is written anyway, within refusalWriteTimeout, or the
	// next start would name a vaguer cause.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refusalWriteTimeout)
	defer cancel()
	if w := g.live.writeURL(g.cfg); conn == nil || conn.IsClosed() || w != g.cfg.PGURL {
		// A standby's conn cannot write: the record is on its primary.
		c, err := slot.Connect(ctx, w)
		if err != nil {
			g.log.Error("cannot write the refusal into walrelay's record; a restart may not refuse", zap.Error(err))
			return
		}
		defer c.Close(context.Background())
		conn = c
	}
	if err := source.RecordStop(ctx, conn, g.cfg.RecordSchema, g.cfg.Slot, gap.What, gap.Since); err != nil {
		g.log.Error("cannot write the refusal into walrelay's record; a restart may not refuse", zap.Error(err))
	}
}

// sessionGap turns what a stream reported of a vanished publication into
// the relay's refusal, and writes it down.
func (g *guard) sessionGap(ctx context.Context, err error) error {
	var gone *slot.PublicationGoneError
	if !errors.As(err, &gone) {
		return err
	}
	gap := &slot.GapError{What: "publication " + quoted(gone.Publication) + " was dropped while walrelay streamed from it (the server: " + gone.Message + ")", Since: g.progress.Confirmed()}
	g.refuse(ctx, nil, gap)
	return gap
}

func quoted(s string) string { return `"` + s + `"` }

// prepared takes the record prepare found and wrote, and says what a
// failover of the primary would do to the slot.
func (g *guard) prepared(ctx context.Context, rec source.Record) {
	g.record = rec
	g.logFailover(ctx)
}

// logFailover says at startup what a failover of the primary would do to
// the slot, and sets the failover metrics.
func (g *guard) logFailover(ctx context.Context) {
	conn, err := slot.Connect(ctx, g.cfg.PGURL)
	if err != nil {
		return
	}
	defer conn.Close(context.Background())
	info, err := slot.ReadInfo(ctx, conn, g.cfg.Slot)
	if err != nil {
		return
	}
	f, err := doctor.ReadFailover(ctx, conn, info, g.cfg.StandbyURLs)
	if err != nil {
		g.log.Warn("cannot read the failover settings", zap.Error(err))
		return
	}
	f.DecodedHere = f.DecodedHere || f.Local != nil && g.cfg.PrimaryURL != ""
	g.recordFailover(f)
}

// recordFailover sets the failover metrics and logs what a failover would
// do whenever that changes (the startup line, and then a standby whose
// copy went stale, a switchover that left the old primary's slot behind):
// a line per change, not per poll.
func (g *guard) recordFailover(f doctor.Failover) {
	g.metrics.SlotFailover.Set(b2f(f.Slot))
	g.metrics.SlotFailoverProtected.Set(b2f(f.Protected()))
	text, warn := f.Describe()
	key := figures.ReplaceAllString(text, "#")
	g.failoverMu.Lock()
	said := g.failoverSaid == key
	g.failoverSaid = key
	g.failoverMu.Unlock()
	if said {
		return
	}
	if warn {
		g.log.Warn("failover: "+text, zap.String("slot", g.cfg.Slot))
	} else {
		g.log.Info("failover: "+text, zap.String("slot", g.cfg.Slot))
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

// What a fenced relay does (router.ErrFenced) is decided here too.
// fence: decides what an exactly-once relay does once Kafka says another
// producer took its transactional id (router.ErrFenced). Nothing it sent
// since its last commit can become visible either way; what differs is who
// took the id:
//
//   - a relay that took the slot after this one lost it without noticing
//     (a frozen process, a cut replication connection): this one restarts,
//     finds the slot busy and waits as a standby. Exiting would make a
//     supervisor's restart do the same, one restart delay later.
//   - anything else while this relay still holds the slot: a relay of
//     another slot, or a tool, configured with the same transactional id.
//     Restarting would take the id back and fence the other, forever: this
//     one stops instead (exit code 3).
//
// A relay takes the id only once it holds the slot (initTransactions), so
// a relay fenced by a rival on its own slot has necessarily lost the slot:
// whether its walsender still holds the slot tells the two cases apart.

// slotHolder reports whether the walsender with the given backend PID is
// the one streaming the relay's slot. Unit tests replace it.
type slotHolder func(ctx context.Context, walsender uint32) (bool, error)

// holdsSlot is the slotHolder that asks pg_replication_slots.
func (g *guard) holdsSlot(ctx context.Context, walsender uint32) (bool, error) {
	if walsender == 0 {
		return false, errors.New("the replication connection's backend PID is unknown")
	}
	conn, err := slot.Connect(ctx, g.cfg.PGURL)
	if err != nil {
		return false, err
	}
	defer conn.Close(context.Background())
	info, err := slot.ReadInfo(ctx, conn, g.cfg.Slot)
	if err != nil {
		return false, err
	}
	return info.ActivePID != nil && uint32(*info.ActivePID) == walsender, nil
}

// afterFence returns what a session that ended with err does next, err
// being fenced: a fatal error when this relay (replication backend
// walsender) still holds the slot, else err itself, to restart from (as a
// standby while the other relay streams). Call it before the replication
// connection closes. Any other err is returned as is.
func (g *guard) afterFence(err error, walsender uint32) error {
	if !errors.Is(err, router.ErrFenced) || isFatal(err) {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	txnID := g.cfg.Router.TransactionalID
	ids := strconv.Quote(txnID)
	// Two producers make ids that differ collide: this relay's second id,
	// or this one's id as another relay's second. Only the error can say.
	var pair string
	if g.cfg.Router.TxnProducers > 1 {
		ids += " or " + strconv.Quote(txnID+"-1") // err names the one taken
		pair = fmt.Sprintf(" (its second producer uses %q: no other relay's id may be that)", txnID+"-1")
	} else if first, ok := strings.CutSuffix(txnID, "-1"); ok && first != "" {
		pair = fmt.Sprintf(" (%q is also the second producer's id of a relay with transactional id %q and router.Config.TxnProducers 2)", txnID, first)
	}
	holds, qerr := g.slotHolder(ctx, walsender)
	switch {
	case qerr != nil:
		// Restarting is safe whatever the answer: the next session takes
		// the slot before the id, so it waits while another relay streams.
		g.log.Warn("fenced: another producer took the transactional id, and whether this relay still holds the slot is unknown; restarting (it waits as a standby while another relay streams)",
			zap.String("slot", g.cfg.Slot), zap.String("transactional_id", txnID), zap.NamedError("slot_check", qerr), zap.Error(err))
		return err
	case holds:
		return &fatalError{fmt.Errorf("transactional id %s was taken by another producer while this relay holds slot %q: a relay of another slot, or another tool, uses the same transactional id (relay.Config.Router.TransactionalID)%s; give each relay its own (restarting would take it back, and the two would fence each other forever): %w",
			ids, g.cfg.Slot, pair, err)}
	default:
		g.log.Warn("fenced: another relay took the slot and then the transactional id while this one had lost the slot without noticing; nothing this one sent since its last Kafka commit becomes visible; restarting, it waits as a standby",
			zap.String("slot", g.cfg.Slot), zap.String("transactional_id", txnID), zap.Error(err))
		return err
	}
}

// streamed records that a stream started, at start on timeline tl: from
// now on a missing slot was dropped under the relay, and a new timeline is
// a failover.
func (g *guard) streamed(tl int32, start decoder.LSN) {
	g.slotSeen = true
	g.firstStreamOnce.Do(func() {
		if g.firstStream != nil {
			close(g.firstStream)
		}
	})
	if g.timeline != 0 && tl != g.timeline {
		// Positions this process acked belong to the old primary's
		// history, which may have gone on past where the new primary's
		// forked. Only the slot's position is of this history.
		g.log.Warn("the server is on a new timeline (a failover): resuming from the slot's confirmed position, not from what this process acked on the old primary",
			zap.Int32("old_timeline", g.timeline), zap.Int32("timeline", tl), zap.Stringer("start_lsn", start))
	}
	g.timeline = tl
}

// startPosition is where the next stream starts: the later of what this
// process confirmed and the slot's confirmed_flush_lsn.
func (g *guard) startPosition(ctx context.Context) (decoder.LSN, error) {
	conn, err := slot.Connect(ctx, g.cfg.PGURL)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	info, err := slot.ReadInfo(ctx, conn, g.cfg.Slot)
	switch {
	case errors.Is(err, slot.ErrNoSlot) && g.slotSeen:
		gap := doctor.SlotDroppedError(g.cfg.Slot, g.cfg.PrimaryURL != "", g.progress.Confirmed())
		g.refuse(ctx, conn, gap)
		return 0, gap
	case errors.Is(err, slot.ErrNoSlot):
		return 0, &fatalError{fmt.Errorf("replication slot %q does not exist", g.cfg.Slot)}
	case err != nil:
		return 0, err
	case info.Invalidated():
		gap := doctor.ReadInvalidatedError(ctx, conn, info, g.progress.Confirmed())
		g.refuse(ctx, conn, gap)
		return 0, gap
	}
	recordSlot(g.metrics, info)
	failover := false
	if tl, err := currentTimeline(ctx, conn); err == nil && g.timeline != 0 && tl != g.timeline {
		g.warnResend(info, g.progress.Acked(), "what this process had acknowledged on the old timeline", true, zap.Int32("old_timeline", g.timeline), zap.Int32("timeline", tl))
		failover = true
	} else if g.timeline == 0 && !g.resendWarned {
		// A new process knows nothing it acknowledged; the record, copied
		// to the standbys with the rest of the database, holds what the
		// relay last confirmed, on whichever server was primary then.
		g.resendWarned = g.warnResend(info, g.record.ConfirmedLSN, "what walrelay recorded as confirmed (its record, "+g.cfg.RecordSchema+".slots, which physical replication copies from the old primary)", false)
	}
	return g.progress.Resume(info.ConfirmedLSN, g.clearance, failover), nil
}

// warnResend warns when the slot's confirmed position is behind a position
// walrelay knows Kafka acknowledged (what says which): the stream
// resumes from the slot, and the events between are published again. After
// a failover that is the distance slot synchronization lagged; a slot that
// is not a synchronized copy at all (synced = false on a server that was a
// standby: an old primary that rejoined with its own slot) is named.
func (g *guard) warnResend(info slot.Info, known decoder.LSN, what string, promoted bool, fields ...zap.Field) bool {
	if known <= info.ConfirmedLSN || info.ConfirmedLSN == 0 {
		return false
	}
	msg := fmt.Sprintf("the slot's confirmed position %s is %s behind %s, %s: the stream resumes from the slot, so the events of that WAL are sent again",
		info.ConfirmedLSN, doctor.BytesText(int64(known-info.ConfirmedLSN)), what, known)
	if g.cfg.ExactlyOnce {
		msg += " (exactly-once skips those its checkpoint in Kafka covers)"
	} else {
		msg += " (duplicates in Kafka, each with the same id header as its first copy)"
	}
	if info.Synced != nil && !*info.Synced && info.Failover != nil && *info.Failover {
		own := "; if this server was a standby until now, its slot (synced = false) was"
		if promoted {
			own = "; this server was a standby until its promotion, and its slot (synced = false) was"
		}
		msg += own + " not the copy slot synchronization keeps but a slot of its own, left from when it was a primary itself: remove the old primary's slot before it rejoins as a standby (docs/operating.md, a switchover step by step); or a copy a tool keeps (Patroni's slots:), whose lag those bytes are"
	}
	g.log.Warn(msg, append([]zap.Field{zap.String("slot", g.cfg.Slot), zap.Stringer("slot_confirmed_lsn", info.ConfirmedLSN),
		zap.Stringer("acknowledged_lsn", known), zap.Int64("resent_wal_bytes", int64(known-info.ConfirmedLSN))}, fields...)...)
	return true
}

// currentTimeline is the server's timeline (pg_control_checkpoint lags a
// promotion until its first checkpoint; the WAL file name of the insert
// position does not).
func currentTimeline(ctx context.Context, conn *pgx.Conn) (int32, error) {
	var tl int32
	err := conn.QueryRow(ctx, `SELECT ('x' || substr(pg_walfile_name(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END), 1, 8))::bit(32)::int`).Scan(&tl)
	return tl, err
}

// coverage is how the publication covers the table of pg_class OID oid,
// read on a connection of its own (the replication connection streams).
func (g *guard) readCoverage(ctx context.Context, oid uint32) (source.Coverage, error) {
	conn, err := slot.Connect(ctx, g.cfg.PGURL)
	if err != nil {
		return source.NotCovered, err
	}
	defer conn.Close(context.Background())
	return source.ReadCoverage(ctx, conn, g.cfg.Publication, oid)
}
