package decoder

// fuzz_test.go: FuzzDecode feeds sequences of messages to one Decoder, so
// that Relation, Begin and Insert combinations are explored together.
//
// Input framing: a 2-byte big-endian length, then that many bytes of message
// (fewer if the input ends), repeated. The seed corpus in
// testdata/fuzz/FuzzDecode is generated from fuzzSeeds; regenerate it with
//
//	go test ./decoder -run TestFuzzSeeds -update-seeds
//
// and keep crashers the fuzzer finds there as regression seeds.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

var updateSeeds = flag.Bool("update-seeds", false, "rewrite the generated seeds in testdata/fuzz/FuzzDecode")

// frames joins messages with the fuzz input framing.
func frames(msgs ...[]byte) []byte {
	var out []byte
	for _, m := range msgs {
		out = binary.BigEndian.AppendUint16(out, uint16(len(m)))
		out = append(out, m...)
	}
	return out
}

// unframe splits fuzz input into messages.
func unframe(in []byte) [][]byte {
	var msgs [][]byte
	for len(in) > 0 {
		if len(in) < 2 {
			msgs = append(msgs, in)
			break
		}
		n := min(int(binary.BigEndian.Uint16(in)), len(in)-2)
		msgs = append(msgs, in[2:2+n])
		in = in[2+n:]
	}
	return msgs
}

// fuzzConfig is the configuration FuzzDecode decodes with: two outbox tables
// and a header, so that both table lookup and header mapping are explored.
func fuzzConfig(binary bool) Config {
	m := DefaultMapping()
	m.Headers = []HeaderColumn{{Column: "trace_id", Header: "traceparent"}}
	return Config{
		Tables:  []Table{{"public", "outbox"}, {"billing", "outbox"}},
		Mapping: m,
		Binary:  binary,
		// One variant also leaves out values over a small limit.
		MaxValueBytes: map[bool]int{false: fuzzValueLimit}[binary],
	}
}

// fuzzValueLimit is MaxValueBytes of the text-format fuzz decoder.
const fuzzValueLimit = 40

// fuzzSeeds are realistic message sequences, by seed file name.
func fuzzSeeds() map[string][]byte {
	uuid := []byte{0x0b, 0x3c, 0x8f, 0x6e, 0x4a, 0x51, 0x4c, 0x2e, 0x9d, 0x7a, 0x1f, 0x2e, 0x3d, 0x4c, 0x5b, 0x6a}
	cols := append(outboxCols(), col("trace_id", oidText))
	rel := relationMsg(outboxOID, "public", "outbox", cols...)
	begin := beginMsg(0x16B3748, 794_000_000_000_000, 731)
	commit := commitMsg(0, 0x16B3748, 0x16B3778, 794_000_000_000_000)
	row := func(payload val) []byte {
		return insertMsg(outboxOID, text(uuidText), text("order"), text("42"), text("OrderCreated"), payload, text("00-4bf92f3577b34da6-01"))
	}
	byteaRel := relationMsg(outboxOID, "public", "outbox",
		col("id", oidInt8), col("aggregate_type", oidVarchar), col("aggregate_id", oidText), col("type", oidText), col("payload", oidBytea), col("trace_id", oidText))
	binRel := relationMsg(outboxOID, "public", "outbox",
		col("id", oidUUID), col("aggregate_type", oidName), col("aggregate_id", oidInt8), col("type", oidInt2), col("payload", oidJSONB), col("trace_id", oidInt4))
	return map[string][]byte{
		"seed-transaction": frames(rel, begin, row(text(`{"orderId":42,"total":"9.90"}`)), commit),
		"seed-bytea": frames(byteaRel, begin,
			insertMsg(outboxOID, text("1001"), text("invoice"), text("7"), null(), text(`\x0a0b48656c6c6fff`), null()),
			insertMsg(outboxOID, text("1002"), text("invoice"), text("8"), text(""), text(`\x`), text("t")), commit),
		"seed-binary": frames(binRel, begin,
			insertMsg(outboxOID, binval(uuid), binval([]byte("order")), binval([]byte{0, 0, 0, 0, 0, 0, 0, 42}), binval([]byte{0xff, 0xfe}), binval([]byte("\x01{\"a\": [1, 2]}")), binval([]byte{0x80, 0, 0, 0})),
			insertMsg(outboxOID, binval(uuid), text("order"), null(), null(), null(), null()), commit),
		"seed-ignored": frames(
			relationMsg(otherOID, "public", "orders", col("id", oidInt8), col("total", 1700)),
			logicalMsg(false, 0x16B3700, "walrelay", []byte("heartbeat")),
			begin, originMsg(0x5000, "node_a"), typeMsg(16400, "public", "mood"),
			insertMsg(otherOID, text("1"), text("9.90")),
			updateMsg(otherOID, text("1"), text("1"), text("19.90")),
			deleteMsg(otherOID, text("1")),
			truncateMsg(otherOID),
			logicalMsg(true, 0x16B3740, "walrelay", nil), commit),
		"seed-relation-change": frames(rel, begin, row(null()),
			relationMsg(outboxOID, "public", "outbox", append(cols, col("created_at", 1184))...),
			insertMsg(outboxOID, text(uuidText), text("order"), text("42"), null(), text("{}"), null(), text("2025-01-01 00:00:00+00")),
			relationMsg(outboxOID, "public", "outbox", col("payload", oidJSON), col("trace_id", oidText), col("id", oidText), col("aggregate_id", oidText), col("aggregate_type", oidText), col("type", oidText)),
			insertMsg(outboxOID, text("[]"), null(), text("x"), text("1"), text("a"), text("")), commit),
		"seed-two-tables": frames(rel, relationMsg(outboxOID+1, "billing", "outbox", cols...), begin,
			row(text("{}")), insertMsg(outboxOID+1, text(uuidText), text("invoice"), text("1"), null(), text(`"s"`), null()), commit,
			beginMsg(0x16B3800, 794_000_000_000_001, 732), row(text("{}")), commitMsg(0, 0x16B3800, 0x16B3830, 794_000_000_000_001)),
		"seed-omitted": frames(rel, begin, row(omitted(150_000_000)),
			insertMsg(outboxOID, text(uuidText), text("order"), text(strings.Repeat("k", 40)), omitted(3), text("{}"), omitted(1<<20)), commit),
		// ALTER TABLE outbox DROP COLUMN payload, a row, ADD COLUMN payload.
		"seed-missing-column": frames(
			relationMsg(outboxOID, "public", "outbox", slices.DeleteFunc(slices.Clone(cols), func(c relCol) bool { return c.Name == "payload" })...),
			begin, insertMsg(outboxOID, text(uuidText), text("order"), text("42"), text("OrderCreated"), null()),
			rel, row(text("{}")), commit),
	}
}

// TestFuzzSeeds keeps testdata/fuzz/FuzzDecode in step with fuzzSeeds.
func TestFuzzSeeds(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzDecode")
	for name, in := range fuzzSeeds() {
		file := filepath.Join(dir, name)
		content := []byte("go test fuzz v1\n[]byte(" + strconv.Quote(string(in)) + ")\n")
		if *updateSeeds {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(file, content, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(file)
		if err != nil || !bytes.Equal(got, content) {
			t.Errorf("%s is missing or stale (err %v): run go test ./decoder -run TestFuzzSeeds -update-seeds", file, err)
		}
	}
}

// TestFuzzSeedsDecode checks that the seeds are valid streams, so the
// fuzzer starts from the interesting paths and not from early errors.
func TestFuzzSeedsDecode(t *testing.T) {
	for name, in := range fuzzSeeds() {
		d, err := New(fuzzConfig(true))
		if err != nil {
			t.Fatal(err)
		}
		inserts, unmappable := 0, 0
		for i, m := range unframe(in) {
			k, err := d.Decode(m)
			if err != nil {
				t.Fatalf("%s: message %d: %v", name, i, err)
			}
			if k == KindInsert {
				inserts++
				if un := d.Event().Unmappable; un != nil {
					if !errors.Is(un, ErrMissingColumn) {
						t.Fatalf("%s: message %d: Unmappable = %v", name, i, un)
					}
					unmappable++
				}
			}
		}
		// seed-missing-column has one row of a relation without payload.
		if want := map[bool]int{true: 1}[name == "seed-missing-column"]; unmappable != want {
			t.Errorf("%s: %d unmappable events, want %d", name, unmappable, want)
		}
		if inserts == 0 && name != "seed-ignored" {
			t.Errorf("%s decodes no insert", name)
		}
	}
}

func FuzzDecode(f *testing.F) {
	f.Fuzz(func(t *testing.T, in []byte) {
		msgs := unframe(in)
		for _, binary := range []bool{true, false} {
			d, err := New(fuzzConfig(binary))
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range msgs {
				k, err := d.Decode(m)
				if err != nil {
					if k != KindIgnored {
						t.Fatalf("kind %v with error %v", k, err)
					}
					if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnsupported) &&
						!errors.Is(err, ErrUnknownRelation) {
						t.Fatalf("error wraps no sentinel: %v", err)
					}
					continue
				}
				if k == KindInsert {
					checkEvent(t, d, m)
				}
			}
		}
	})
}

// checkEvent asserts what must hold for any event decoded from message m.
func checkEvent(t *testing.T, d *Decoder, m []byte) {
	e := d.Event()
	if e.Table == nil || (*e.Table != Table{"public", "outbox"} && *e.Table != Table{"billing", "outbox"}) {
		t.Fatalf("event table %v", e.Table)
	}
	// The mapped header, and the optional tracestate column (the mapped
	// header replaces the traceparent column).
	if len(e.Headers) != 2 || e.Headers[0].Key != "traceparent" || e.Headers[1].Key != "tracestate" {
		t.Fatalf("event headers %+v", e.Headers)
	}
	if e.Xid != d.Begin().Xid || !e.CommitTime.Equal(d.Begin().CommitTime) {
		t.Fatalf("event xid %d time %v, begin %+v", e.Xid, e.CommitTime, d.Begin())
	}
	if e.Unmappable != nil && !errors.Is(e.Unmappable, ErrMissingColumn) {
		t.Fatalf("event Unmappable %v does not wrap ErrMissingColumn", e.Unmappable)
	}
	total := 0
	for _, v := range [][]byte{e.ID, e.AggregateType, e.AggregateID, e.Type, e.Payload, e.Headers[0].Value} {
		if !d.binary && len(v) > fuzzValueLimit {
			t.Fatalf("value of %d bytes copied over the limit %d", len(v), fuzzValueLimit)
		}
		if e.Omitted < 0 {
			t.Fatalf("omitted %d", e.Omitted)
		}
		if len(v) != cap(v) {
			t.Fatalf("value %q has spare capacity %d", v, cap(v)-len(v))
		}
		total += len(v)
	}
	// No value is longer than twice its encoding (binary uuid and integers
	// grow, everything else shrinks or stays), and the columns are distinct.
	if total > 2*len(m) {
		t.Fatalf("values total %d bytes from a %d-byte message", total, len(m))
	}
}
