package decoder

// bench_test.go: allocation guarantees and benchmarks of the hot path.

import (
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
)

// benchPayload is a 200-byte JSON document.
var benchPayload = `{"orderId":"6f1c2a9e-1b7d-4f3a-9c61-2d8e5b0a7c44","customer":{"id":98231,"tier":"gold"},"lines":[{"sku":"A-1002","qty":2},{"sku":"B-77","qty":1}],"total":"149.90","currency":"EUR","note":"` +
	strings.Repeat("x", 200-190) + `"}`

func benchInsert() []byte {
	return insertMsg(outboxOID, text(uuidText), text("order"), text("98231"), text("OrderCreated"), text(benchPayload))
}

func TestBenchPayloadSize(t *testing.T) {
	if len(benchPayload) != 200 {
		t.Fatalf("payload is %d bytes", len(benchPayload))
	}
}

func TestAllocs(t *testing.T) {
	uuid := make([]byte, 16)
	binRow := insertMsg(outboxOID, binval(uuid), binval([]byte("order")), binval([]byte{0, 0, 0, 0, 0, 0, 0, 1}), null(), binval([]byte("\x01{}")))
	for _, tc := range []struct {
		name string
		data []byte
		want float64
	}{
		{"outbox insert", benchInsert(), 1},
		// A row of a table whose payload column was dropped: one event too.
		{"unmappable insert", insertMsg(outboxOID+1, text(uuidText), text("order"), text("98231"), text("OrderCreated")), 1},
		{"unmapped insert", insertMsg(otherOID, text("1"), text("9.99")), 0},
		{"update", updateMsg(outboxOID, text(uuidText), text(uuidText), text("a"), text("1"), null(), text("{}")), 0},
		{"delete", deleteMsg(outboxOID, text(uuidText)), 0},
		{"origin", originMsg(1, "node"), 0},
		{"logical message", logicalMsg(true, 1, "walrelay", []byte("x")), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := ready(t)
			decode(t, d, relationMsg(outboxOID+1, "public", "outbox",
				slices.DeleteFunc(outboxCols(), func(c relCol) bool { return c.Name == "payload" })...), KindRelation)
			if got := testing.AllocsPerRun(1000, func() { _, _ = d.Decode(tc.data) }); got != tc.want {
				t.Fatalf("%v allocs per Decode, want %v", got, tc.want)
			}
		})
	}
	t.Run("binary insert", func(t *testing.T) {
		d := newDecoder(t, withBinary)
		decode(t, d, relationMsg(outboxOID, "public", "outbox",
			col("id", oidUUID), col("aggregate_type", oidText), col("aggregate_id", oidInt8), col("type", oidText), col("payload", oidJSONB)), KindRelation)
		decode(t, d, beginMsg(1, 1, 1), KindBegin)
		decode(t, d, binRow, KindInsert)
		if got := testing.AllocsPerRun(1000, func() { _, _ = d.Decode(binRow) }); got != 1 {
			t.Fatalf("%v allocs per Decode, want 1", got)
		}
	})
	t.Run("naming an unmapped insert", func(t *testing.T) {
		d := ready(t)
		data := insertMsg(otherOID, text("1"), text("9.99"))
		var tab Table
		if got := testing.AllocsPerRun(1000, func() { _, _ = d.Decode(data); tab, _ = d.Unmapped() }); got != 0 {
			t.Fatalf("%v allocs per Decode and Unmapped, want 0", got)
		}
		if tab.String() != "public.orders" {
			t.Fatalf("Unmapped() = %v", tab)
		}
	})
	t.Run("begin and commit", func(t *testing.T) {
		d := newDecoder(t)
		b, c := beginMsg(1, 1, 1), commitMsg(0, 1, 2, 1)
		if got := testing.AllocsPerRun(1000, func() { _, _ = d.Decode(b); _, _ = d.Decode(c) }); got != 0 {
			t.Fatalf("%v allocs per Begin+Commit, want 0", got)
		}
	})
}

func BenchmarkDecodeInsert(b *testing.B) {
	d := ready(b)
	data := benchInsert()
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := d.Decode(data); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeIgnoredInsert(b *testing.B) {
	d := ready(b)
	data := insertMsg(otherOID, text("98231"), text("149.90"))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := d.Decode(data); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeBeginCommit(b *testing.B) {
	d := newDecoder(b)
	begin, commit := beginMsg(0x16B3748, 1_000_000, 7), commitMsg(0, 0x16B3748, 0x16B3778, 1_000_000)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := d.Decode(begin); err != nil {
			b.Fatal(err)
		}
		if _, err := d.Decode(commit); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPglogreplInsert is the yardstick: the same message through
// pglogrepl's parser, which allocates per column (a TupleDataColumn and a
// copy of its bytes each); the package comment says why it is not used.
func BenchmarkPglogreplInsert(b *testing.B) {
	data := benchInsert()
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := pglogrepl.Parse(data); err != nil {
			b.Fatal(err)
		}
	}
}
