package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/confirm"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// errServerSilent means the replication connection carried nothing, not
// even a reply to a request for one, for the receive timeout.
var errServerSilent = errors.New("replication connection silent")

// tick is how often the session wakes while transactions are in flight, to
// confirm them promptly once acknowledged.
const tick = 50 * time.Millisecond

// idleWait is how long Receive waits for more of the stream before the
// delivery is told it ran dry (wakeDry): long enough for one
// read of what the kernel already holds (after the read coalescing pause),
// so that a backlog being drained is not taken for an idle stream at every
// emptied read buffer; short against a Kafka commit. A stream that can
// tell it has nothing left to read (slot.Stream.Drained) is asked first,
// and this wait is left for a message only partly arrived.
const idleWait = 500 * time.Microsecond

// stream is what a session uses of *slot.Stream.
type stream interface {
	// Receive returns the next message, slot.ErrTimeout at deadline, or
	// slot.ErrInterrupted after Interrupt.
	Receive(deadline time.Time) (slot.Message, error)
	// SendStatus confirms a position to the server; replyRequested asks
	// it to answer at once.
	SendStatus(confirmed decoder.LSN, replyRequested bool) error
	// Interrupt makes a Receive in progress (or the next one) return; it
	// is safe for concurrent use.
	Interrupt()
	Close(ctx context.Context) error
}

// drainer is a stream that can tell without waiting that nothing of it is
// left to read (slot.Stream.Drained).
type drainer interface{ Drained() bool }

// streamDrained reports whether st says nothing of it is left to read;
// false when it cannot tell.
func streamDrained(st stream) bool {
	d, ok := st.(drainer)
	return ok && d.Drained()
}

// session is one replication stream. All its fields belong to the goroutine
// running it, except what the producer's promises touch through the
// confirm.Txn and the failed channel.
type session struct {
	r      *Relay
	ctx    context.Context
	stream stream
	dec    *decoder.Decoder
	d      delivery
	// confirm decides what this stream confirms (package confirm).
	confirm *confirm.Confirmer
	pgTxn   *confirm.Txn
	failed  chan error
	start   decoder.LSN                    // where the stream started
	system  pglogrepl.IdentifySystemResult // what the stream's IDENTIFY_SYSTEM reported
	// walsender is the backend PID of the replication connection (0 when
	// unknown): a fenced relay compares it with the slot's active_pid.
	walsender uint32
	timer     *time.Timer
	lastLSN   decoder.LSN // WAL position of the current message, for errors

	// coverage is how the publication covers each table it streamed
	// unmapped inserts of, by pg_class OID (see unmapped).
	coverage map[uint32]source.Coverage

	nextTick time.Time
	lastRecv time.Time // when the server was last known to have sent anything
	pinged   bool      // a reply was requested since lastRecv
	heard    bool      // a message arrived since lastRecv was set
	lost     bool      // a status update failed: the connection is gone
	ended    bool      // the loop returned: finish is draining

	// Per-message figures, published by housekeep rather than per message.
	msgs      uint64
	recvBytes int
	serverEnd decoder.LSN

	// stopAt is when a stop must be over: ShutdownTimeout after the
	// session first saw ctx end. Set once (stopOnce), possibly from a
	// context.AfterFunc goroutine.
	stopOnce sync.Once
	stopAt   time.Time
}

// stopDeadline bounds everything a stop waits for (the final Kafka commit
// with exactly-once delivery, then the outstanding acks) by one
// ShutdownTimeout, counted from the first call after the stop.
func (s *session) stopDeadline() time.Time {
	s.stopOnce.Do(func() { s.stopAt = time.Now().Add(s.r.cfg.ShutdownTimeout) })
	return s.stopAt
}

// kafkaCtx bounds a transactional Kafka call (commit, abort): by the
// transaction timeout, and once the relay stops, by the stop deadline, so
// a broker that stopped answering cannot hold a stop for --txn-timeout.
// A commit cut short this way is safe: its checkpoint record is in the
// same Kafka transaction, so the next start resumes from whatever
// checkpoint the broker did commit.
func (s *session) kafkaCtx() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), s.r.cfg.Router.TransactionTimeout)
	var mu sync.Mutex
	var timer *time.Timer
	stopWatch := context.AfterFunc(s.ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		timer = time.AfterFunc(time.Until(s.stopDeadline()), cancel)
	})
	return ctx, func() {
		stopWatch()
		mu.Lock()
		if timer != nil {
			timer.Stop()
		}
		mu.Unlock()
		cancel()
	}
}

// newSession is a session on stream, starting at start, sending status
// updates at least every statusEvery (Relay.statusEvery); its delivery (d)
// is set before run.
func (r *Relay) newSession(ctx context.Context, st stream, dec *decoder.Decoder, start decoder.LSN, statusEvery time.Duration) *session {
	s := &session{
		r:      r,
		ctx:    ctx,
		start:  start,
		stream: st,
		dec:    dec,
		failed: make(chan error, 1),
		timer:  time.NewTimer(time.Hour),
		// The stream just started: count the silence from now.
		lastRecv: time.Now(),
	}
	s.confirm = confirm.New(confirm.Config{
		Start: start, Every: statusEvery, MinGap: r.cfg.ConfirmDelay,
		Clearance: r.guard.clearance, Progress: r.progress,
		OnComplete: func(commit time.Time) { r.metrics.CommitToAck.Observe(time.Since(commit).Seconds()) },
	})
	return s
}

// run streams until something ends the session, then finishes it.
func (s *session) run() error {
	r := s.r
	r.sup.streamed.Store(true)
	r.live.begin(s)
	r.sup.pg.Clear()
	stopInterrupt := context.AfterFunc(s.ctx, s.stream.Interrupt)
	defer stopInterrupt()
	r.log.Info("streaming", zap.String("slot", r.cfg.Slot), zap.Stringer("start_lsn", s.start),
		zap.String("system_id", s.system.SystemID), zap.Int32("timeline", s.system.Timeline),
		zap.Stringer("server_wal_end", s.system.XLogPos))
	defer func() {
		r.live.end(s)
		s.timer.Stop()
	}()
	err := s.loop()
	s.ended = true
	r.live.streamEnded()
	return s.finish(err)
}

// loop reads the stream until something ends it.
func (s *session) loop() error {
	s.housekeep(true) // confirm a position this process got to and the slot did not
	for {
		select {
		case err := <-s.failed:
			return err
		default:
		}
		if err := s.ctx.Err(); err != nil {
			return err
		}
		// The delivery waits for the stream to run dry, and it has: say
		// so now rather than after a wait (idleWait, which Go's timers
		// stretch to a millisecond or more), once per Kafka transaction.
		if s.d.Wants() == wakeDry && streamDrained(s.stream) {
			if err := s.d.Tick(time.Now(), true); err != nil {
				return err
			}
			continue
		}
		m, err := s.stream.Receive(s.deadline())
		switch {
		case errors.Is(err, slot.ErrTimeout):
			if err := s.checkAlive(); err != nil {
				return err
			}
			s.housekeep(false)
			// Nothing complete to read right now: the stream ran dry.
			if err := s.d.Tick(time.Now(), true); err != nil {
				return err
			}
			continue
		case errors.Is(err, slot.ErrInterrupted):
			continue // the checks at the top say why
		case err != nil:
			return err
		}
		s.heard, s.serverEnd = true, m.ServerWALEnd
		switch m.Kind {
		case slot.Keepalive:
			if !s.r.cfg.NoIdleAdvance {
				s.confirm.Marker(m.ServerWALEnd)
			}
			s.housekeep(m.ReplyRequested)
		case slot.XLogData:
			s.lastLSN = m.WALStart
			s.recvBytes += len(m.Data)
			if err := s.handle(m.Data); err != nil {
				return err
			}
			// Reading the clock per message is a tenth of the relay's
			// CPU at full speed: look every 64 messages. An idle stream
			// reaches housekeeping through Receive's deadline instead.
			if s.msgs++; s.msgs&63 == 0 {
				if now := time.Now(); !now.Before(s.nextTick) {
					s.housekeep(false)
					if err := s.d.Tick(now, false); err != nil {
						return err
					}
				}
			}
		}
	}
}

// deadline is when Receive should give the loop a chance to send a status
// update: soon while transactions are in flight or a new position waits to
// be confirmed, else at the next periodic update; after idleWait when the
// delivery waits for the stream to run dry.
func (s *session) deadline() time.Time {
	wants := s.d.Wants()
	if wants == wakeDry {
		return time.Now().Add(idleWait)
	}
	d := s.confirm.Next()
	if s.confirm.InFlight() > 0 || s.confirm.Pending() || wants == wakeSoon {
		d = s.nextTick
	}
	return minTime(d, s.aliveCheck())
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// aliveCheck is when the server's silence next needs attention: a ping at
// half the receive timeout, the verdict at the full timeout.
func (s *session) aliveCheck() time.Time {
	if !s.pinged {
		return s.lastRecv.Add(s.r.cfg.ReceiveTimeout / 2)
	}
	return s.lastRecv.Add(s.r.cfg.ReceiveTimeout)
}

// checkAlive notices a connection that went silent without closing (a
// partition, a moved address, a firewall that forgot it): like
// PostgreSQL's own walreceiver it asks the server for a reply after half
// the receive timeout and gives up on the connection after all of it.
func (s *session) checkAlive() error {
	if s.heard {
		// Messages came since the last look: count the silence from now,
		// which errs late, never early.
		s.lastRecv, s.pinged, s.heard = time.Now(), false, false
	}
	silent := time.Since(s.lastRecv)
	switch {
	case silent >= s.r.cfg.ReceiveTimeout:
		return fmt.Errorf("%w: nothing received for %s", errServerSilent, silent.Round(time.Millisecond))
	case silent >= s.r.cfg.ReceiveTimeout/2 && !s.pinged:
		s.pinged = true
		if err := s.stream.SendStatus(s.confirm.Confirmed(), true); err != nil {
			return err
		}
	}
	return nil
}

// connectionLost ends the session on a status update that could not be
// sent. While the relay waits for Kafka nothing reads the stream, so a
// connection the server ended (its wal_sender_timeout, a terminated
// walsender) shows here first, not at a Receive that may be long in
// coming: the session ends now, and the next one starts from the
// confirmed position once Kafka has answered what is in flight.
func (s *session) connectionLost(err error) {
	if s.lost || s.ended {
		// Said already, or the loop is over and its end says why.
		s.r.log.Debug("standby status update failed", zap.Error(err))
		return
	}
	s.lost = true
	var timedOut *slot.SenderTimeoutError
	if errors.As(err, &timedOut) {
		s.r.log.Warn("the replication connection timed out: the server acknowledged no status update for its wal_sender_timeout and ends the walsender; ending the stream: the next starts from the confirmed position once Kafka has answered what is in flight",
			zap.Duration("wal_sender_timeout", timedOut.Timeout), zap.Stringer("confirmed_lsn", s.confirm.Confirmed()), zap.Error(err))
	} else {
		s.r.log.Warn("the replication connection broke: ending the stream; the next starts from the confirmed position once Kafka has answered what is in flight",
			zap.Stringer("confirmed_lsn", s.confirm.Confirmed()), zap.Error(err))
	}
	select {
	case s.failed <- fmt.Errorf("replication connection: %w", err):
	default: // another error ends the session already
	}
	s.stream.Interrupt()
}

// handle processes one pgoutput message.
func (s *session) handle(data []byte) error {
	kind, err := s.dec.Decode(data)
	if err != nil {
		return fmt.Errorf("decode pgoutput message at %s: %w", s.lastLSN, err)
	}
	switch kind {
	case decoder.KindBegin:
		b := s.dec.Begin()
		s.pgTxn = s.confirm.Begin(b.CommitTime)
		s.r.metrics.Transactions.Inc()
		s.d.Begin(b, s.pgTxn)
	case decoder.KindInsert:
		if s.pgTxn == nil {
			return fmt.Errorf("decode pgoutput message at %s: %w: insert outside a transaction", s.lastLSN, decoder.ErrMalformed)
		}
		return s.d.Event(s.dec.Event(), s.lastLSN)
	case decoder.KindCommit:
		if s.pgTxn == nil {
			return fmt.Errorf("decode pgoutput message at %s: %w: commit without begin", s.lastLSN, decoder.ErrMalformed)
		}
		c := s.dec.Commit()
		s.confirm.Commit(s.pgTxn, c.EndLSN)
		s.pgTxn = nil
		return s.d.Commit(c.EndLSN)
	case decoder.KindMessage:
		// A heartbeat (or any non-transactional message): everything
		// before it was received, so it is a marker like a keepalive.
		s.confirm.Marker(s.dec.MessageLSN())
	case decoder.KindUnmapped:
		return s.unmapped(s.dec.Unmapped())
	}
	return nil
}

// unmapped deals with an insert the publication sent for a table no outbox
// maps. The publication decides what the slot streams: a table it lists by
// name (a migration's ALTER PUBLICATION ... ADD TABLE) was put there to be
// published, so the relay stops before the slot is confirmed past the
// insert, naming both ways on; nothing is lost, the slot still holds it. A
// table only FOR ALL TABLES or TABLES IN SCHEMA covers, or one the
// publication no longer covers, holds no events: counted, logged once.
func (s *session) unmapped(t decoder.Table, oid uint32) error {
	r := s.r
	if t.Schema == r.cfg.RecordSchema && t.Name == source.RecordTableName {
		return nil // walrelay's own record, in a FOR ALL TABLES publication
	}
	cov, ok := s.coverage[oid]
	if !ok {
		var err error
		if cov, err = r.guard.coverage(s.ctx, oid); err != nil {
			return fmt.Errorf("look up how publication %q covers table %s: %w", r.cfg.Publication, t, err)
		}
		if s.coverage == nil {
			s.coverage = make(map[uint32]source.Coverage)
		}
		s.coverage[oid] = cov
	}
	if cov == source.Listed && r.guard.record.AcceptsOther(oid) {
		cov = source.Shared // listed when walrelay recorded the publication
	}
	r.tables.count(t, oid, cov)
	if cov != source.Listed {
		return nil
	}
	ident := pgx.Identifier{r.cfg.Publication}.Sanitize()
	table := pgx.Identifier{t.Schema, t.Name}.Sanitize()
	return &fatalError{fmt.Errorf("publication %q lists table %s, which is not an outbox table of this relay, and streamed an insert of it at %s: walrelay stopped before confirming past it, so the slot still holds it. If it is an outbox, add it to relay.Config.Tables and restart: its rows are published from the slot; if not, remove it from the publication (ALTER PUBLICATION %s DROP TABLE %s) and restart: its inserts are then skipped and counted",
		r.cfg.Publication, t, s.lastLSN, ident, table)}
}

// tableCounts counts the inserts the publication sent for tables no outbox
// maps, per table, and says so once per table for the life of the
// process, so that such rows never look like a quiet outbox. Only the
// session goroutine (one at a time) touches it.
type tableCounts struct {
	cfg     Config
	log     *zap.Logger
	metrics *metrics.Metrics
	seen    map[decoder.Table]prometheus.Counter
}

// count counts an insert of t (pg_class OID oid), which the publication
// covers as cov.
func (c *tableCounts) count(t decoder.Table, oid uint32, cov source.Coverage) {
	n, ok := c.seen[t]
	if !ok {
		if c.seen == nil {
			c.seen = make(map[decoder.Table]prometheus.Counter)
		}
		n = c.metrics.UnmappedInserts.WithLabelValues(t.String())
		c.seen[t] = n
		fields := []zap.Field{zap.String("table", t.String()), zap.Uint32("relation_oid", oid), zap.String("publication", c.cfg.Publication)}
		switch cov {
		case source.Broad:
			c.log.Warn("the publication covers every table (FOR ALL TABLES or TABLES IN SCHEMA) and streams inserts of one that is not an outbox table: they are not published (counted in walrelay_unmapped_inserts_total); if it is an outbox, add it to relay.Config.Tables", fields...)
		case source.Shared:
			c.log.Warn("the publication lists a table that is not an outbox table of this relay, as it did when walrelay first streamed from it (another subscriber's, in a shared publication): its inserts are not published (counted in walrelay_unmapped_inserts_total); if it is an outbox, add it to relay.Config.Tables", fields...)
		case source.NotCovered:
			c.log.Warn("the slot streams inserts of a table the publication no longer covers (it was removed from the publication, or dropped, after they were written): they are not published (counted in walrelay_unmapped_inserts_total)", fields...)
		}
	}
	n.Inc()
}

// wait blocks until done is closed, while still sending status updates:
// the walsender disconnects a client that stays silent for
// wal_sender_timeout, and Kafka may be slow for longer than that. When
// interruptible, it also returns when Kafka refused a record or ctx ended.
// It is the session's one waitFunc.
func (s *session) wait(done <-chan struct{}, interruptible bool) error {
	var failed <-chan error
	var ctxDone <-chan struct{}
	if interruptible {
		failed, ctxDone = s.failed, s.ctx.Done()
		// Waiting for room, the socket is not read: the server's
		// silence is ours. (A Kafka commit is bounded by its own
		// timeout; a drain ends the session.)
		defer func() { s.lastRecv, s.pinged, s.heard = time.Now(), false, false }()
	}
	for {
		s.timer.Reset(time.Until(s.nextTick))
		select {
		case <-done:
			return nil
		case <-s.timer.C:
			s.housekeep(false)
		case err := <-failed:
			return err
		case <-ctxDone:
			return s.ctx.Err()
		}
	}
}

// housekeep publishes the stream's figures and sends a status update
// when the confirmer says one is due, with the position it allows.
func (s *session) housekeep(force bool) {
	now := time.Now()
	if !now.Before(s.nextTick) {
		s.nextTick = now.Add(tick)
	}
	lsn, due := s.confirm.Due(now, force)
	m := s.r.metrics
	if s.lastLSN != 0 {
		s.r.live.receivedAt(s.lastLSN)
		m.ReceivedLSN.Set(float64(s.lastLSN))
	}
	if s.serverEnd != 0 {
		m.ServerWALEndLSN.Set(float64(s.serverEnd))
	}
	if s.recvBytes > 0 {
		m.ReceivedBytes.Add(float64(s.recvBytes))
		s.recvBytes = 0
	}
	// Replication lag: now minus the commit time of the newest confirmable
	// transaction while anything is in flight (the oldest in flight when
	// nothing was confirmable yet), 0 when caught up.
	var lag time.Duration
	if oldest := s.confirm.OldestCommit(); !oldest.IsZero() {
		ref := s.confirm.Position().CommitTime
		if ref.IsZero() {
			ref = oldest
		}
		lag = max(now.Sub(ref), 0)
	}
	s.r.live.lagged(lag)
	m.ReplicationLag.Set(lag.Seconds())
	if rt := s.r.live.router.Load(); rt != nil {
		s.r.kafka.look(rt, now) // not a nil *Router in the interface
	}
	if !due {
		return
	}
	if err := s.stream.SendStatus(lsn, false); err != nil {
		s.connectionLost(err)
		return
	}
	m.StandbyStatusSent.Inc()
	m.ConfirmedLSN.Set(float64(lsn))
	if lsn > s.confirm.Confirmed() {
		s.r.log.Debug("confirmed", zap.Stringer("lsn", lsn))
	}
	s.confirm.Sent(now, lsn)
}

// finish ends a session: it waits for outstanding acks (unbounded but
// cancellable when not stopping, so the next session starts from an exact
// position), confirms what they allow when the connection still works,
// and closes the stream. A stop waits at most ShutdownTimeout in all, for
// the final Kafka commit (exactly-once) and the acks together.
func (s *session) finish(cause error) error {
	stopping := s.ctx.Err() != nil
	// Exactly-once: commit what the open Kafka transaction holds on a
	// clean stop, else abort it.
	pending, err := s.d.Close(stopping && cause != nil && errors.Is(cause, context.Canceled))
	if err != nil {
		log := s.r.log.Warn
		if kafkaDenied(err) {
			log = s.r.log.Info // the router warned of the denial
		}
		log("ending the Kafka transaction failed; the next start resumes from the last checkpoint", zap.Error(err))
		if isFatal(err) || errors.Is(err, router.ErrFenced) {
			cause = err
			stopping = false
		}
	}
	// Before the replication connection closes: it tells whether this
	// relay still held the slot.
	cause = s.r.guard.afterFence(cause, s.walsender)
	if isFatal(cause) {
		stopping = false
	}
	var flushCtx context.Context
	var cancel context.CancelFunc
	if stopping {
		flushCtx, cancel = context.WithDeadline(context.Background(), s.stopDeadline())
		s.r.log.Info("stopping: waiting for outstanding acks", zap.Int64("inflight_events", pending.Inflight()),
			zap.Duration("timeout", max(time.Until(s.stopDeadline()), 0)))
	} else {
		// Unbounded but cancellable, so the next session starts from an
		// exact position.
		flushCtx, cancel = context.WithCancel(s.ctx)
	}
	defer cancel()
	done := make(chan struct{})
	var flushErr error
	go func() {
		defer close(done)
		flushErr = pending.Flush(flushCtx)
	}()
	_ = s.wait(done, false) // keep confirming while draining
	if stopping {
		ctx, cancel := context.WithDeadline(context.Background(), s.stopDeadline())
		s.r.guard.vouchFinal(ctx, s.confirm.Acknowledged())
		cancel()
	}
	s.housekeep(true)
	if stopping {
		if flushErr != nil {
			s.r.log.Warn("stopped before every event was acknowledged; they will be sent again on restart",
				zap.Int64("inflight_events", pending.Inflight()), zap.Error(flushErr))
		}
		s.r.log.Info("stopped", zap.Stringer("confirmed_lsn", s.r.Confirmed()))
	}
	s.stream.Close(context.Background())
	if stopping {
		return nil
	}
	return cause
}
