package relay

// connection_test.go: how a session keeps, and loses, its replication
// connection while it waits for Kafka (fakes of session_test.go).

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/decoder"
)

// statusFailing is a fake stream whose status updates fail once fail is
// set, as on a connection the server ended.
type statusFailing struct {
	*fakeStream
	fail atomic.Bool
}

var errBrokenPipe = errors.New("write tcp: broken pipe")

func (f *statusFailing) SendStatus(lsn decoder.LSN, reply bool) error {
	if f.fail.Load() {
		return errBrokenPipe
	}
	return f.fakeStream.SendStatus(lsn, reply)
}

// slowCommit is a fake Kafka transaction whose commits wait for release.
type slowCommit struct {
	*fakeProducer
	committing chan struct{} // closed when a commit began
	release    chan struct{}
	once       sync.Once
}

// finish lets the commit return.
func (c *slowCommit) finish() { c.once.Do(func() { close(c.release) }) }

func (c *slowCommit) Commit(ctx context.Context, key, value []byte) error {
	close(c.committing)
	<-c.release
	return c.fakeProducer.Commit(ctx, key, value)
}

// TestSessionEndsWhenAStatusUpdateCannotBeSent: while the relay waits for
// Kafka nothing reads the stream, so a connection the server ended
// (wal_sender_timeout, a terminated walsender) shows first as a status
// update that cannot be sent: the session ends then (waiting for room),
// or once the Kafka commit it waits for returned (a commit is never
// abandoned half-way), with one warning however many updates failed, as a
// restart of cause "connection"; the relay no longer says it streams.
func TestSessionEndsWhenAStatusUpdateCannotBeSent(t *testing.T) {
	for _, eos := range []bool{false, true} {
		t.Run(map[bool]string{false: "waiting for room", true: "waiting for a Kafka commit"}[eos], func(t *testing.T) {
			core, logs := observer.New(zapcore.DebugLevel)
			p := &fakeProducer{}
			var resume *resumePoint
			room := make(chan struct{})
			defer close(room)
			slow := &slowCommit{fakeProducer: p, committing: make(chan struct{}), release: make(chan struct{})}
			defer slow.finish() // before the session's cleanup waits for it
			if eos {
				resume = &resumePoint{}
			} else {
				p.room = room // Kafka has no room: the session waits
			}
			var st *statusFailing
			h := startSessionWith(t, nil, p, resume, func(r *Relay, s *session) {
				r.log = zap.New(core)
				st = &statusFailing{fakeStream: s.stream.(*fakeStream)}
				s.stream = st
				if eos {
					s.d.(*exactlyOnce).txn = slow
				}
			})
			h.st.send(txnMsgs(2000, "e1")...)
			if eos {
				<-slow.committing
			}
			waitFor(t, "a status update while waiting for Kafka", func() bool { return len(h.st.updates()) >= 2 })
			if !h.r.Streaming() {
				t.Fatal("not streaming while the connection works")
			}
			st.fail.Store(true)
			if eos {
				waitFor(t, "two failed updates during the commit", func() bool {
					return logs.FilterMessageSnippet("standby status update failed").Len() >= 2
				})
				select {
				case err := <-h.done:
					t.Fatalf("the session ended during its Kafka commit: %v", err)
				default:
				}
				slow.finish()
			}
			err := h.end(t)
			if !errors.Is(err, errBrokenPipe) || causeOf(err) != CauseConnection {
				t.Fatalf("session ended with %v (cause %s), want the failed update, cause connection", err, causeOf(err))
			}
			if n := logs.FilterMessageSnippet("the replication connection broke").FilterLevelExact(zapcore.WarnLevel).Len(); n != 1 {
				t.Errorf("%d warnings that the connection broke, want 1: %v", n, logs.All())
			}
			if h.r.Streaming() {
				t.Error("still streaming after the connection broke")
			}
		})
	}
}

// TestStatusEveryKeepsTheWalsenderContent: a stream gets a status update at
// least every StatusInterval, and every third of the server's
// wal_sender_timeout when that is shorter (the server ends a client silent
// that long, and a relay waiting for Kafka answers none of its requests),
// which is logged; never more often than every millisecond.
func TestStatusEveryKeepsTheWalsenderContent(t *testing.T) {
	cfg := validConfig()
	cfg.StatusInterval = 10 * time.Second
	r, logs, _ := observedRelay(t, cfg)
	for _, tc := range []struct {
		senderTimeout, want time.Duration
	}{
		{0, 10 * time.Second}, // the server never ends a silent client
		{60 * time.Second, 10 * time.Second},
		{9 * time.Second, 3 * time.Second},
		{time.Microsecond, time.Millisecond},
	} {
		logs.TakeAll()
		if got := r.statusEvery(tc.senderTimeout); got != tc.want {
			t.Errorf("wal_sender_timeout %s: an update every %s, want %s", tc.senderTimeout, got, tc.want)
		}
		said := logs.FilterMessageSnippet("status updates more often than relay.Config.StatusInterval").Len() == 1
		if shorter := tc.want < cfg.StatusInterval; said != shorter {
			t.Errorf("wal_sender_timeout %s: logged the shorter interval %v, want %v", tc.senderTimeout, said, shorter)
		}
	}
}
