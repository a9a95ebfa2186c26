package relay

// session_test.go drives the session loop with a fake replication stream
// and a fake producer under both deliveries: what it confirms, when, and
// how it ends.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
	pgo "github.com/walrelay/walrelay/test/pgoutputtest"
)

// pgoutput messages (protocol version 1), just enough for the loop: an
// outbox table of text columns, rows that differ only in their id.

const outboxOID = 16384

func relationMsg(oid uint32, name string) []byte {
	return pgo.Relation(oid, "public", name, pgo.TextColumns("id", "aggregate_type", "aggregate_id", "type", "payload")...)
}

func beginMsg(final uint64) []byte { return pgo.Begin(final, 0, 7) }

func insertMsg(oid uint32, id string) []byte {
	return pgo.Insert(oid, pgo.Text(id), pgo.Text("order"), pgo.Text("a1"), pgo.Text("created"), pgo.Text(`{}`))
}

func commitMsg(commit, end uint64) []byte { return pgo.Commit(0, commit, end, 0) }

func heartbeatMsg(lsn uint64) []byte { return pgo.Logical(false, lsn, "walrelay.heartbeat", nil) }

func data(at uint64, b []byte) slot.Message {
	return slot.Message{Kind: slot.XLogData, WALStart: decoder.LSN(at), ServerWALEnd: decoder.LSN(at), Data: b}
}

func keepalive(end uint64, reply bool) slot.Message {
	return slot.Message{Kind: slot.Keepalive, ServerWALEnd: decoder.LSN(end), ReplyRequested: reply}
}

// txnMsgs is one PostgreSQL transaction with an outbox insert per id: its
// commit record at commit, ending at commit+8.
func txnMsgs(commit uint64, ids ...string) []slot.Message {
	m := []slot.Message{data(commit-100, beginMsg(commit))}
	for i, id := range ids {
		m = append(m, data(commit-90+uint64(i), insertMsg(outboxOID, id)))
	}
	return append(m, data(commit, commitMsg(commit, commit+8)))
}

// fakeStream is a replication stream fed by the test. Like the real one
// it returns a message already at hand whatever the deadline, and what one
// send call passes arrives together (as if in one read buffer).
type fakeStream struct {
	batch  sync.Mutex // held by send while it queues its messages
	msgs   chan slot.Message
	intr   chan struct{}
	mu     sync.Mutex
	status []statusUpdate
	closed bool
}

type statusUpdate struct {
	lsn   decoder.LSN
	reply bool
}

func newFakeStream() *fakeStream {
	return &fakeStream{msgs: make(chan slot.Message, 1000), intr: make(chan struct{}, 1)}
}

func (f *fakeStream) Receive(deadline time.Time) (slot.Message, error) {
	f.batch.Lock()
	select {
	case m := <-f.msgs:
		f.batch.Unlock()
		return m, nil
	default:
	}
	f.batch.Unlock()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case m := <-f.msgs:
		return m, nil
	case <-f.intr:
		return slot.Message{}, slot.ErrInterrupted
	case <-t.C:
		return slot.Message{}, slot.ErrTimeout
	}
}

func (f *fakeStream) SendStatus(lsn decoder.LSN, reply bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.status = append(f.status, statusUpdate{lsn, reply})
	return nil
}

func (f *fakeStream) Interrupt() {
	select {
	case f.intr <- struct{}{}:
	default:
	}
}

func (f *fakeStream) Close(context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	return nil
}

func (f *fakeStream) send(ms ...slot.Message) {
	f.batch.Lock()
	defer f.batch.Unlock()
	for _, m := range ms {
		f.msgs <- m
	}
}

// confirmed is the last position sent to the server (0 before any).
func (f *fakeStream) confirmed() decoder.LSN {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.status) == 0 {
		return 0
	}
	return f.status[len(f.status)-1].lsn
}

func (f *fakeStream) updates() []statusUpdate {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]statusUpdate(nil), f.status...)
}

// fakeProducer is a Kafka producer whose acks the test controls.
type fakeProducer struct {
	mu        sync.Mutex
	events    []string       // ids, in Send order
	pending   []router.Acker // produced, not yet acked by "Kafka"
	autoAck   bool           // ack at once (at-least-once)
	eos       bool           // acks wait for Commit
	room      chan struct{}  // while set, Send returns it: no room
	sendErr   error
	flushHold bool // Flush acks nothing and waits for ctx
	refused   bool // Kafka refused what is pending: Flush acks nothing

	inTxn     bool
	txnAcks   []router.Acker
	commits   []checkpoint.Durable
	aborts    int
	commitErr error

	// async hands each commit to the background, as two transactional
	// producers taking turns do: answer (or, with autoAnswer, Commit
	// itself) answers it; only then are its records acked and its
	// checkpoint listed. A Commit before the last one was settled is a
	// protocol violation, counted in overlaps.
	async      bool
	autoAnswer bool
	flight     *fakeFlight
	calls      int // Commit calls that handed a commit over
	overlaps   int
}

// fakeFlight is a fakeProducer's commit in the background.
type fakeFlight struct {
	done chan struct{}
	acks []router.Acker
	d    checkpoint.Durable
	err  error
}

func (p *fakeProducer) Send(ev *decoder.Event, _ decoder.LSN, a router.Acker) (<-chan struct{}, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.room != nil {
		return p.room, nil
	}
	if p.sendErr != nil {
		return nil, p.sendErr
	}
	a.Add()
	p.events = append(p.events, string(ev.ID))
	switch {
	case p.eos:
		p.inTxn = true
		p.txnAcks = append(p.txnAcks, a)
	case p.autoAck:
		a.Ack()
	default:
		p.pending = append(p.pending, a)
	}
	return nil, nil
}

func (p *fakeProducer) ackAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, a := range p.pending {
		a.Ack()
	}
	p.pending = nil
}

func (p *fakeProducer) Flush(ctx context.Context) error {
	if p.flushHold {
		<-ctx.Done()
		return ctx.Err()
	}
	p.mu.Lock()
	refused := p.refused
	p.mu.Unlock()
	if !refused {
		p.ackAll()
	}
	return nil
}

func (p *fakeProducer) Inflight() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return int64(len(p.pending))
}

func (p *fakeProducer) Open() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.inTxn
}

func (p *fakeProducer) Records() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.txnAcks)
}

func (p *fakeProducer) Commit(_ context.Context, key, value []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.inTxn {
		return nil
	}
	if p.commitErr != nil {
		return p.commitErr
	}
	d, err := checkpoint.UnmarshalDurable(value)
	if err != nil || string(key) != d.Slot {
		panic(fmt.Sprintf("bad checkpoint record %q: %v", value, err))
	}
	if p.async {
		if p.flight != nil {
			p.overlaps++ // two commits in flight: one could land without the other
		}
		p.calls++
		p.flight = &fakeFlight{done: make(chan struct{}), acks: p.txnAcks, d: d}
		p.txnAcks, p.inTxn = nil, false
		if p.autoAnswer {
			p.answerLocked(nil)
		}
		return nil
	}
	p.commits = append(p.commits, d)
	for _, a := range p.txnAcks {
		a.Ack()
	}
	p.txnAcks, p.inTxn = nil, false
	return nil
}

// answer answers the commit in the background: committed when err is nil.
func (p *fakeProducer) answer(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.answerLocked(err)
}

func (p *fakeProducer) answerLocked(err error) {
	f := p.flight
	if err == nil {
		for _, a := range f.acks {
			a.Ack()
		}
		p.commits = append(p.commits, f.d)
	}
	f.err = err
	close(f.done)
}

// handed is how many commits were handed to the background.
func (p *fakeProducer) handed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

func (p *fakeProducer) Settling() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.flight == nil {
		return nil
	}
	return p.flight.done
}

func (p *fakeProducer) Settle() error {
	p.mu.Lock()
	f := p.flight
	p.mu.Unlock()
	if f == nil {
		return nil
	}
	<-f.done
	p.mu.Lock()
	defer p.mu.Unlock()
	p.flight = nil
	return f.err
}

func (p *fakeProducer) Abort(context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.aborts++
	p.txnAcks, p.inTxn = nil, false
	return nil
}

func (p *fakeProducer) sent() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.events...)
}

func (p *fakeProducer) checkpoints() []checkpoint.Durable {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]checkpoint.Durable(nil), p.commits...)
}

// harness is a running session.
type harness struct {
	r      *Relay
	st     *fakeStream
	p      *fakeProducer
	s      *session
	cancel context.CancelFunc
	done   chan error
}

const start = 1000

// startSession runs a session from LSN start on a fake stream and p; with
// resume, exactly-once from that checkpoint.
func startSession(t *testing.T, change func(*Config), p *fakeProducer, resume *resumePoint) *harness {
	t.Helper()
	return startSessionWith(t, change, p, resume, nil)
}

// startSessionWith is startSession with prepare run on the relay and the
// session just before the session starts.
func startSessionWith(t *testing.T, change func(*Config), p *fakeProducer, resume *resumePoint, prepare func(*Relay, *session)) *harness {
	t.Helper()
	cfg := validConfig()
	cfg.StatusInterval, cfg.ConfirmDelay = 50*time.Millisecond, 10*time.Millisecond
	if resume != nil {
		cfg.ExactlyOnce = true
		p.eos = true
	}
	if change != nil {
		change(&cfg)
	}
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	// No publication watch runs here: it vouches for every position
	// (TestSessionConfirmsOnlyWhatThePublicationWatchVouchedFor tests the
	// gate).
	r.guard.clearance.Vouch(math.MaxUint64)
	dec, err := decoder.New(decoder.Config{Tables: r.cfg.Tables, Mapping: r.cfg.Mapping})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	st := newFakeStream()
	s := r.newSession(ctx, st, dec, start, cfg.StatusInterval)
	s.system.SystemID, s.system.XLogPos = "7000000000000000001", 1<<40
	if resume != nil {
		if err := r.verifyCheckpoint(ctx, *resume, s.system); err != nil {
			t.Fatal(err)
		}
		s.d = r.newExactlyOnce(p, p, *resume, s.system, s.wait, s.kafkaCtx)
	} else {
		s.d = newAtLeastOnce(p, s.wait)
	}
	if prepare != nil {
		prepare(r, s)
	}
	h := &harness{r: r, st: st, p: p, s: s, cancel: cancel, done: make(chan error, 1)}
	st.send(data(start, relationMsg(outboxOID, "outbox")))
	go func() { h.done <- s.run() }()
	t.Cleanup(func() {
		cancel()
		<-h.done //nolint:errcheck // only waits: the tests that care read the error with end
	})
	return h
}

// waitFor polls cond until it holds, failing the test after 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// end waits for the session to end and returns its error.
func (h *harness) end(t *testing.T) error {
	t.Helper()
	select {
	case err := <-h.done:
		h.done <- err // for the cleanup
		return err
	case <-time.After(5 * time.Second):
		t.Fatal("the session did not end")
		return nil
	}
}

// TestSessionConfirmsOnlyWhatThePublicationWatchVouchedFor: an
// acknowledged transaction is confirmed only up to where the publication
// watch found the publication intact; past it the session asks the watch
// to look, and confirms once it vouches.
func TestSessionConfirmsOnlyWhatThePublicationWatchVouchedFor(t *testing.T) {
	p := &fakeProducer{}
	h := startSessionWith(t, nil, p, nil, func(r *Relay, _ *session) { r.guard.clearance.Forget() })
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the event sent", func() bool { return len(p.sent()) == 1 })
	p.ackAll()
	waitFor(t, "the watch asked to vouch for the commit", func() bool { return h.r.guard.clearance.Wanted() >= 2008 })
	h.st.send(keepalive(2004, true))
	waitFor(t, "a reply to the keepalive", func() bool {
		for _, u := range h.st.updates() {
			if u.reply {
				return true
			}
		}
		return len(h.st.updates()) > 1
	})
	if got := h.st.confirmed(); got != start {
		t.Fatalf("confirmed %s before the publication watch vouched for it, want %s", got, decoder.LSN(start))
	}
	h.r.guard.clearance.Vouch(2004)
	waitFor(t, "the vouched-for part confirmed", func() bool { return h.st.confirmed() == 2004 })
	h.r.guard.clearance.Vouch(3000)
	waitFor(t, "the commit confirmed", func() bool { return h.st.confirmed() == 2008 })
	h.cancel()
	if err := h.end(t); err != nil {
		t.Fatalf("a stop returned %v, want nil", err)
	}
}

func TestSessionConfirmsACommittedTransactionOnceKafkaHasIt(t *testing.T) {
	p := &fakeProducer{}
	h := startSession(t, nil, p, nil)
	h.st.send(txnMsgs(2000, "e1", "e2")...)
	waitFor(t, "both events sent", func() bool { return len(p.sent()) == 2 })
	h.st.send(keepalive(2008, true))
	waitFor(t, "a reply to the keepalive", func() bool {
		for _, u := range h.st.updates() {
			if !u.reply && u.lsn == start {
				return true
			}
		}
		return false
	})
	if got := h.st.confirmed(); got != start {
		t.Fatalf("confirmed %s before Kafka acked the transaction, want %s", got, decoder.LSN(start))
	}
	p.ackAll()
	waitFor(t, "the commit confirmed", func() bool { return h.st.confirmed() == 2008 })
	if got := p.sent(); got[0] != "e1" || got[1] != "e2" {
		t.Fatalf("events sent %v, want e1, e2 in stream order", got)
	}
	h.cancel()
	if err := h.end(t); err != nil {
		t.Fatalf("a stop returned %v, want nil", err)
	}
	if !h.st.closed {
		t.Fatal("the stream was not closed")
	}
}

func TestSessionMarkerWaitsBehindInflightData(t *testing.T) {
	p := &fakeProducer{}
	h := startSession(t, nil, p, nil)
	h.st.send(txnMsgs(2000, "e1")...)
	h.st.send(data(3000, heartbeatMsg(3000)), keepalive(4000, true))
	waitFor(t, "a reply", func() bool { return len(h.st.updates()) > 0 })
	waitFor(t, "the keepalive read", func() bool { return len(h.st.msgs) == 0 })
	h.st.send(keepalive(4000, true))
	waitFor(t, "two replies", func() bool { return len(h.st.updates()) >= 2 })
	if got := h.st.confirmed(); got != start {
		t.Fatalf("confirmed %s past a transaction Kafka has not acked (marker at 4000)", got)
	}
	p.ackAll()
	waitFor(t, "the marker confirmed", func() bool { return h.st.confirmed() == 4000 })
}

func TestSessionNoIdleAdvanceIgnoresKeepalives(t *testing.T) {
	p := &fakeProducer{autoAck: true}
	h := startSession(t, func(c *Config) { c.NoIdleAdvance = true }, p, nil)
	h.st.send(keepalive(5000, true))
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the commit confirmed", func() bool { return h.st.confirmed() == 2008 })
	h.st.send(keepalive(6000, true))
	waitFor(t, "the reply", func() bool { return len(h.st.msgs) == 0 && len(h.st.updates()) >= 2 })
	if got := h.st.confirmed(); got != 2008 {
		t.Fatalf("confirmed %s with --no-idle-advance, want the commit's 2008", got)
	}
}

func TestSessionBackpressureKeepsSendingStatus(t *testing.T) {
	room := make(chan struct{})
	p := &fakeProducer{autoAck: true, room: room}
	h := startSession(t, nil, p, nil)
	h.st.send(txnMsgs(2000, "e1")...)
	// No room: the session waits in Send, and still tells PostgreSQL it
	// is alive every StatusInterval.
	waitFor(t, "status updates while blocked", func() bool { return len(h.st.updates()) >= 3 })
	if len(p.sent()) != 0 {
		t.Fatal("an event was sent without room")
	}
	p.mu.Lock()
	p.room = nil
	p.mu.Unlock()
	close(room)
	waitFor(t, "the event sent once there is room", func() bool { return len(p.sent()) == 1 })
	waitFor(t, "the commit confirmed", func() bool { return h.st.confirmed() == 2008 })
}

func TestSessionEndsOnAProduceFailure(t *testing.T) {
	p := &fakeProducer{}
	h := startSession(t, nil, p, nil)
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the event sent", func() bool { return len(p.sent()) == 1 })
	refused := errors.New("MESSAGE_TOO_LARGE")
	p.mu.Lock()
	p.refused = true
	p.mu.Unlock()
	h.r.onProduceError(refused)
	err := h.end(t)
	if !errors.Is(err, refused) || causeOf(err) != "kafka" {
		t.Fatalf("session ended with %v (cause %s), want the refusal counted as kafka", err, causeOf(err))
	}
	if got := h.st.confirmed(); got == 2008 {
		t.Fatal("a transaction whose event Kafka refused was confirmed")
	}
}

func TestSessionEndsOnAnInvalidEventRefusal(t *testing.T) {
	refused := &deadletter.InvalidEventError{}
	p := &fakeProducer{sendErr: refused}
	h := startSession(t, nil, p, nil)
	h.st.send(txnMsgs(2000, "e1")...)
	if err := h.end(t); !isFatal(err) {
		t.Fatalf("session ended with %v, want a fatal error", err)
	}
}

func TestSessionStopDrainsOutstandingAcks(t *testing.T) {
	p := &fakeProducer{}
	h := startSession(t, nil, p, nil)
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the event sent", func() bool { return len(p.sent()) == 1 })
	h.cancel() // Flush acks what is outstanding
	if err := h.end(t); err != nil {
		t.Fatalf("stop returned %v", err)
	}
	if got := h.st.confirmed(); got != 2008 {
		t.Fatalf("confirmed %s after the drain, want 2008", got)
	}
}

func TestSessionStopGivesUpOnAcksAfterTheShutdownTimeout(t *testing.T) {
	p := &fakeProducer{flushHold: true}
	h := startSession(t, func(c *Config) { c.ShutdownTimeout = 100 * time.Millisecond }, p, nil)
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the event sent", func() bool { return len(p.sent()) == 1 })
	began := time.Now()
	h.cancel()
	if err := h.end(t); err != nil {
		t.Fatalf("stop returned %v", err)
	}
	if took := time.Since(began); took > 2*time.Second {
		t.Fatalf("stop took %s with a 100ms shutdown timeout", took)
	}
	if got := h.st.confirmed(); got == 2008 {
		t.Fatal("confirmed a transaction Kafka never acked")
	}
}

func TestSessionSilentServer(t *testing.T) {
	p := &fakeProducer{}
	h := startSession(t, func(c *Config) { c.ReceiveTimeout = 200 * time.Millisecond }, p, nil)
	err := h.end(t)
	if !errors.Is(err, errServerSilent) || causeOf(err) != "silent" {
		t.Fatalf("session ended with %v, want a silent server", err)
	}
	pinged := false
	for _, u := range h.st.updates() {
		pinged = pinged || u.reply
	}
	if !pinged {
		t.Fatal("no reply was requested at half the receive timeout")
	}
}

func TestSessionMalformedStream(t *testing.T) {
	for name, msg := range map[string][]byte{
		"insert outside a transaction": insertMsg(outboxOID, "e1"),
		"commit without begin":         commitMsg(2000, 2008),
		"garbage":                      {'I', 1},
	} {
		t.Run(name, func(t *testing.T) {
			h := startSession(t, nil, &fakeProducer{}, nil)
			h.st.send(data(1500, msg))
			if err := h.end(t); !errors.Is(err, decoder.ErrMalformed) || causeOf(err) != "decode" {
				t.Fatalf("session ended with %v, want a malformed message", err)
			}
		})
	}
}

// TestSessionUnmappedInserts: inserts of a table the publication streams
// but no outbox maps are counted and passed over when only FOR ALL TABLES
// (or TABLES IN SCHEMA) covers it, or the publication no longer does; when
// the publication lists it by name, the session stops with a fatal error
// naming it before anything past the transaction holding the insert is
// confirmed, after confirming the transactions before it.
func TestSessionUnmappedInserts(t *testing.T) {
	for _, tc := range []struct {
		cov  source.Coverage
		stop bool
	}{{source.Broad, false}, {source.NotCovered, false}, {source.Listed, true}} {
		t.Run(fmt.Sprint(tc.cov), func(t *testing.T) {
			p := &fakeProducer{autoAck: true}
			var looked []uint32
			h := startSessionWith(t, nil, p, nil, func(r *Relay, _ *session) {
				r.guard.coverage = func(_ context.Context, oid uint32) (source.Coverage, error) {
					looked = append(looked, oid)
					return tc.cov, nil
				}
			})
			h.st.send(data(1000, beginMsg(1100)), data(1010, insertMsg(outboxOID, "a")), data(1100, commitMsg(1100, 1108)),
				data(1500, relationMsg(outboxOID+1, "other")), data(1900, beginMsg(2000)),
				data(1910, insertMsg(outboxOID+1, "x")), data(1920, insertMsg(outboxOID+1, "y")), data(2000, commitMsg(2000, 2008)))
			if !tc.stop {
				waitFor(t, "the commit confirmed", func() bool { return h.st.confirmed() == 2008 })
				if len(p.sent()) != 1 {
					t.Fatalf("sent %v, want the outbox event alone", p.sent())
				}
				if n := len(h.r.tables.seen); n != 1 {
					t.Fatalf("%d unmapped tables counted, want 1", n)
				}
				if len(looked) != 1 || looked[0] != outboxOID+1 {
					t.Fatalf("coverage looked up for %v, want once for %d", looked, outboxOID+1)
				}
				return
			}
			err := h.end(t)
			if !isFatal(err) || !strings.Contains(err.Error(), "public.other") || !strings.Contains(err.Error(), "relay.Config.Tables") ||
				!strings.Contains(err.Error(), "DROP TABLE") {
				t.Fatalf("session ended with %v, want a fatal error naming the table and both fixes", err)
			}
			if c := h.st.confirmed(); c != 1108 {
				t.Fatalf("confirmed %s, want 0/454 (the transaction before the unmapped insert's)", c)
			}
		})
	}
}

func TestExactlyOnceSkipsWhatTheCheckpointCovers(t *testing.T) {
	// The previous relay committed transactions up to 2008 wholly and the
	// first event of the one committing at 3000, then crashed before the
	// slot was confirmed: PostgreSQL resends both.
	resume := &resumePoint{found: true, ckpt: checkpoint.Durable{
		Slot: "walrelay", SystemID: "7000000000000000001", LSN: 2008,
		Partial: &checkpoint.Partial{CommitLSN: 3000, Events: 1},
	}}
	p := &fakeProducer{}
	h := startSession(t, nil, p, resume)
	h.st.send(txnMsgs(2000, "old1", "old2")...)
	h.st.send(txnMsgs(3000, "half1", "half2", "half3")...)
	h.st.send(txnMsgs(4000, "new1")...)
	waitFor(t, "the last transaction committed in Kafka", func() bool {
		c := p.checkpoints()
		return len(c) > 0 && c[len(c)-1].LSN == 4008
	})
	if got := fmt.Sprint(p.sent()); got != "[half2 half3 new1]" {
		t.Fatalf("sent %s, want what the checkpoint does not cover: [half2 half3 new1]", got)
	}
	for _, c := range p.checkpoints() {
		if c.Slot != "walrelay" || c.SystemID != "7000000000000000001" {
			t.Fatalf("checkpoint %+v does not name the slot and system", c)
		}
	}
	waitFor(t, "the slot confirmed after the Kafka commit", func() bool { return h.st.confirmed() == 4008 })
}

func TestExactlyOnceSplitsALargeTransactionWithAPartialCheckpoint(t *testing.T) {
	p := &fakeProducer{}
	h := startSession(t, func(c *Config) { c.TxnMaxEvents = 2 }, p, &resumePoint{})
	h.st.send(txnMsgs(2000, "e1", "e2", "e3")...)
	waitFor(t, "two Kafka transactions", func() bool { return len(p.checkpoints()) >= 2 })
	first := p.checkpoints()[0]
	if first.Partial == nil || first.Partial.CommitLSN != 2000 || first.Partial.Events != 2 || first.LSN != 0 {
		t.Fatalf("first checkpoint %+v, want 2 events of the transaction committing at 2000", first)
	}
	waitFor(t, "the transaction confirmed", func() bool { return h.st.confirmed() == 2008 })
}

// noInterval keeps --txn-max-interval out of the way: only the stream
// running dry (or --txn-max-events) commits a Kafka transaction.
func noInterval(c *Config) { c.TxnMaxInterval = time.Hour; c.Router.TransactionTimeout = 3 * time.Hour }

// drainedStream is a fakeStream that tells when nothing is left to read
// (as slot.Stream.Drained does), and whose Receive waits for a message
// whatever its deadline: the session can only learn that the stream ran
// dry by asking.
type drainedStream struct{ *fakeStream }

func (d drainedStream) Drained() bool {
	d.batch.Lock()
	defer d.batch.Unlock()
	return len(d.msgs) == 0
}

func (d drainedStream) Receive(time.Time) (slot.Message, error) {
	select {
	case m := <-d.msgs:
		return m, nil
	case <-d.intr:
		return slot.Message{}, slot.ErrInterrupted
	}
}

// TestExactlyOnceCommitsWhenTheStreamRunsDry: the open Kafka transaction
// commits once nothing more is there to join it, whether the stream stays
// silent for idleWait or says it is drained (drainedStream, which never
// times out: only asking tells); what is there to read joins it first.
func TestExactlyOnceCommitsWhenTheStreamRunsDry(t *testing.T) {
	for _, st := range []struct {
		name    string
		prepare func(*Relay, *session)
	}{
		{"silent", nil},
		{"drained", func(_ *Relay, s *session) { s.stream = drainedStream{s.stream.(*fakeStream)} }},
	} {
		t.Run(st.name+": stream idle after a commit: Kafka commit now", func(t *testing.T) {
			p := &fakeProducer{}
			h := startSessionWith(t, noInterval, p, &resumePoint{}, st.prepare)
			h.st.send(txnMsgs(2000, "e1")...)
			waitFor(t, "the Kafka transaction committed without waiting for the interval", func() bool {
				c := p.checkpoints()
				return len(c) == 1 && c[0].LSN == 2008 && c[0].Partial == nil
			})
			// The next PostgreSQL commit gets a Kafka transaction of its own.
			h.st.send(txnMsgs(3000, "e2")...)
			waitFor(t, "the second Kafka transaction", func() bool {
				c := p.checkpoints()
				return len(c) == 2 && c[1].LSN == 3008
			})
		})
		t.Run(st.name+": more messages buffered: one commit once they are read", func(t *testing.T) {
			p := &fakeProducer{}
			h := startSessionWith(t, noInterval, p, &resumePoint{}, st.prepare)
			var batch []slot.Message
			for i := range 5 {
				batch = append(batch, txnMsgs(uint64(2000+1000*i), fmt.Sprint("e", i))...)
			}
			h.st.send(batch...)
			waitFor(t, "the batch committed", func() bool { return len(p.checkpoints()) > 0 })
			if c := p.checkpoints(); len(c) != 1 || c[0].LSN != 6008 {
				t.Fatalf("checkpoints %+v, want one Kafka transaction for the five buffered PostgreSQL transactions", c)
			}
		})
	}
	t.Run("more messages buffered: --txn-max-events still bounds", func(t *testing.T) {
		p := &fakeProducer{}
		h := startSession(t, func(c *Config) { noInterval(c); c.TxnMaxEvents = 2 }, p, &resumePoint{})
		h.st.send(append(append(txnMsgs(2000, "e1"), txnMsgs(3000, "e2")...), txnMsgs(4000, "e3")...)...)
		waitFor(t, "two Kafka transactions", func() bool { return len(p.checkpoints()) == 2 })
		if c := p.checkpoints(); c[0].LSN != 2008 || c[0].Partial == nil || c[0].Partial.CommitLSN != 3000 || c[1].LSN != 4008 {
			t.Fatalf("checkpoints %+v, want 2008 and an event of 3000 (the bound) then 4008 (idle)", c)
		}
	})
	t.Run("--txn-min-interval: an idle commit waits until the transaction is that old", func(t *testing.T) {
		p := &fakeProducer{}
		h := startSession(t, func(c *Config) { noInterval(c); c.TxnMinInterval = 300 * time.Millisecond }, p, &resumePoint{})
		began := time.Now()
		h.st.send(txnMsgs(2000, "e1")...)
		waitFor(t, "the Kafka transaction committed", func() bool { return len(p.checkpoints()) == 1 })
		if took := time.Since(began); took < 300*time.Millisecond {
			t.Fatalf("committed after %s, want at least --txn-min-interval 300ms", took)
		}
	})
	t.Run("idle inside a PostgreSQL transaction: wait for its commit", func(t *testing.T) {
		p := &fakeProducer{}
		h := startSession(t, noInterval, p, &resumePoint{})
		h.st.send(data(1900, beginMsg(2000)), data(1910, insertMsg(outboxOID, "e1")))
		waitFor(t, "the event sent", func() bool { return len(p.sent()) == 1 })
		// A keepalive read after the insert shows the loop went past it
		// (and ran dry) without committing half the transaction.
		before := len(h.st.updates())
		h.st.send(keepalive(1950, true))
		waitFor(t, "the keepalive answered", func() bool { return len(h.st.updates()) > before })
		if c := p.checkpoints(); len(c) != 0 {
			t.Fatalf("checkpoints %+v before the PostgreSQL commit, want none", c)
		}
		h.st.send(data(2000, commitMsg(2000, 2008)))
		waitFor(t, "the commit", func() bool { c := p.checkpoints(); return len(c) == 1 && c[0].LSN == 2008 })
	})
}

// An event the producer holds (a topic Kafka denies the relay, waiting
// for an ACL) does not hold the open Kafka transaction with it past
// --txn-max-interval: what it holds commits, with a partial checkpoint
// counting the events sent, so they become visible and the broker never
// times the transaction out; the held event follows once let through.
func TestExactlyOnceCommitsWhileAnEventIsHeld(t *testing.T) {
	p := &fakeProducer{}
	h := startSession(t, func(c *Config) { c.TxnMaxInterval = 50 * time.Millisecond }, p, &resumePoint{})
	h.st.send(data(1900, beginMsg(2000)), data(1910, insertMsg(outboxOID, "e1")))
	waitFor(t, "the first event sent", func() bool { return len(p.sent()) == 1 })
	room := make(chan struct{})
	p.mu.Lock()
	p.room = room
	p.mu.Unlock()
	h.st.send(data(1920, insertMsg(outboxOID, "e2")))
	waitFor(t, "the Kafka transaction committed while e2 is held", func() bool { return len(p.checkpoints()) == 1 })
	if c := p.checkpoints()[0]; c.Partial == nil || c.Partial.CommitLSN != 2000 || c.Partial.Events != 1 {
		t.Fatalf("checkpoint %+v, want 1 event of the transaction committing at 2000", c)
	}
	p.mu.Lock()
	p.room = nil
	p.mu.Unlock()
	close(room)
	h.st.send(data(2000, commitMsg(2000, 2008)))
	waitFor(t, "the held event sent and committed", func() bool {
		c := p.checkpoints()
		return len(p.sent()) == 2 && len(c) == 2 && c[1].LSN == 2008 && c[1].Partial == nil
	})
	waitFor(t, "the transaction confirmed", func() bool { return h.st.confirmed() == 2008 })
}

func TestExactlyOnceStop(t *testing.T) {
	t.Run("a clean stop commits the open Kafka transaction", func(t *testing.T) {
		p := &fakeProducer{}
		h := startSession(t, func(c *Config) { c.TxnMaxInterval = time.Hour; c.Router.TransactionTimeout = 3 * time.Hour }, p, &resumePoint{})
		h.st.send(data(1900, beginMsg(2000)), data(1910, insertMsg(outboxOID, "e1")))
		waitFor(t, "the event sent", func() bool { return len(p.sent()) == 1 })
		h.cancel()
		if err := h.end(t); err != nil {
			t.Fatalf("stop returned %v", err)
		}
		c := p.checkpoints()
		if len(c) != 1 || c[0].Partial == nil || c[0].Partial.Events != 1 {
			t.Fatalf("checkpoints %+v, want one covering the event sent", c)
		}
	})
	t.Run("a failed session aborts it", func(t *testing.T) {
		p := &fakeProducer{}
		h := startSession(t, func(c *Config) { c.TxnMaxInterval = time.Hour; c.Router.TransactionTimeout = 3 * time.Hour }, p, &resumePoint{})
		h.st.send(data(1900, beginMsg(2000)), data(1910, insertMsg(outboxOID, "e1")))
		waitFor(t, "the event sent", func() bool { return len(p.sent()) == 1 })
		h.r.onProduceError(errors.New("refused"))
		if err := h.end(t); causeOf(err) != "kafka" {
			t.Fatalf("session ended with %v", err)
		}
		if p.aborts != 1 || len(p.checkpoints()) != 0 {
			t.Fatalf("%d aborts and checkpoints %v, want one abort, no commit", p.aborts, p.checkpoints())
		}
	})
}

// A fenced exactly-once session asks, before its replication connection
// closes, whether its walsender still holds the slot: when another one does
// (it lost the slot without noticing) it ends to restart as a standby
// (cause "fenced"); when its own does, another slot's relay uses the same
// transactional id and it stops (fatal, still ErrFenced: exit code 3);
// when the check fails it restarts, which is safe (slot before id).
func TestExactlyOnceFenced(t *testing.T) {
	for _, tc := range []struct {
		name     string
		holds    bool
		checkErr error
		fatal    bool
	}{
		{"slot lost: restart as a standby", false, nil, false},
		{"slot held: the id is used elsewhere", true, nil, true},
		{"slot check failed: restart", false, errors.New("connection refused"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &fakeProducer{commitErr: fmt.Errorf("commit: %w", router.ErrFenced)}
			var asked atomic.Uint32
			var closedFirst atomic.Bool
			h := startSessionWith(t, nil, p, &resumePoint{}, func(r *Relay, s *session) {
				s.walsender = 4242
				st := s.stream.(*fakeStream)
				r.guard.slotHolder = func(_ context.Context, pid uint32) (bool, error) {
					asked.Store(pid)
					st.mu.Lock()
					closedFirst.Store(st.closed)
					st.mu.Unlock()
					return tc.holds, tc.checkErr
				}
			})
			h.st.send(txnMsgs(2000, "e1")...)
			err := h.end(t)
			if !errors.Is(err, router.ErrFenced) {
				t.Fatalf("session ended with %v, want fenced", err)
			}
			if got := isFatal(err); got != tc.fatal {
				t.Errorf("fatal = %v, want %v: %v", got, tc.fatal, err)
			}
			if !tc.fatal && causeOf(err) != "fenced" {
				t.Errorf("restart cause %q, want fenced", causeOf(err))
			}
			if tc.fatal && !strings.Contains(err.Error(), "relay.Config.Router.TransactionalID") {
				t.Errorf("the fatal error does not name the fix: %v", err)
			}
			if got := asked.Load(); got != 4242 {
				t.Errorf("the slot check was asked about walsender %d, want 4242", got)
			}
			if closedFirst.Load() {
				t.Error("the replication connection was closed before the slot check: the relay's own walsender could no longer be seen")
			}
		})
	}
}

func TestExactlyOnceRefusesAForeignCheckpoint(t *testing.T) {
	r, err := New(validConfig(), zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	resume := resumePoint{found: true, ckpt: checkpoint.Durable{Slot: "walrelay", SystemID: "1", LSN: 10}}
	sys := slotSystem("2", 100)
	if err := r.verifyCheckpoint(ctx, resume, sys); !isFatal(err) {
		t.Fatalf("a checkpoint of another system gave %v, want fatal", err)
	}
	resume.ckpt.SystemID = ""
	if err := r.verifyCheckpoint(ctx, resume, sys); err != nil {
		t.Fatalf("a legacy checkpoint gave %v, want accepted", err)
	}
}

// TestExactlyOnceChecksACheckpointAheadOfTheStreamAgain: the stream's
// IDENTIFY_SYSTEM answered before START_REPLICATION took the slot, and a
// relay that held the slot until then may have committed checkpoints of
// WAL written since: a checkpoint ahead of that answer is checked against
// the position read again, refused (fatal) only when still ahead of it;
// when the position cannot be read, or the server changed meanwhile, the
// session ends without refusing (the next one starts over).
func TestExactlyOnceChecksACheckpointAheadOfTheStreamAgain(t *testing.T) {
	r, err := New(validConfig(), zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	opened := slotSystem("1", 100)
	var now pglogrepl.IdentifySystemResult
	var nowErr error
	asked := 0
	r.identify = func(context.Context) (pglogrepl.IdentifySystemResult, error) {
		asked++
		return now, nowErr
	}
	for _, tc := range []struct {
		name    string
		ckpt    checkpoint.Durable
		now     pglogrepl.IdentifySystemResult
		nowErr  error
		asks    int
		refused bool // fatal
		ended   bool // an error, not fatal
	}{
		{"behind the stream's position", checkpoint.Durable{LSN: 90}, slotSystem("1", 90), nil, 0, false, false},
		{"ahead of it, behind the server now", checkpoint.Durable{LSN: 150}, slotSystem("1", 200), nil, 1, false, false},
		{"partial ahead of it, behind the server now", checkpoint.Durable{LSN: 90, Partial: &checkpoint.Partial{CommitLSN: 150, Events: 1}}, slotSystem("1", 200), nil, 1, false, false},
		{"ahead of the server now", checkpoint.Durable{LSN: 250}, slotSystem("1", 200), nil, 1, true, false},
		{"position unreadable", checkpoint.Durable{LSN: 150}, pglogrepl.IdentifySystemResult{}, errors.New("connection refused"), 1, false, true},
		{"another system now", checkpoint.Durable{LSN: 150}, slotSystem("3", 200), nil, 1, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.ckpt.Slot, tc.ckpt.SystemID = "walrelay", "1"
			now, nowErr, asked = tc.now, tc.nowErr, 0
			err := r.verifyCheckpoint(ctx, resumePoint{found: true, ckpt: tc.ckpt}, opened)
			switch {
			case tc.refused && !isFatal(err):
				t.Fatalf("gave %v, want refused (fatal)", err)
			case tc.ended && (err == nil || isFatal(err)):
				t.Fatalf("gave %v, want the session ended without a refusal", err)
			case !tc.refused && !tc.ended && err != nil:
				t.Fatalf("gave %v, want accepted", err)
			}
			if asked != tc.asks {
				t.Errorf("read the server's position %d times, want %d", asked, tc.asks)
			}
		})
	}
}

func slotSystem(id string, walEnd decoder.LSN) pglogrepl.IdentifySystemResult {
	return pglogrepl.IdentifySystemResult{SystemID: id, XLogPos: walEnd}
}

// answeringRelay is a relay whose status interval the answeringServer
// tests can wait out.
func answeringRelay(t *testing.T) *Relay {
	t.Helper()
	cfg := validConfig()
	cfg.StatusInterval, cfg.ConfirmDelay = 10*time.Millisecond, time.Millisecond
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestAnsweringServerReadsAheadWhileKafkaIsSlow(t *testing.T) {
	// Exactly-once takes the transactional id and reads the checkpoint with
	// the slot held: the walsender must keep hearing from the relay
	// meanwhile (or it drops it after wal_sender_timeout), and the stream
	// is read ahead, to be handed to the session in order.
	r := answeringRelay(t)
	st := newFakeStream()
	big := data(1990, insertMsg(outboxOID, strings.Repeat("b", prefetchChunkBytes))) // packed apart from the small ones
	sent := append(txnMsgs(2000, "e1"), big, keepalive(2100, true))
	st.send(sent...)
	rs, err := r.answeringServer(st, start, r.cfg.StatusInterval, func() error {
		// Slow Kafka: returns once the stream was read and the server
		// heard from us twice.
		waitFor(t, "the stream read and status updates sent", func() bool { return len(st.msgs) == 0 && len(st.updates()) >= 2 })
		return errors.New("kafka answered")
	})
	if err == nil || err.Error() != "kafka answered" {
		t.Fatalf("answeringServer returned %v, want f's error", err)
	}
	for _, u := range st.updates() {
		if u.lsn != start {
			t.Fatalf("status update %+v, want the start position %d", u, start)
		}
	}
	for i, want := range sent {
		m, err := rs.Receive(time.Now())
		if err != nil || m.Kind != want.Kind || m.WALStart != want.WALStart || string(m.Data) != string(want.Data) {
			t.Fatalf("message %d read ahead: %+v, %v; want %+v", i, m, err, want)
		}
	}
	// Then the stream itself (the read-ahead's Interrupt may still be
	// pending: it only makes one Receive return early).
	st.send(keepalive(2200, false))
	waitFor(t, "the stream read through", func() bool {
		m, err := rs.Receive(time.Now().Add(time.Second))
		return err == nil && m.ServerWALEnd == 2200
	})
}

func TestAnsweringServerBoundsWhatItHolds(t *testing.T) {
	// The read-ahead is an exactly-once drain's peak of memory: its bound
	// counts what it allocates (blocks of messages, chunks of data), not
	// only the messages' data, which is a fraction of it for small rows.
	defer func(was int) { prefetchMaxBytes = was }(prefetchMaxBytes)
	prefetchMaxBytes = prefetchChunkBytes + prefetchBlockMessages*messageBytes + 1
	const want = prefetchBlockMessages + 1 // the first message of a second block reaches the bound
	r := answeringRelay(t)
	st := newFakeStream()
	st.msgs = make(chan slot.Message, 2000)
	var sent []slot.Message
	for i := range cap(st.msgs) {
		sent = append(sent, data(uint64(1000+i), insertMsg(outboxOID, fmt.Sprintf("id-%d", i))))
	}
	st.send(sent...)
	rs, err := r.answeringServer(st, start, r.cfg.StatusInterval, func() error {
		waitFor(t, "the read-ahead to take its share", func() bool { return len(st.msgs) <= len(sent)-want })
		n := len(st.updates())
		waitFor(t, "two status updates after it", func() bool { return len(st.updates()) >= n+2 })
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if queued := rs.queued(); queued != want {
		t.Errorf("read ahead %d messages, want %d: the bound of %d bytes must count the blocks and chunks held", queued, want, prefetchMaxBytes)
	}
	for i, w := range sent {
		m, err := rs.Receive(time.Now().Add(time.Second))
		if err != nil || m.WALStart != w.WALStart || !bytes.Equal(m.Data, w.Data) {
			t.Fatalf("message %d: %+v, %v; want %+v", i, m, err, w)
		}
	}
}
