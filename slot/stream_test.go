package slot

import (
	"errors"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// TestInterruptBeforeReceive interrupts a stream before Receive arms its
// own (far) deadline, as a stop or a produce failure can while the session
// is between two Receives: Receive must still return ErrInterrupted at
// once, not when its deadline passes.
func TestInterruptBeforeReceive(t *testing.T) {
	client, server := net.Pipe()
	defer server.Close()
	defer client.Close()
	s := &Stream{fe: pgproto3.NewFrontend(client, client), net: client}

	s.Interrupt()
	done := make(chan error, 1)
	go func() {
		_, err := s.Receive(time.Now().Add(time.Hour))
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, ErrInterrupted) {
			t.Fatalf("Receive after Interrupt: %v, want ErrInterrupted", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Receive after Interrupt still blocked after 5s: the interrupt was overwritten by Receive's deadline")
	}

	// The interrupt is consumed: the next Receive waits for its deadline.
	if _, err := s.Receive(time.Now().Add(10 * time.Millisecond)); !errors.Is(err, ErrTimeout) {
		t.Fatalf("Receive after the interrupt was reported: %v, want ErrTimeout", err)
	}
}

// timedOutConn is a connection the kernel ended for its TCP_USER_TIMEOUT:
// its reads and writes fail with ETIMEDOUT.
type timedOutConn struct{ net.Conn }

func (timedOutConn) Read([]byte) (int, error) {
	return 0, &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ETIMEDOUT)}
}
func (timedOutConn) SetReadDeadline(time.Time) error { return nil }

// A connection the kernel ended because the server acknowledged nothing
// for the stream's AckTimeout is a *SenderTimeoutError naming
// wal_sender_timeout, not a read deadline that passed (ETIMEDOUT says
// Timeout() too), nor a bare error; without an AckTimeout set, ETIMEDOUT
// is the kernel's own verdict (its retransmissions or keepalives ran
// out), and still no deadline of Receive's.
func TestReceiveAfterAckTimeout(t *testing.T) {
	c := timedOutConn{}
	s := &Stream{fe: pgproto3.NewFrontend(c, c), net: c, SenderTimeout: 3 * time.Second, AckTimeout: 3 * time.Second}
	_, err := s.Receive(time.Now().Add(time.Hour))
	var te *SenderTimeoutError
	if !errors.As(err, &te) || te.Timeout != 3*time.Second || !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("Receive on a connection ended for its ack timeout: %v, want a *SenderTimeoutError of 3s wrapping ETIMEDOUT", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "wal_sender_timeout (3s)") || !strings.Contains(msg, "raise wal_sender_timeout") {
		t.Errorf("the error does not name wal_sender_timeout and the fix: %s", msg)
	}

	s = &Stream{fe: pgproto3.NewFrontend(c, c), net: c}
	_, err = s.Receive(time.Now().Add(time.Hour))
	if errors.As(err, &te) || errors.Is(err, ErrTimeout) || err == nil {
		t.Fatalf("Receive on a connection the kernel timed out, no ack timeout set: %v, want a broken stream", err)
	}
}

// Only a name walrelay chose carries the topics tag; the tag tells
// templates apart and fits application_name.
func TestTagApplicationName(t *testing.T) {
	cfg := &pgconn.Config{RuntimeParams: map[string]string{"application_name": "walrelay"}}
	tagApplicationName(cfg, "outbox.event.{aggregate_type}")
	got := cfg.RuntimeParams["application_name"]
	if got != topicsTagPrefix+topicsTag("outbox.event.{aggregate_type}") || len(got) > 63 {
		t.Errorf("application_name %q", got)
	}
	if topicsTag("a.{aggregate_type}") == topicsTag("b.{aggregate_type}") {
		t.Error("two templates with one tag")
	}
	mine := &pgconn.Config{RuntimeParams: map[string]string{"application_name": "orders-relay"}}
	tagApplicationName(mine, "outbox.event.{aggregate_type}")
	if mine.RuntimeParams["application_name"] != "orders-relay" {
		t.Errorf("an operator's application_name was replaced: %q", mine.RuntimeParams["application_name"])
	}
}

func TestParseSwitch(t *testing.T) {
	h := "1\t0/3000158\tno recovery target specified\n\n2\t0/5000000\tno recovery target specified\n"
	if l, err := parseSwitch(h, 2, 3); err != nil || l != 0x5000000 {
		t.Errorf("switch of timeline 2: %s, %v", l, err)
	}
	if l, err := parseSwitch(h, 1, 3); err != nil || l != 0x3000158 {
		t.Errorf("switch of timeline 1: %s, %v", l, err)
	}
	if _, err := parseSwitch(h, 4, 5); err == nil {
		t.Error("a timeline missing from the history gave a switch point")
	}
}
