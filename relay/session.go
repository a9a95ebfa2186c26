package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// errServerSilent means the replication connection carried nothing, not
// even a reply to a request for one, for the receive timeout.
var errServerSilent = errors.New("replication connection silent")

// errSlotBusy means another client streams from the slot: this relay waits
// as a standby and tries again after a backoff.
var errSlotBusy = errors.New("replication slot is in use by another process")

// tick is how often the session wakes while transactions are in flight, to
// confirm them promptly once acknowledged.
const tick = 50 * time.Millisecond

// session is one replication stream. All its fields belong to the goroutine
// running it, except what the router's promises touch through the
// checkpoint.Txn and the failed channel.
type session struct {
	r       *Relay
	ctx     context.Context
	stream  *slot.Stream
	dec     *decoder.Decoder
	rt      *router.Router
	tr      *checkpoint.Tracker
	txn     *checkpoint.Txn
	eos     *eosState // nil with at-least-once delivery
	failed  chan error
	timer   *time.Timer
	lastLSN decoder.LSN // WAL position of the current message, for errors

	status   *heartbeat.Schedule
	nextTick time.Time
	lastRecv time.Time // when the server was last known to have sent anything
	pinged   bool      // a reply was requested since lastRecv
	heard    bool      // a message arrived since lastRecv was set

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

// session streams until the connection breaks, Kafka refuses a record, or
// ctx ends; then it drains acks and confirms what it can.
func (r *Relay) session(ctx context.Context, rt *router.Router) (err error) {
	start, version, err := r.startPosition(ctx)
	if err != nil {
		return err
	}
	var eos *eosState
	if r.cfg.ExactlyOnce {
		if eos, err = r.startEOS(ctx, rt); err != nil {
			return err
		}
	}
	stream, err := slot.Start(ctx, r.cfg.PGURL, start, slot.StreamOptions{
		Slot: r.cfg.Slot, Publication: r.cfg.Publication, Binary: r.cfg.Binary,
		// Heartbeat messages come through the stream as markers (pgoutput
		// sends logical decoding messages from PostgreSQL 14 on).
		Messages: version >= 140000,
		Read:     r.cfg.Read,
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" {
			return fmt.Errorf("%w: %s", errSlotBusy, pgErr.Message)
		}
		return err
	}
	r.slotSeen = true
	if eos != nil {
		if err := r.verifyEOS(eos, stream.System); err != nil {
			stream.Close(context.Background())
			return err
		}
	}
	// A mapped value over the record limit could never be produced: the
	// decoder leaves it out instead of copying it (the event is then
	// dead-lettered as too large).
	dec, err := decoder.New(decoder.Config{Tables: r.cfg.Tables, Mapping: r.cfg.Mapping, Binary: r.cfg.Binary, MaxValueBytes: r.cfg.Router.MaxRecordBytes})
	if err != nil {
		stream.Close(context.Background())
		return &fatalError{err}
	}
	s := &session{
		r:      r,
		ctx:    ctx,
		stream: stream,
		dec:    dec,
		rt:     rt,
		failed: make(chan error, 1),
		timer:  time.NewTimer(time.Hour),
		status: heartbeat.NewSchedule(r.cfg.StatusInterval, r.cfg.ConfirmDelay),
		// The stream just started: count the silence from now.
		lastRecv: time.Now(),
	}
	s.tr = checkpoint.New(start, checkpoint.OnComplete(func(commit time.Time) {
		r.metrics.CommitToAck.Observe(time.Since(commit).Seconds())
	}))
	s.eos = eos
	r.current.Store(s)
	r.everStreamed.Store(true)
	stopInterrupt := context.AfterFunc(ctx, stream.Interrupt)
	defer stopInterrupt()
	r.streaming.Store(true)
	r.metrics.Streaming.Set(1)
	r.backoff.Reset()
	r.log.Info("streaming", zap.String("slot", r.cfg.Slot), zap.Stringer("start_lsn", start),
		zap.String("system_id", stream.System.SystemID), zap.Int32("timeline", stream.System.Timeline),
		zap.Stringer("server_wal_end", stream.System.XLogPos))
	defer func() {
		r.current.Store(nil)
		r.streaming.Store(false)
		r.metrics.Streaming.Set(0)
		r.updateReady()
		s.timer.Stop()
	}()

	err = s.loop()
	return s.finish(err)
}

// startPosition is where the next stream starts: the later of what this
// process confirmed and the slot's confirmed_flush_lsn. It also returns the
// server's version number.
func (r *Relay) startPosition(ctx context.Context) (decoder.LSN, int, error) {
	conn, err := slot.Connect(ctx, r.cfg.PGURL)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close(context.Background())
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return 0, 0, fmt.Errorf("read server version: %w", err)
	}
	info, err := slot.ReadInfo(ctx, conn, r.cfg.Slot)
	switch {
	case errors.Is(err, slot.ErrNoSlot) && r.slotSeen:
		return 0, 0, &fatalError{fmt.Errorf("replication slot %q was dropped while walrelay used it; walrelay never recreates a slot silently (a new slot would skip everything written meanwhile): recreate it deliberately with walrelay setup after recovering the gap", r.cfg.Slot)}
	case errors.Is(err, slot.ErrNoSlot):
		return 0, 0, &fatalError{fmt.Errorf("replication slot %q does not exist", r.cfg.Slot)}
	case err != nil:
		return 0, 0, err
	case info.WALStatus == "lost":
		return 0, 0, &fatalError{fmt.Errorf("replication slot %q is invalidated (wal_status = lost): the WAL it needed is gone and events written meanwhile cannot be read from it. walrelay never recreates a slot silently: recover the gap from the outbox source, then recreate the slot (walrelay drop, walrelay setup)", r.cfg.Slot)}
	}
	r.recordSlot(info)
	// A session that ended on a broken connection may have had acks the
	// slot never heard of: start after them (PostgreSQL skips transactions
	// that end before the requested start) and confirm them at once.
	return max(info.ConfirmedLSN, decoder.LSN(r.acked.Load())), version, nil
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
		m, err := s.stream.Receive(s.deadline())
		switch {
		case errors.Is(err, slot.ErrTimeout):
			if err := s.checkAlive(); err != nil {
				return err
			}
			s.housekeep(false)
			if s.commitDue(time.Now()) {
				if err := s.commitKafka(); err != nil {
					return err
				}
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
				s.tr.Marker(m.ServerWALEnd)
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
					if s.commitDue(now) {
						if err := s.commitKafka(); err != nil {
							return err
						}
					}
				}
			}
		}
	}
}

// deadline is when Receive should give the loop a chance to send a status
// update: soon while transactions are in flight or a new position waits to
// be confirmed, else at the next periodic update.
func (s *session) deadline() time.Time {
	d := s.status.Next()
	if s.tr.InFlight() > 0 || s.status.Pending(s.tr.Confirmed().LSN) || s.eos != nil && s.rt.InTxn() {
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
		if err := s.stream.SendStatus(s.status.Confirmed(), true); err != nil {
			return err
		}
	}
	return nil
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
		s.txn = s.tr.Begin(b.CommitTime)
		s.r.metrics.Transactions.Inc()
		if e := s.eos; e != nil {
			e.skip.Begin(b.FinalLSN)
			e.curCommit, e.curEvents, e.inPG = b.FinalLSN, 0, true
		}
	case decoder.KindInsert:
		if s.txn == nil {
			return fmt.Errorf("decode pgoutput message at %s: %w: insert outside a transaction", s.lastLSN, decoder.ErrMalformed)
		}
		if e := s.eos; e != nil {
			if e.skip.Event() {
				e.curEvents++
				return nil // in Kafka already, by the checkpoint found at start
			}
			if !s.rt.InTxn() {
				e.txnStart = time.Now()
			}
		}
		ev := s.dec.Event()
		for {
			wait, err := s.rt.Send(ev, s.lastLSN, s.txn)
			if err != nil {
				return s.eosErrorOr(err)
			}
			if wait == nil {
				break
			}
			if err := s.await(wait); err != nil {
				return err
			}
		}
		if e := s.eos; e != nil {
			// Counted once in the Kafka transaction, not before: a stop
			// while waiting for room commits a checkpoint that must not
			// claim an event never sent.
			e.curEvents++
			if s.rt.TxnEvents() >= s.r.cfg.TxnMaxEvents {
				return s.commitKafka() // a large transaction is split across Kafka transactions
			}
		}
	case decoder.KindCommit:
		if s.txn == nil {
			return fmt.Errorf("decode pgoutput message at %s: %w: commit without begin", s.lastLSN, decoder.ErrMalformed)
		}
		c := s.dec.Commit()
		s.tr.Commit(s.txn, c.EndLSN)
		s.txn = nil
		if e := s.eos; e != nil {
			e.lastFull, e.curEvents, e.inPG = c.EndLSN, 0, false
			if s.commitDue(time.Now()) {
				return s.commitKafka()
			}
		}
	case decoder.KindMessage:
		// A heartbeat (or any non-transactional message): everything
		// before it was received, so it is a marker like a keepalive.
		s.tr.Marker(s.dec.MessageLSN())
	case decoder.KindUnmapped:
		s.r.unmappedInsert(s.dec.Unmapped())
	}
	return nil
}

// unmappedInsert counts an insert the publication sent for a table no
// outbox maps, and says so once per table for the life of the process: the
// row is not published, and without a word a misconfigured --table or a
// partition published under its own name would look like a quiet outbox.
func (r *Relay) unmappedInsert(t decoder.Table, oid uint32) {
	c, ok := r.unmapped[t]
	if !ok {
		if r.unmapped == nil {
			r.unmapped = make(map[decoder.Table]prometheus.Counter)
		}
		c = r.metrics.UnmappedInserts.WithLabelValues(t.String())
		r.unmapped[t] = c
		r.log.Warn("the publication streams inserts of a table that is not an outbox table: they are not published (counted in walrelay_unmapped_inserts_total); add it with --table if it is an outbox, else remove it from the publication",
			zap.String("table", t.String()), zap.Uint32("relation_oid", oid), zap.String("publication", r.cfg.Publication))
	}
	c.Inc()
}

// eosErrorOr maps a fenced producer to the fatal error, and passes other
// errors on.
func (s *session) eosErrorOr(err error) error {
	if s.eos != nil && errors.Is(err, router.ErrFenced) {
		return s.eosError(err)
	}
	return err
}

// await blocks until ch delivers, while still sending status updates: the
// walsender disconnects a client that stays silent for wal_sender_timeout,
// and Kafka may be slow for longer than that.
func (s *session) await(ch <-chan struct{}) error {
	// The socket is not read meanwhile: the server's silence is ours.
	defer func() { s.lastRecv, s.pinged, s.heard = time.Now(), false, false }()
	for {
		s.timer.Reset(time.Until(s.nextTick))
		select {
		case <-ch:
			return nil
		case <-s.timer.C:
			s.housekeep(false)
		case err := <-s.failed:
			return err
		case <-s.ctx.Done():
			return s.ctx.Err()
		}
	}
}

// housekeep advances the watermark and sends a status update when one is
// due: at once when forced (the server asked for a reply), every
// StatusInterval, and ConfirmDelay after the watermark moved.
func (s *session) housekeep(force bool) {
	now := time.Now()
	if !now.Before(s.nextTick) {
		s.nextTick = now.Add(tick)
	}
	pos := s.tr.Advance()
	s.r.acked.Store(uint64(pos.LSN))
	m := s.r.metrics
	if s.lastLSN != 0 {
		s.r.received.Store(uint64(s.lastLSN))
		m.ReceivedLSN.Set(float64(s.lastLSN))
	}
	if s.serverEnd != 0 {
		m.ServerWALEndLSN.Set(float64(s.serverEnd))
	}
	if s.recvBytes > 0 {
		m.ReceivedBytes.Add(float64(s.recvBytes))
		s.recvBytes = 0
	}
	// Replication lag: now minus the commit time of the newest confirmed
	// transaction while anything is in flight (the oldest in flight when
	// nothing was confirmed yet), 0 when caught up.
	var lag time.Duration
	if oldest := s.tr.OldestCommit(); !oldest.IsZero() {
		ref := pos.CommitTime
		if ref.IsZero() {
			ref = oldest
		}
		lag = max(now.Sub(ref), 0)
	}
	s.r.lag.Store(int64(lag))
	m.ReplicationLag.Set(lag.Seconds())
	s.r.updateReady()
	if !s.status.Due(now, pos.LSN, force) {
		return
	}
	if err := s.stream.SendStatus(pos.LSN, false); err != nil {
		// The next Receive fails on the same broken connection and ends
		// the session; nothing more to do here.
		s.r.log.Debug("standby status update failed", zap.Error(err))
		return
	}
	m.StandbyStatusSent.Inc()
	m.ConfirmedLSN.Set(float64(pos.LSN))
	if pos.LSN > s.status.Confirmed() {
		s.r.log.Debug("confirmed", zap.Stringer("lsn", pos.LSN))
	}
	s.status.Sent(now, pos.LSN)
	s.r.confirmed.Store(uint64(pos.LSN))
}

// finish ends a session: it waits for outstanding acks (unbounded but
// cancellable when not stopping, so the next session starts from an exact
// position), confirms what they allow when the connection still works,
// and closes the stream. A stop waits at most ShutdownTimeout in all, for
// the final Kafka commit (exactly-once) and the acks together.
func (s *session) finish(cause error) error {
	stopping := s.ctx.Err() != nil
	if s.eos != nil {
		// Exactly-once: commit what the open Kafka transaction holds on a
		// clean stop, else abort it; nothing else is in flight after.
		if err := s.endEOS(stopping && cause != nil && errors.Is(cause, context.Canceled)); err != nil {
			s.r.log.Warn("ending the Kafka transaction failed; the next start resumes from the last checkpoint", zap.Error(err))
			if isFatal(err) {
				cause = err
				stopping = false
			}
		}
	}
	flushCtx := context.Background()
	if stopping {
		var cancel context.CancelFunc
		flushCtx, cancel = context.WithDeadline(flushCtx, s.stopDeadline())
		defer cancel()
		s.r.log.Info("stopping: waiting for outstanding acks", zap.Int64("inflight_events", s.rt.Inflight()),
			zap.Duration("timeout", max(time.Until(s.stopDeadline()), 0)))
	} else {
		var cancel context.CancelFunc
		flushCtx, cancel = context.WithCancel(s.ctx)
		defer cancel()
	}
	done := make(chan error, 1)
	go func() { done <- s.rt.Flush(flushCtx) }()
	ctx := s.ctx
	if stopping {
		ctx = context.Background() // keep confirming while draining
	}
	var flushErr error
wait:
	for {
		s.timer.Reset(time.Until(s.nextTick))
		select {
		case flushErr = <-done:
			break wait
		case <-s.timer.C:
			s.housekeep(false)
		case <-ctx.Done():
			flushErr = <-done
			break wait
		}
	}
	s.housekeep(true)
	if stopping {
		if flushErr != nil {
			s.r.log.Warn("stopped before every event was acknowledged; they will be sent again on restart",
				zap.Int64("inflight_events", s.rt.Inflight()), zap.Error(flushErr))
		}
		s.r.log.Info("stopped", zap.Stringer("confirmed_lsn", s.r.Confirmed()))
	}
	s.stream.Close(context.Background())
	if stopping {
		return nil
	}
	return cause
}
