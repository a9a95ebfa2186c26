package decoder

// value_test.go: value decoding per type and format, and the ownership rules
// of event buffers.

import (
	"bytes"
	"errors"
	"strconv"
	"strings"
	"testing"
)

// payloadOf decodes a row whose payload column has type typ and value v, and
// returns the decoded payload.
func payloadOf(t *testing.T, binary bool, typ uint32, v val) ([]byte, error) {
	t.Helper()
	var opts []func(*Config)
	if binary {
		opts = append(opts, withBinary)
	}
	d := newDecoder(t, opts...)
	decode(t, d, relationMsg(outboxOID, "public", "outbox",
		col("id", oidText), col("aggregate_type", oidText), col("aggregate_id", oidText), col("type", oidText), col("payload", typ)), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	k, err := d.Decode(insertMsg(outboxOID, text("1"), text("a"), text("1"), null(), v))
	if err != nil {
		return nil, err
	}
	if k != KindInsert {
		t.Fatalf("kind %v", k)
	}
	// A value that cannot be decoded makes the row an invalid event, not
	// a stream error.
	if err := d.Event().Undecodable; err != nil {
		if d.Event().Payload != nil {
			t.Errorf("undecodable payload is %q, want nil", d.Event().Payload)
		}
		return nil, err
	}
	return d.Event().Payload, nil
}

// valueCase is one value and what it must decode to: want, or nil for NULL,
// or an error wrapping err.
type valueCase struct {
	name string
	typ  uint32
	v    val
	want []byte
	err  error
}

func runValueCases(t *testing.T, binary bool, cases []valueCase) {
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := payloadOf(t, binary, tc.typ, tc.v)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("error = %v, want %v", err, tc.err)
				}
				if !strings.Contains(err.Error(), `"payload"`) {
					t.Errorf("error %q does not name the column", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if (got == nil) != (tc.want == nil) || !bytes.Equal(got, tc.want) {
				t.Fatalf("payload = %q (nil %v), want %q (nil %v)", got, got == nil, tc.want, tc.want == nil)
			}
		})
	}
}

func TestTextValues(t *testing.T) {
	runValueCases(t, false, []valueCase{
		{"NULL", oidText, null(), nil, nil},
		{"empty text is not NULL", oidText, text(""), []byte{}, nil},
		{"text", oidText, text("héllo ✓"), []byte("héllo ✓"), nil},
		{"varchar", oidVarchar, text("abc"), []byte("abc"), nil},
		{"json kept byte for byte", oidJSON, text(`{ "a" : 1,"a":2 }`), []byte(`{ "a" : 1,"a":2 }`), nil},
		{"jsonb", oidJSONB, text(`{"a": 1}`), []byte(`{"a": 1}`), nil},
		{"uuid", oidUUID, text(uuidText), []byte(uuidText), nil},
		{"int8", oidInt8, text("-9223372036854775808"), []byte("-9223372036854775808"), nil},
		{"timestamptz", 1184, text("2025-01-01 00:00:00+00"), []byte("2025-01-01 00:00:00+00"), nil},
		{"bytea", oidBytea, text(`\x48656c6c6f`), []byte("Hello"), nil},
		{"bytea mixed case", oidBytea, text(`\xDEADbeef00`), []byte{0xde, 0xad, 0xbe, 0xef, 0}, nil},
		{"bytea empty", oidBytea, text(`\x`), []byte{}, nil},
		{"bytea NULL", oidBytea, null(), nil, nil},
		{"bytea without prefix", oidBytea, text("48656c"), nil, ErrMalformed},
		{"bytea escape format", oidBytea, text(`\110i`), nil, ErrMalformed},
		{"bytea backslash only", oidBytea, text(`\`), nil, ErrMalformed},
		{"bytea empty string", oidBytea, text(""), nil, ErrMalformed},
		{"bytea odd digits", oidBytea, text(`\x486`), nil, ErrMalformed},
		{"bytea bad digit", oidBytea, text(`\x4g`), nil, ErrMalformed},
		{"bytea bad digit late", oidBytea, text(`\x0000:0`), nil, ErrMalformed},
	})
}

func TestBinaryValues(t *testing.T) {
	uuid := []byte{0x0b, 0x3c, 0x8f, 0x6e, 0x4a, 0x51, 0x4c, 0x2e, 0x9d, 0x7a, 0x1f, 0x2e, 0x3d, 0x4c, 0x5b, 0x6a}
	runValueCases(t, true, []valueCase{
		{"NULL", oidBytea, null(), nil, nil},
		{"text value in binary mode", oidText, text("t"), []byte("t"), nil},
		{"bytea", oidBytea, binval([]byte{0, 1, 0xff}), []byte{0, 1, 0xff}, nil},
		{"bytea empty", oidBytea, binval(nil), []byte{}, nil},
		{"text", oidText, binval([]byte("héllo")), []byte("héllo"), nil},
		{"varchar", oidVarchar, binval([]byte("v")), []byte("v"), nil},
		{"bpchar", oidBpchar, binval([]byte("c  ")), []byte("c  "), nil},
		{"name", oidName, binval([]byte("n")), []byte("n"), nil},
		{"json", oidJSON, binval([]byte(`{"a":1}`)), []byte(`{"a":1}`), nil},
		{"jsonb", oidJSONB, binval([]byte("\x01{\"a\": 1}")), []byte(`{"a": 1}`), nil},
		{"jsonb version only", oidJSONB, binval([]byte{1}), []byte{}, nil},
		{"jsonb empty", oidJSONB, binval(nil), nil, ErrMalformed},
		{"jsonb version 2", oidJSONB, binval([]byte("\x02{}")), nil, ErrUnsupported},
		{"uuid", oidUUID, binval(uuid), []byte(uuidText), nil},
		{"uuid all ones", oidUUID, binval(bytes.Repeat([]byte{0xff}, 16)), []byte("ffffffff-ffff-ffff-ffff-ffffffffffff"), nil},
		{"uuid short", oidUUID, binval(uuid[:15]), nil, ErrMalformed},
		{"uuid long", oidUUID, binval(append(uuid, 0)), nil, ErrMalformed},
		{"int2 min", oidInt2, binval([]byte{0x80, 0}), []byte("-32768"), nil},
		{"int2 max", oidInt2, binval([]byte{0x7f, 0xff}), []byte("32767"), nil},
		{"int2 zero", oidInt2, binval([]byte{0, 0}), []byte("0"), nil},
		{"int2 short", oidInt2, binval([]byte{0}), nil, ErrMalformed},
		{"int4 min", oidInt4, binval([]byte{0x80, 0, 0, 0}), []byte("-2147483648"), nil},
		{"int4 42", oidInt4, binval([]byte{0, 0, 0, 42}), []byte("42"), nil},
		{"int4 -1", oidInt4, binval([]byte{0xff, 0xff, 0xff, 0xff}), []byte("-1"), nil},
		{"int4 as 8 bytes", oidInt4, binval(make([]byte, 8)), nil, ErrMalformed},
		{"int8 min", oidInt8, binval([]byte{0x80, 0, 0, 0, 0, 0, 0, 0}), []byte("-9223372036854775808"), nil},
		{"int8 max", oidInt8, binval([]byte{0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}), []byte("9223372036854775807"), nil},
		{"int8 1e18", oidInt8, binval([]byte{0x0d, 0xe0, 0xb6, 0xb3, 0xa7, 0x64, 0, 0}), []byte("1000000000000000000"), nil},
		{"int8 short", oidInt8, binval(make([]byte, 4)), nil, ErrMalformed},
		{"timestamptz", 1184, binval(make([]byte, 8)), nil, ErrUnsupported},
		{"numeric", 1700, binval([]byte{0, 0}), nil, ErrUnsupported},
	})
}

func TestUnsupportedBinaryNamesType(t *testing.T) {
	_, err := payloadOf(t, true, 1184, binval(make([]byte, 8)))
	if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "1184") || !strings.Contains(err.Error(), "payload") {
		t.Fatalf("error %v does not wrap ErrUnsupported naming column and type OID", err)
	}
}

// TestBinaryRendersMatchesDecoding: BinaryRenders, which setup checks the
// mapped columns with, names exactly the types whose binary values the
// decoder renders.
func TestBinaryRendersMatchesDecoding(t *testing.T) {
	for typ := uint32(0); typ < 10000; typ++ {
		_, err := binaryLen(typ, make([]byte, 16))
		if renders := !errors.Is(err, errBinaryType); renders != BinaryRenders(typ) {
			t.Errorf("type OID %d: BinaryRenders %v, but binaryLen says %v", typ, BinaryRenders(typ), err)
		}
	}
}

// TestUndecodableRowKeepsOtherFields: a row with a value the decoder
// cannot render is an invalid event whose other fields identify it, and
// the rows after it decode as usual.
func TestUndecodableRowKeepsOtherFields(t *testing.T) {
	d := newDecoder(t, withBinary)
	decode(t, d, relationMsg(outboxOID, "public", "outbox",
		col("id", oidText), col("aggregate_type", oidText), col("aggregate_id", 1009), col("type", oidText), col("payload", oidText)), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	decode(t, d, insertMsg(outboxOID, text("1"), text("a"), binval([]byte{0, 0, 0, 1}), null(), binval([]byte("p"))), KindInsert)
	e := d.Event()
	if !errors.Is(e.Undecodable, ErrUnsupported) || !strings.Contains(e.Undecodable.Error(), "1009") || !strings.Contains(e.Undecodable.Error(), `"aggregate_id"`) {
		t.Fatalf("Undecodable = %v, want ErrUnsupported naming aggregate_id and type OID 1009", e.Undecodable)
	}
	if string(e.ID) != "1" || string(e.Payload) != "p" || e.AggregateID != nil {
		t.Fatalf("event = %q, want id and payload kept, aggregate id nil", vals(e))
	}
	decode(t, d, insertMsg(outboxOID, text("2"), text("a"), text("{x}"), null(), binval([]byte("q"))), KindInsert)
	if e := d.Event(); e.Undecodable != nil || string(e.AggregateID) != "{x}" {
		t.Fatalf("next row: Undecodable %v, aggregate id %q", e.Undecodable, e.AggregateID)
	}
}

func TestDecimalLen(t *testing.T) {
	for _, i := range []int64{0, 1, 9, 10, 99, 100, -1, -9, -10, 1<<63 - 1, -1 << 63, 123456789} {
		var buf [24]byte
		want := len(strconv.AppendInt(buf[:0], i, 10))
		if got := decimalLen(i); got != want {
			t.Errorf("decimalLen(%d) = %d, want %d", i, got, want)
		}
	}
}

// TestAllBinaryRow decodes a row whose every mapped column is binary.
func TestAllBinaryRow(t *testing.T) {
	d := newDecoder(t, withBinary)
	decode(t, d, relationMsg(outboxOID, "public", "outbox",
		col("id", oidInt8), col("aggregate_type", oidName), col("aggregate_id", oidUUID), col("type", oidBpchar), col("payload", oidBytea)), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	u := []byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
	decode(t, d, insertMsg(outboxOID, binval([]byte{0, 0, 0, 0, 0, 0, 1, 0}), binval([]byte("order")), binval(u), binval([]byte("T")), binval([]byte{0xca, 0xfe})), KindInsert)
	want := []string{"256", "order", "00010203-0405-0607-0809-0a0b0c0d0e0f", "T", "\xca\xfe"}
	got := vals(d.Event())
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("event = %q, want %q", got, want)
		}
	}
}

// TestEventOwnership checks the buffer rules of Event: values survive the
// caller's buffer reuse and later Decodes, NULL is nil, empty is non-nil,
// and appending to one value does not overwrite the next.
func TestEventOwnership(t *testing.T) {
	d := ready(t)
	data := insertMsg(outboxOID, text(uuidText), text(""), text("42"), null(), text(`{"a":1}`))
	decode(t, d, data, KindInsert)
	e := d.Event()
	id, aggType, aggID, typ, payload := e.ID, e.AggregateType, e.AggregateID, e.Type, e.Payload
	if aggType == nil || len(aggType) != 0 {
		t.Fatalf("empty aggregate_type = %#v, want non-nil empty", aggType)
	}
	if typ != nil {
		t.Fatalf("NULL type = %#v, want nil", typ)
	}

	for i := range data {
		data[i] = 0xAA // the caller reuses its buffer
	}
	decode(t, d, insertMsg(outboxOID, text("other"), text("x"), text("y"), text("z"), text("w")), KindInsert)
	if string(id) != uuidText || string(aggID) != "42" || string(payload) != `{"a":1}` {
		t.Fatalf("values changed: %q %q %q", id, aggID, payload)
	}

	id = append(id, "-suffix"...)
	aggID = append(aggID, '!')
	if string(id) != uuidText+"-suffix" || string(payload) != `{"a":1}` || string(aggID) != "42!" {
		t.Fatalf("append overwrote a neighbour: id %q aggregate id %q payload %q", id, aggID, payload)
	}
}

// TestAllNullRow has nothing to allocate: every value is NULL.
func TestAllNullRow(t *testing.T) {
	d := ready(t)
	decode(t, d, insertMsg(outboxOID, null(), null(), null(), null(), null()), KindInsert)
	e := d.Event()
	if e.ID != nil || e.AggregateType != nil || e.AggregateID != nil || e.Type != nil || e.Payload != nil {
		t.Fatalf("event = %+v, want all nil", e)
	}
	decode(t, d, insertMsg(outboxOID, text(""), text(""), text(""), text(""), text("")), KindInsert)
	if e.ID == nil || e.AggregateType == nil || e.AggregateID == nil || e.Type == nil || e.Payload == nil {
		t.Fatalf("event = %+v, want all non-nil", e)
	}
}
