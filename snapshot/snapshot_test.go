package snapshot

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walrelay/walrelay/decoder"
)

// TestFillKeepsNullAndEmptyApart: NULL becomes nil and an empty value a
// non-nil empty slice, as the decoder makes them (the router turns nil into
// a tombstone or a dead letter, and empty into an empty value); each value
// is capped at its length and owned by the event, not by the fetch buffer.
func TestFillKeepsNullAndEmptyApart(t *testing.T) {
	p := &plan{}
	p.ev.Headers = make([]decoder.Header, 1)
	p.cols = []column{{dst: &p.ev.ID}, {dst: &p.ev.AggregateType}, {dst: &p.ev.Payload}, {dst: &p.ev.Headers[0].Value}}
	row := [][]byte{[]byte("7"), nil, []byte{}, []byte("h")}
	p.fill(row)
	row[0][0] = 'X' // the fetch buffer is reused for the next row
	if string(p.ev.ID) != "7" {
		t.Errorf("id %q changed with the fetch buffer", p.ev.ID)
	}
	if p.ev.AggregateType != nil {
		t.Errorf("NULL became %q, want nil", p.ev.AggregateType)
	}
	if p.ev.Payload == nil || len(p.ev.Payload) != 0 {
		t.Errorf("empty value became %#v, want a non-nil empty slice", p.ev.Payload)
	}
	if cap(p.ev.ID) != 1 || string(p.ev.Headers[0].Value) != "h" {
		t.Errorf("id cap %d (want 1), header %q", cap(p.ev.ID), p.ev.Headers[0].Value)
	}
}

// TestQueryErrorMarksWhatRetryingCannotFix: SQLSTATE class 42 (a bad
// condition, a missing column or privilege) is ErrQuery with the fix named;
// anything else (a broken connection) is not.
func TestQueryErrorMarksWhatRetryingCannotFix(t *testing.T) {
	tab := &decoder.Table{Schema: "public", Name: "outbox"}
	for _, code := range []string{"42601", "42703", "42501", "42P01"} {
		err := queryError(tab, fmt.Errorf("declare: %w", &pgconn.PgError{Code: code, Message: "boom"}))
		if !errors.Is(err, ErrQuery) {
			t.Errorf("SQLSTATE %s: %v is not ErrQuery", code, err)
		}
	}
	if err := queryError(tab, &pgconn.PgError{Code: "57P01", Message: "terminating connection"}); errors.Is(err, ErrQuery) {
		t.Errorf("a terminated connection is ErrQuery: %v", err)
	}
}
