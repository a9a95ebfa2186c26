package decoder

// malformed_test.go: protocol violations must be errors wrapping
// ErrMalformed that say where, and no input may panic.

import (
	"strings"
	"testing"
)

func TestMalformed(t *testing.T) {
	row := []val{text(uuidText), text("a"), text("1"), null(), text("{}")}
	fresh := func(t *testing.T) *Decoder {
		d := newDecoder(t)
		decode(t, d, relationMsg(outboxOID, "public", "outbox", outboxCols()...), KindRelation)
		return d
	}
	inTxn := func(t *testing.T) *Decoder { return ready(t) }
	for _, tc := range []struct {
		name  string
		setup func(*testing.T) *Decoder
		data  []byte
		want  string // substring of the error
	}{
		{"empty", fresh, nil, "empty message"},
		{"unknown type", fresh, []byte("Zhello"), "unknown message type 0x5a"},
		{"insert outside transaction", fresh, insertMsg(outboxOID, row...), "outside a transaction"},
		{"insert after commit", func(t *testing.T) *Decoder {
			d := ready(t)
			decode(t, d, commitMsg(0, 1, 2, 3), KindCommit)
			return d
		}, insertMsg(outboxOID, row...), "outside a transaction"},
		{"begin inside transaction", inTxn, beginMsg(2, 2, 8), "inside xid 7"},
		{"commit without begin", fresh, commitMsg(0, 1, 2, 3), "Commit without Begin"},
		{"begin trailing byte", fresh, append(beginMsg(1, 1, 1), 0), "1 trailing bytes"},
		{"commit trailing byte", inTxn, append(commitMsg(0, 1, 2, 3), 0), "trailing"},
		{"relation trailing byte", fresh, append(relationMsg(1, "public", "outbox", outboxCols()...), 0), "trailing"},
		{"insert trailing byte", inTxn, append(insertMsg(outboxOID, row...), 0), "trailing"},
		{"origin trailing byte", fresh, append(originMsg(1, "a"), 0), "trailing"},
		{"type trailing byte", fresh, append(typeMsg(1, "a", "b"), 0), "trailing"},
		{"message trailing byte", fresh, append(logicalMsg(false, 1, "p", []byte("c")), 0), "trailing"},
		{"message negative length", fresh, start('M').U8(0).U64(1).Str("p").I32(-1), "negative length"},
		{"message content too long", fresh, start('M').U8(0).U64(1).Str("p").U32(10).Raw([]byte("abc")), "content at offset 16"},
		{"relation without NUL", fresh, start('R').U32(1).Raw([]byte("public")), "namespace at offset 5"},
		{"relation column count too high", fresh, start('R').U32(1).Str("public").Str("outbox").U8('d').U16(65535), "column 0 column flags"},
		{"too few columns", inTxn, insertMsg(outboxOID, row[:4]...), "4 columns, relation public.outbox has 5"},
		{"too many columns", inTxn, insertMsg(outboxOID, append(row, null())...), "6 columns"},
		{"other table, wrong column count", inTxn, insertMsg(otherOID, text("1")), "1 columns, relation public.orders has 2"},
		{"unchanged TOAST", inTxn, insertMsg(outboxOID, text(uuidText), text("a"), text("1"), null(), toast()), `"payload"`},
		{"unknown kind", inTxn, insertMsg(outboxOID, text(uuidText), val{Kind: 'x'}, text("1"), null(), text("{}")), "unknown kind 0x78"},
		{"negative length", inTxn, start('I').U32(outboxOID).U8('N').U16(5).U8('t').I32(-5), "negative length -5"},
		{"length past the end", inTxn, start('I').U32(outboxOID).U8('N').U16(5).U8('t').I32(0x7fffffff).Raw([]byte("abc")), `column value "id" of public.outbox at offset 13`},
		{"binary not requested", inTxn, insertMsg(outboxOID, binval(make([]byte, 16)), text("a"), text("1"), null(), text("{}")), "binary format was not requested"},
		{"bad tuple tag", inTxn, tuple(start('I').U32(outboxOID).U8('K'), row...), "want 'N'"},
		{"begin truncated", fresh, beginMsg(1, 1, 1)[:10], "commit time at offset 9"},
		{"commit truncated", inTxn, commitMsg(0, 1, 2, 3)[:15], "end LSN at offset 10"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := tc.setup(t)
			err := decodeErr(t, d, tc.data, ErrMalformed)
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not contain %q", err, tc.want)
			}
		})
	}
}

// TestMalformedKeepsState checks that a rejected message changes neither the
// transaction state nor Begin and Commit.
func TestMalformedKeepsState(t *testing.T) {
	d := ready(t)
	_ = decodeErr(t, d, beginMsg(2, 2, 8)[:19], ErrMalformed)
	_ = decodeErr(t, d, beginMsg(2, 2, 8), ErrMalformed)
	if d.Begin().Xid != 7 {
		t.Fatalf("Begin changed to %+v", d.Begin())
	}
	_ = decodeErr(t, d, commitMsg(0, 5, 6, 7)[:24], ErrMalformed)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("a"), text("1"), null(), text("{}")), KindInsert)
	decode(t, d, commitMsg(0, 5, 6, 7), KindCommit)
}

// TestTruncatedEverywhere cuts valid messages at every byte offset: each
// prefix must be an error wrapping ErrMalformed, never a panic or a success.
func TestTruncatedEverywhere(t *testing.T) {
	uuid := []byte{0x0b, 0x3c, 0x8f, 0x6e, 0x4a, 0x51, 0x4c, 0x2e, 0x9d, 0x7a, 0x1f, 0x2e, 0x3d, 0x4c, 0x5b, 0x6a}
	binRel := relationMsg(outboxOID, "public", "outbox",
		col("id", oidUUID), col("aggregate_type", oidText), col("aggregate_id", oidInt8), col("type", oidVarchar), col("payload", oidJSONB))
	binReady := func(t *testing.T) *Decoder {
		d := newDecoder(t, withBinary)
		decode(t, d, binRel, KindRelation)
		decode(t, d, beginMsg(1, 1, 1), KindBegin)
		return d
	}
	fresh := func(t *testing.T) *Decoder { return newDecoder(t) }
	inTxn := func(t *testing.T) *Decoder { return ready(t) }
	for _, tc := range []struct {
		name  string
		setup func(*testing.T) *Decoder
		data  []byte
		want  Kind
	}{
		{"Relation", fresh, relationMsg(outboxOID, "public", "outbox", outboxCols()...), KindRelation},
		{"Begin", fresh, beginMsg(0x16B3748, 1_000_000, 7), KindBegin},
		{"Commit", inTxn, commitMsg(0, 0x16B3748, 0x16B3778, 1_000_000), KindCommit},
		{"Insert", inTxn, insertMsg(outboxOID, text(uuidText), text("order"), text("42"), null(), text(`{"a":1}`)), KindInsert},
		{"Insert bytea", func(t *testing.T) *Decoder {
			d := ready(t)
			decode(t, d, relationMsg(outboxOID, "public", "outbox", col("id", oidText), col("aggregate_type", oidText), col("aggregate_id", oidText), col("type", oidText), col("payload", oidBytea)), KindRelation)
			return d
		}, insertMsg(outboxOID, text("1"), text("a"), text("1"), text(""), text(`\x0001ff`)), KindInsert},
		{"Insert binary", binReady, insertMsg(outboxOID, binval(uuid), binval([]byte("order")), binval([]byte{0, 0, 0, 0, 0, 0, 0, 42}), null(), binval([]byte("\x01{}"))), KindInsert},
		{"Origin", fresh, originMsg(0x1000, "node_a"), KindIgnored},
		{"Type", fresh, typeMsg(16400, "public", "mood"), KindIgnored},
		{"M", fresh, logicalMsg(true, 0x1000, "walrelay", []byte("nudge")), KindIgnored},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := tc.setup(t)
			for i := range len(tc.data) {
				_ = decodeErr(t, d, tc.data[:i], ErrMalformed)
			}
			decode(t, d, tc.data, tc.want)
		})
	}
}
