package decoder

import (
	"slices"
	"strings"
	"testing"
)

func withLimit(n int) func(*Config) { return func(c *Config) { c.MaxValueBytes = n } }

// A value over MaxValueBytes is not copied: the event keeps its other
// values (the id above all, for the dead letter) and says how much was
// left out; the one allocation holds only what was kept.
func TestValueOverLimitNotCopied(t *testing.T) {
	d := ready(t, withLimit(100))
	big := `"` + strings.Repeat("x", 1000) + `"`
	data := insertMsg(outboxOID, text(uuidText), text("order"), text("42"), text("OrderCreated"), text(big))
	decode(t, d, data, KindInsert)
	e := d.Event()
	if want := []string{uuidText, "order", "42", "OrderCreated", "<NULL>"}; !slices.Equal(vals(e), want) {
		t.Fatalf("event = %q, want %q", vals(e), want)
	}
	if e.Omitted != len(big) {
		t.Fatalf("Omitted = %d, want %d", e.Omitted, len(big))
	}
	if got := testing.AllocsPerRun(100, func() { _, _ = d.Decode(data) }); got != 1 {
		t.Fatalf("%v allocs per Decode, want 1", got)
	}

	// A value at the limit is copied, and the next event starts clean.
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("42"), null(), text(strings.Repeat("y", 100))), KindInsert)
	if e.Omitted != 0 || len(e.Payload) != 100 {
		t.Fatalf("event at the limit: omitted %d, payload %d bytes", e.Omitted, len(e.Payload))
	}
}

// A bytea value is measured decoded: 2n hex digits are n bytes.
func TestByteaLimitDecodedSize(t *testing.T) {
	d := newDecoder(t, withLimit(4))
	decode(t, d, relationMsg(outboxOID, "public", "outbox", col("id", oidText), col("aggregate_type", oidText),
		col("aggregate_id", oidText), col("type", oidText), col("payload", oidBytea)), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	decode(t, d, insertMsg(outboxOID, text("1"), text("a"), text("k"), null(), text(`\x01020304`)), KindInsert)
	if e := d.Event(); e.Omitted != 0 || len(e.Payload) != 4 {
		t.Fatalf("4-byte bytea: omitted %d, payload %x", e.Omitted, e.Payload)
	}
	decode(t, d, insertMsg(outboxOID, text("2"), text("a"), text("k"), null(), text(`\x0102030405`)), KindInsert)
	if e := d.Event(); e.Omitted != 5 || e.Payload != nil || string(e.ID) != "2" {
		t.Fatalf("5-byte bytea: omitted %d, payload %x, id %q", e.Omitted, e.Payload, e.ID)
	}
}

// A value the stream reader left out (kind 'o') makes an oversize event
// whatever the limit; an omitted column that is not mapped changes nothing.
func TestOmittedColumn(t *testing.T) {
	d := ready(t)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("42"), null(), omitted(150_000_000)), KindInsert)
	e := d.Event()
	if want := []string{uuidText, "order", "42", "<NULL>", "<NULL>"}; !slices.Equal(vals(e), want) || e.Omitted != 150_000_000 {
		t.Fatalf("event = %q omitted %d", vals(e), e.Omitted)
	}

	d = newDecoder(t)
	decode(t, d, relationMsg(outboxOID, "public", "outbox", append(outboxCols(), col("blob", oidText))...), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("42"), null(), text("{}"), omitted(1<<30)), KindInsert)
	if e := d.Event(); e.Omitted != 0 || string(e.Payload) != "{}" {
		t.Fatalf("unmapped omitted column: omitted %d payload %q", e.Omitted, e.Payload)
	}

	// A truncated or negative omitted length is malformed.
	full := insertMsg(outboxOID, text(uuidText), text("o"), text("1"), null(), text("{}"), omitted(1))
	_ = decodeErr(t, d, full[:len(full)-2], ErrMalformed)
	neg := slices.Clone(full)
	copy(neg[len(neg)-4:], []byte{0xff, 0xff, 0xff, 0xfe})
	_ = decodeErr(t, d, neg, ErrMalformed)
}
