package relay

import (
	"errors"
	"os"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// ackTimedOut is a fake stream whose status updates fail once fail is
// closed, as on a connection the kernel ended because the server
// acknowledged nothing for its wal_sender_timeout (slot.Stream.AckTimeout).
type ackTimedOut struct {
	*fakeStream
	fail chan struct{}
}

func (f *ackTimedOut) SendStatus(lsn decoder.LSN, reply bool) error {
	select {
	case <-f.fail:
		return &slot.SenderTimeoutError{Timeout: 3 * time.Second, Err: os.NewSyscallError("write", syscall.ETIMEDOUT)}
	default:
		return f.fakeStream.SendStatus(lsn, reply)
	}
}

// TestSessionEndsOnTheSenderTimeout: while the relay waits for Kafka, a
// status update that fails because the server acknowledged nothing for
// its wal_sender_timeout ends the session with one WARN that names
// wal_sender_timeout (the setting, its value) and not the generic broken
// connection, as a restart of cause "connection"; the relay no longer
// says it streams.
func TestSessionEndsOnTheSenderTimeout(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	p := &fakeProducer{}
	room := make(chan struct{})
	defer close(room)
	p.room = room // Kafka has no room: the session waits
	st := &ackTimedOut{fail: make(chan struct{})}
	h := startSessionWith(t, nil, p, nil, func(r *Relay, s *session) {
		r.log = zap.New(core)
		st.fakeStream = s.stream.(*fakeStream)
		s.stream = st
	})
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "a status update while waiting for Kafka", func() bool { return len(h.st.updates()) >= 2 })
	close(st.fail)
	err := h.end(t)
	var te *slot.SenderTimeoutError
	if !errors.As(err, &te) || causeOf(err) != CauseConnection {
		t.Fatalf("session ended with %v (cause %s), want the sender timeout, cause connection", err, causeOf(err))
	}
	warns := logs.FilterLevelExact(zapcore.WarnLevel)
	if n := warns.FilterMessageSnippet("wal_sender_timeout").FilterField(zap.Duration("wal_sender_timeout", 3*time.Second)).Len(); n != 1 || warns.Len() != 1 {
		t.Errorf("%d WARNs naming wal_sender_timeout among %d, want the one: %v", n, warns.Len(), warns.All())
	}
	if h.r.Streaming() {
		t.Error("still streaming after the server's timeout ended the connection")
	}
}
