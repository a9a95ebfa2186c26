package slot

import (
	"errors"
	"net"
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
