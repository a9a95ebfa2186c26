package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// start.go opens a session: where its stream starts, the stream itself and
// the delivery of the configured mode. The session loop is in session.go.

// errSlotBusy means another client streams from the slot: this relay waits
// as a standby and tries again after a backoff.
var errSlotBusy = errors.New("replication slot is in use by another process")

// session streams until the connection breaks, Kafka refuses a record, or
// ctx ends; then it drains acks and confirms what it can.
func (r *Relay) session(ctx context.Context, rt *router.Router) (err error) {
	start, err := r.guard.startPosition(ctx)
	if err != nil {
		return err
	}
	// The slot first, Kafka's transactional id after: a relay that finds
	// the slot busy waits as a standby without fencing the active one.
	stream, err := slot.Start(ctx, r.cfg.PGURL, start, slot.StreamOptions{
		Slot: r.cfg.Slot, Publication: r.cfg.Publication, Binary: r.cfg.Binary,
		Read: r.cfg.Read,
		// Another relay on the same publication sees the topics from it.
		TopicTemplate: r.cfg.Router.TopicTemplate,
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" {
			return fmt.Errorf("%w: %s", errSlotBusy, pgErr.Message)
		}
		return r.guard.sessionGap(ctx, err)
	}
	r.guard.streamed(stream.System.Timeline, start)
	walsender := stream.PID()
	every := r.statusEvery(stream.SenderTimeout)
	open, st, err := r.prepareDelivery(ctx, rt, stream, start, every)
	if err != nil {
		err = r.guard.afterFence(err, walsender)
		stream.Close(context.Background())
		return err
	}
	// A mapped value over the record limit could never be produced: the
	// decoder leaves it out instead of copying it (the event is then
	// dead-lettered as too large).
	dec, err := decoder.New(decoder.Config{Tables: r.cfg.Tables, Mapping: r.cfg.Mapping, Binary: r.cfg.Binary, MaxValueBytes: r.cfg.Router.MaxRecordBytes})
	if err != nil {
		stream.Close(context.Background())
		return &fatalError{err}
	}
	s := r.newSession(ctx, st, dec, start, every)
	s.walsender = walsender
	if s.d, err = open(stream.System, s); err != nil {
		stream.Close(context.Background())
		return err
	}
	s.system = stream.System
	began := r.sup.now()
	err = s.run()
	r.sup.sessionEnded(began, start)
	return r.guard.sessionGap(ctx, err)
}

// statusEvery is the longest time between two status updates on a stream
// whose walsender ends a client silent for senderTimeout (0: never):
// StatusInterval, or a third of the timeout when that is shorter. While
// the relay waits for Kafka it does not read the stream, so the
// walsender's requests for a reply go unseen; only updates sent on this
// schedule keep the connection, whatever StatusInterval says.
func (r *Relay) statusEvery(senderTimeout time.Duration) time.Duration {
	every := r.cfg.StatusInterval
	if senderTimeout > 0 && senderTimeout/3 < every {
		every = max(senderTimeout/3, time.Millisecond)
		r.log.Info("status updates more often than relay.Config.StatusInterval: the server ends a replication connection silent for its wal_sender_timeout, and the relay does not read the stream while it waits for Kafka",
			zap.Duration("status_interval", r.cfg.StatusInterval), zap.Duration("wal_sender_timeout", senderTimeout), zap.Duration("status_every", every))
	}
	return every
}

// openDelivery makes a session's delivery once its stream is open: sys is
// what the stream's IDENTIFY_SYSTEM reported, s the session it serves.
type openDelivery func(sys pglogrepl.IdentifySystemResult, s *session) (delivery, error)

// prepareDelivery does what the delivery mode needs once the slot is
// held and before the stream is read (exactly-once: take the
// transactional id, fencing any older relay, and read the checkpoint), and
// returns how to make the session's delivery after, and the stream the
// session reads. It is the one place that tells the modes apart.
func (r *Relay) prepareDelivery(ctx context.Context, rt *router.Router, st stream, start decoder.LSN, statusEvery time.Duration) (openDelivery, stream, error) {
	if !r.cfg.ExactlyOnce {
		return func(_ pglogrepl.IdentifySystemResult, s *session) (delivery, error) {
			return newAtLeastOnce(rt, s.wait), nil
		}, st, nil
	}
	var resume resumePoint
	var tookID, readCheckpoint time.Duration
	ahead, err := r.answeringServer(st, start, statusEvery, func() error {
		began := time.Now()
		if err := r.initTransactions(ctx, rt); err != nil {
			return err
		}
		tookID = time.Since(began)
		if err := r.commits.abortHanging(ctx, rt.Txn().AbortHanging); err != nil {
			return kafkaTxnError(err)
		}
		found, err := r.readCheckpoint(ctx, rt.Txn())
		readCheckpoint = time.Since(began) - tookID
		if err == nil {
			resume = r.commits.distrust(ctx, found, rt.Txn().Landed)
		}
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	// The read-ahead is the drain's peak of memory: how much it took, and
	// why, tells whether prefetchMaxBytes fits.
	r.log.Info("exactly-once: took the transactional id and read the checkpoint; the stream was read ahead meanwhile",
		zap.Duration("took_id", tookID), zap.Duration("read_checkpoint", readCheckpoint),
		zap.Int("read_ahead_messages", ahead.queued()), zap.Int("read_ahead_bytes", ahead.bytes),
		zap.Bool("read_ahead_full", ahead.bytes >= prefetchMaxBytes))
	st = ahead
	return func(sys pglogrepl.IdentifySystemResult, s *session) (delivery, error) {
		resume, err := r.onThisTimeline(ctx, resume, sys)
		if err != nil {
			return nil, err
		}
		if err := r.verifyCheckpoint(ctx, resume, sys); err != nil {
			return nil, err
		}
		eo := r.newExactlyOnce(rt, rt.Txn(), resume, sys, s.wait, s.kafkaCtx)
		eo.committed, eo.unconfirmed = r.commits.committed, r.commits.unconfirmed
		return eo, nil
	}, st, nil
}

// prefetchMaxBytes bounds the memory answeringServer allocates for what it
// reads ahead, messages and their data (tests lower it).
var prefetchMaxBytes = 32 << 20

// answeringServer runs f while the stream, just started, waits for the
// session: it reads ahead into memory (up to prefetchMaxBytes), answers
// the server's requests for a reply and sends a status update (confirming
// start, which the session confirms first anyway) every StatusInterval.
// The walsender disconnects a client silent for wal_sender_timeout, and a
// walsender left to fill an unread socket streams slowly afterwards; taking
// the transactional id and reading the checkpoint wait on Kafka. It
// returns the stream the session reads: what was read ahead, then st.
func (r *Relay) answeringServer(st stream, start decoder.LSN, statusEvery time.Duration, f func() error) (*prefetched, error) {
	p := &prefetched{stream: st}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		lastSent := time.Now()
		status := func() bool {
			lastSent = time.Now()
			return st.SendStatus(start, false) == nil
		}
		for {
			if p.bytes >= prefetchMaxBytes {
				// Enough in memory: only keep the server content.
				select {
				case <-done:
					return
				case <-time.After(time.Until(lastSent.Add(statusEvery))):
					if !status() {
						return
					}
				}
				continue
			}
			m, err := st.Receive(lastSent.Add(statusEvery))
			switch {
			case errors.Is(err, slot.ErrTimeout):
				if !status() {
					return // the session's first Receive fails on the same connection
				}
				continue
			case errors.Is(err, slot.ErrInterrupted):
				return
			case err != nil:
				p.err = err // returned to the session after what was read
				return
			}
			if m.Kind == slot.Keepalive && m.ReplyRequested && !status() {
				return
			}
			if !time.Now().Before(lastSent.Add(statusEvery)) && !status() {
				return
			}
			p.push(m)
		}
	})
	err := f()
	close(done)
	st.Interrupt()
	wg.Wait()
	return p, err
}

// prefetched is a stream with messages read ahead: Receive returns them
// first (whatever the deadline: they are at hand), then an error the read
// ahead met, then reads the stream.
//
// It holds them compactly, because a read-ahead that fills is the relay's
// peak of memory in an exactly-once drain: messages in fixed blocks (a
// growing slice would copy itself and leave the old copy to the garbage
// collector) and their data packed into shared chunks (one allocation per
// message costs its size class's rounding). A chunk is freed once the
// session has let go of every message in it.
type prefetched struct {
	stream
	blocks [][]slot.Message // queued messages; blocks[0][head:] next
	head   int
	chunk  []byte // where the next message's data is packed
	bytes  int    // memory allocated for it: blocks and chunks
	err    error
}

const (
	prefetchBlockMessages = 1024
	prefetchChunkBytes    = 256 << 10
	messageBytes          = int(unsafe.Sizeof(slot.Message{}))
)

// push queues a copy of m (its Data is valid only until the next Receive).
func (p *prefetched) push(m slot.Message) {
	switch n := len(m.Data); {
	case n == 0:
		m.Data = m.Data[:0:0]
	case n > prefetchChunkBytes/4:
		m.Data = bytes.Clone(m.Data)
		p.bytes += n
	default:
		if n > cap(p.chunk)-len(p.chunk) {
			p.chunk = make([]byte, 0, prefetchChunkBytes)
			p.bytes += prefetchChunkBytes
		}
		at := len(p.chunk)
		p.chunk = append(p.chunk, m.Data...)
		m.Data = p.chunk[at:len(p.chunk):len(p.chunk)] // a consumer's append cannot reach the next message
	}
	if last := len(p.blocks) - 1; last < 0 || len(p.blocks[last]) == prefetchBlockMessages {
		p.blocks = append(p.blocks, make([]slot.Message, 0, prefetchBlockMessages))
		p.bytes += prefetchBlockMessages * messageBytes
	}
	last := len(p.blocks) - 1
	p.blocks[last] = append(p.blocks[last], m)
}

// queued is how many messages are read ahead and not yet returned.
func (p *prefetched) queued() int {
	n := -p.head
	for _, b := range p.blocks {
		n += len(b)
	}
	return n
}

func (p *prefetched) Receive(deadline time.Time) (slot.Message, error) {
	if len(p.blocks) > 0 {
		b := p.blocks[0]
		m := b[p.head]
		b[p.head] = slot.Message{} // lets its chunk go
		if p.head++; p.head == len(b) {
			p.blocks[0] = nil
			p.blocks, p.head = p.blocks[1:], 0
			if len(p.blocks) == 0 {
				p.blocks, p.chunk = nil, nil
			}
		}
		return m, nil
	}
	if p.err != nil {
		err := p.err
		p.err = nil
		return slot.Message{}, err
	}
	return p.stream.Receive(deadline)
}

// Drained is the stream's, once nothing read ahead is left.
func (p *prefetched) Drained() bool {
	return len(p.blocks) == 0 && p.err == nil && streamDrained(p.stream)
}

// initTransactions takes the transactional id once this relay holds the
// slot: it fences any older relay that still holds the id (one that lost
// the slot without noticing), so the checkpoint read after is final. A
// standby never gets here, so it fences nobody.
//
// Kafka denying WRITE on the transactional id stops a relay that never
// streamed (a configuration to fix, refused at once); one that streamed
// had it, so an operator took it away: it waits, not ready, retrying with
// the backoff until the ACL is back.
func (r *Relay) initTransactions(ctx context.Context, rt *router.Router) error {
	err := rt.Txn().Init(ctx)
	if err != nil && (errors.Is(err, router.ErrFenced) || kafkaConfigError(err) || kafkaDenied(err) && !r.sup.streamed.Load()) {
		return &fatalError{err}
	}
	return err
}
