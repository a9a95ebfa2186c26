package slot

import (
	"errors"
	"net"
	"testing"
	"time"

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
