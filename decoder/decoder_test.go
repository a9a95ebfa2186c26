package decoder

// decoder_test.go: message handling: transactions, ignored and unsupported
// messages, relation changes, configuration and protocol errors.

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

const (
	outboxOID = 16384
	otherOID  = 16390
	uuidText  = "0b3c8f6e-4a51-4c2e-9d7a-1f2e3d4c5b6a"
)

// newDecoder returns a Decoder for public.outbox with the default mapping,
// after applying opts to the config.
func newDecoder(t testing.TB, opts ...func(*Config)) *Decoder {
	t.Helper()
	cfg := Config{Tables: []Table{{Schema: "public", Name: "outbox"}}, Mapping: DefaultMapping()}
	// Without the optional trace columns, so that events list the values
	// a test maps; TestTraceColumns maps them.
	cfg.Mapping.TraceParent, cfg.Mapping.TraceState = "", ""
	for _, o := range opts {
		o(&cfg)
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return d
}

// withBinary enables binary values.
func withBinary(c *Config) { c.Binary = true }

// decode decodes data and fails the test unless it returns want.
func decode(t testing.TB, d *Decoder, data []byte, want Kind) {
	t.Helper()
	k, err := d.Decode(data)
	if err != nil {
		t.Fatalf("Decode(%q): %v", data, err)
	}
	if k != want {
		t.Fatalf("Decode(%q) = %v, want %v", data, k, want)
	}
}

// decodeErr decodes data and fails the test unless the error wraps want.
func decodeErr(t testing.TB, d *Decoder, data []byte, want error) error {
	t.Helper()
	k, err := d.Decode(data)
	if !errors.Is(err, want) {
		t.Fatalf("Decode(%q) error = %v, want %v", data, err, want)
	}
	if k != KindIgnored {
		t.Fatalf("Decode(%q) kind = %v with error, want Ignored", data, k)
	}
	return err
}

// ready returns a decoder that has seen the outbox relation and a Begin.
func ready(t testing.TB, opts ...func(*Config)) *Decoder {
	t.Helper()
	d := newDecoder(t, opts...)
	decode(t, d, relationMsg(outboxOID, "public", "outbox", outboxCols()...), KindRelation)
	decode(t, d, relationMsg(otherOID, "public", "orders", col("id", oidInt8), col("total", 1700)), KindRelation)
	decode(t, d, beginMsg(0x16B3748, 1_000_000, 7), KindBegin)
	return d
}

// vals renders an event's values as strings, "<NULL>" for nil, in the order
// id, aggregate_type, aggregate_id, type, payload, headers.
func vals(e *Event) []string {
	s := func(b []byte) string {
		if b == nil {
			return "<NULL>"
		}
		return string(b)
	}
	out := []string{s(e.ID), s(e.AggregateType), s(e.AggregateID), s(e.Type), s(e.Payload)}
	for _, h := range e.Headers {
		out = append(out, h.Key+"="+s(h.Value))
	}
	return out
}

func TestTransaction(t *testing.T) {
	d := ready(t)
	b := d.Begin()
	wantTime := time.Date(2000, 1, 1, 0, 0, 1, 0, time.UTC)
	if b.FinalLSN != 0x16B3748 || b.Xid != 7 || !b.CommitTime.Equal(wantTime) {
		t.Fatalf("Begin = %+v", b)
	}

	payload := `{"orderId":42,"lines":[1,2]}`
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("42"), text("OrderCreated"), text(payload)), KindInsert)
	e := d.Event()
	if e.Table == nil || *e.Table != (Table{"public", "outbox"}) || e.Table.String() != "public.outbox" {
		t.Fatalf("Event.Table = %v", e.Table)
	}
	if want := []string{uuidText, "order", "42", "OrderCreated", payload}; !slices.Equal(vals(e), want) {
		t.Fatalf("event = %q, want %q", vals(e), want)
	}
	if e.Xid != 7 || !e.CommitTime.Equal(wantTime) {
		t.Fatalf("event xid %d time %v", e.Xid, e.CommitTime)
	}

	decode(t, d, commitMsg(0, 0x16B3748, 0x16B3778, 1_000_000), KindCommit)
	c := d.Commit()
	if c.CommitLSN != 0x16B3748 || c.EndLSN != 0x16B3778 || c.Flags != 0 || !c.CommitTime.Equal(wantTime) {
		t.Fatalf("Commit = %+v", c)
	}

	// A second transaction gets its own commit time and xid.
	ts := time.Date(2025, 3, 14, 15, 9, 26, 535897000, time.UTC)
	us := ts.Sub(time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)).Microseconds()
	decode(t, d, beginMsg(0x2000000, us, 8), KindBegin)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("43"), null(), null()), KindInsert)
	if !e.CommitTime.Equal(ts) || e.Xid != 8 || e.Type != nil || e.Payload != nil {
		t.Fatalf("second event = %+v", e)
	}
	decode(t, d, commitMsg(0, 0x2000000, 0x2000030, us), KindCommit)
}

func TestPgTime(t *testing.T) {
	for _, tc := range []struct {
		us   int64
		want time.Time
	}{
		{0, time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)},
		{1, time.Date(2000, 1, 1, 0, 0, 0, 1000, time.UTC)},
		{-1, time.Date(1999, 12, 31, 23, 59, 59, 999999000, time.UTC)},
		{-1_500_000, time.Date(1999, 12, 31, 23, 59, 58, 500000000, time.UTC)},
	} {
		if got := PGTime(uint64(tc.us)); !got.Equal(tc.want) || got.Location() != time.UTC {
			t.Errorf("pgTime(%d) = %v, want %v", tc.us, got, tc.want)
		}
	}
}

func TestIgnoredMessages(t *testing.T) {
	for _, tc := range []struct {
		name string
		data []byte
	}{
		{"Update", updateMsg(outboxOID, text(uuidText), text(uuidText), text("a"), text("1"), null(), text("{}"))},
		{"Delete", deleteMsg(outboxOID, text(uuidText))},
		{"Truncate", truncateMsg(outboxOID, otherOID)},
		{"Origin", originMsg(0x1000, "node_a")},
		{"Type", typeMsg(16400, "public", "mood")},
		{"transactional M", logicalMsg(true, 0x1000, "walrelay", []byte("nudge"))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := ready(t)
			decode(t, d, tc.data, KindIgnored)
			// The transaction goes on.
			decode(t, d, insertMsg(outboxOID, text(uuidText), text("a"), text("1"), null(), text("{}")), KindInsert)
		})
	}
}

// TestNonTransactionalMessage: a heartbeat message from
// pg_logical_emit_message(false, …) is reported with its LSN, inside or
// outside a transaction, and leaves an open transaction going.
func TestNonTransactionalMessage(t *testing.T) {
	d := newDecoder(t)
	decode(t, d, logicalMsg(false, 0x1000, "walrelay.heartbeat", []byte("x")), KindMessage)
	if got := d.MessageLSN(); got != 0x1000 {
		t.Fatalf("MessageLSN = %v, want 0/1000", got)
	}
	d = ready(t)
	decode(t, d, logicalMsg(false, 0x2000, "", nil), KindMessage)
	if got := d.MessageLSN(); got != 0x2000 {
		t.Fatalf("MessageLSN = %v, want 0/2000", got)
	}
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("a"), text("1"), null(), text("{}")), KindInsert)
}

func TestUnsupported(t *testing.T) {
	for _, typ := range []byte{'S', 'E', 'c', 'A', 'b', 'P', 'K', 'r', 'p'} {
		err := decodeErr(t, newDecoder(t), []byte{typ, 0, 0, 0, 1}, ErrUnsupported)
		if typ == 'S' && !strings.Contains(err.Error(), "streaming is not requested") {
			t.Errorf("error %q does not say streaming is not requested", err)
		}
	}
}

// TestUnmappedInsert: an insert into another table of the publication is
// reported as KindUnmapped with the relation's name and OID, without
// decoding the row, and the transaction goes on.
func TestUnmappedInsert(t *testing.T) {
	d := ready(t)
	if tab, oid := d.Unmapped(); tab != (Table{}) || oid != 0 {
		t.Fatalf("Unmapped() before any unmapped insert = %v, %d", tab, oid)
	}
	decode(t, d, insertMsg(otherOID, text("1"), text("9.99")), KindUnmapped)
	if tab, oid := d.Unmapped(); tab != (Table{"public", "orders"}) || oid != otherOID {
		t.Fatalf("Unmapped() = %v, %d, want public.orders, %d", tab, oid, otherOID)
	}
	// A wrong column count is still an error: a Relation message was missed.
	_ = decodeErr(t, d, insertMsg(otherOID, text("1")), ErrMalformed)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("a"), text("1"), null(), text("{}")), KindInsert)
	// A partition published under its own name is a relation of its own.
	decode(t, d, relationMsg(otherOID+1, "public", "outbox_2026", outboxCols()...), KindRelation)
	decode(t, d, insertMsg(otherOID+1, text(uuidText), text("a"), text("1"), null(), text("{}")), KindUnmapped)
	if tab, _ := d.Unmapped(); tab.String() != "public.outbox_2026" {
		t.Fatalf("Unmapped() = %v, want public.outbox_2026", tab)
	}
	decode(t, d, commitMsg(0, 0x16B3748, 0x16B3778, 1_000_000), KindCommit)
}

func TestOtherTablesIgnored(t *testing.T) {
	d := newDecoder(t, func(c *Config) {
		c.Tables = append(c.Tables, Table{"billing", "outbox"})
	})
	decode(t, d, relationMsg(1, "public", "outbox", outboxCols()...), KindRelation)
	decode(t, d, relationMsg(2, "billing", "outbox", outboxCols()...), KindRelation)
	// Same name in another schema, another name in the right schema, and a
	// name that differs only in case: all other tables.
	decode(t, d, relationMsg(3, "audit", "outbox", outboxCols()...), KindRelation)
	decode(t, d, relationMsg(4, "public", "outbox_archive", outboxCols()...), KindRelation)
	decode(t, d, relationMsg(5, "public", "Outbox", outboxCols()...), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	row := []val{text(uuidText), text("a"), text("1"), null(), text("{}")}
	decode(t, d, insertMsg(1, row...), KindInsert)
	first := d.Event().Table
	decode(t, d, insertMsg(2, row...), KindInsert)
	if second := d.Event().Table; first.String() != "public.outbox" || second.String() != "billing.outbox" {
		t.Fatalf("tables %v, %v", first, second)
	}
	for oid := uint32(3); oid <= 5; oid++ {
		decode(t, d, insertMsg(oid, row...), KindUnmapped)
	}
	// The Table pointer is stable across events.
	decode(t, d, insertMsg(1, row...), KindInsert)
	if d.Event().Table != first {
		t.Fatal("Event.Table pointer changed")
	}
}

func TestUnknownRelation(t *testing.T) {
	d := ready(t)
	err := decodeErr(t, d, insertMsg(99999, text("x")), ErrUnknownRelation)
	if !strings.Contains(err.Error(), "99999") {
		t.Errorf("error %q does not name the OID", err)
	}
}

// TestMissingColumn: an outbox table that lacks a mapped column (dropped or
// renamed while the relay ran) does not stop the stream. Its Relation is
// cached, and each of its rows is an Insert marked Unmappable (wrapping
// ErrMissingColumn, naming the table and every missing column) with the
// columns the table still has filled in, so the router can dead-letter it
// with what identifies it. A corrected Relation heals it.
func TestMissingColumn(t *testing.T) {
	without := func(name string) []relCol {
		return slices.DeleteFunc(outboxCols(), func(c relCol) bool { return c.Name == name })
	}
	for _, tc := range []struct {
		name    string
		opts    func(*Config)
		cols    []relCol
		wantErr []string // substrings of Unmappable; nil for a mappable table
	}{
		{"payload", nil, without("payload"), []string{"public.outbox", `"payload"`}},
		{"id", nil, without("id"), []string{`"id"`}},
		{"aggregate_type", nil, without("aggregate_type"), []string{`"aggregate_type"`}},
		{"aggregate_id", nil, without("aggregate_id"), []string{`"aggregate_id"`}},
		{"configured type", nil, without("type"), []string{`"type"`}},
		{"type not configured", func(c *Config) { c.Mapping.Type = "" }, without("type"), nil},
		{"header column", func(c *Config) {
			c.Mapping.Headers = []HeaderColumn{{Column: "trace_id", Header: "traceparent"}}
		}, outboxCols(), []string{`"trace_id"`, "traceparent"}},
		{"debezium names", func(c *Config) {
			c.Mapping.AggregateType, c.Mapping.AggregateID = "aggregatetype", "aggregateid"
		}, outboxCols(), []string{`"aggregatetype"`, `"aggregateid"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var opts []func(*Config)
			if tc.opts != nil {
				opts = append(opts, tc.opts)
			}
			d := newDecoder(t, opts...)
			decode(t, d, relationMsg(outboxOID, "public", "outbox", tc.cols...), KindRelation)
			decode(t, d, beginMsg(1, 1, 7), KindBegin)
			row := make([]val, len(tc.cols))
			for i, c := range tc.cols {
				row[i] = text("v-" + c.Name)
			}
			decode(t, d, insertMsg(outboxOID, row...), KindInsert)
			ev := d.Event()
			if ev.Table == nil || *ev.Table != (Table{"public", "outbox"}) || ev.Xid != 7 {
				t.Fatalf("event table %v xid %d", ev.Table, ev.Xid)
			}
			if tc.wantErr == nil {
				if ev.Unmappable != nil {
					t.Fatalf("Unmappable = %v for a table with every mapped column", ev.Unmappable)
				}
				return
			}
			if !errors.Is(ev.Unmappable, ErrMissingColumn) {
				t.Fatalf("Unmappable = %v, want an error wrapping ErrMissingColumn", ev.Unmappable)
			}
			for _, s := range tc.wantErr {
				if !strings.Contains(ev.Unmappable.Error(), s) {
					t.Errorf("Unmappable %q does not contain %s", ev.Unmappable, s)
				}
			}
			// What the row still has identifies it; what it lacks is nil.
			has := func(name string) bool {
				return slices.ContainsFunc(tc.cols, func(c relCol) bool { return c.Name == name })
			}
			cfg := Config{Mapping: DefaultMapping()}
			for _, o := range opts {
				o(&cfg)
			}
			m := cfg.Mapping
			for _, f := range []struct {
				column string
				got    []byte
			}{{m.ID, ev.ID}, {m.AggregateID, ev.AggregateID}, {m.AggregateType, ev.AggregateType}, {m.Payload, ev.Payload}} {
				switch {
				case has(f.column) && string(f.got) != "v-"+f.column:
					t.Errorf("%s = %q, want %q", f.column, f.got, "v-"+f.column)
				case !has(f.column) && f.got != nil:
					t.Errorf("%s = %q, want nil: the table has no such column", f.column, f.got)
				}
			}
			// A corrected Relation heals it.
			healed := append(outboxCols(), col("trace_id", oidText), col("aggregatetype", oidText), col("aggregateid", oidText))
			decode(t, d, relationMsg(outboxOID, "public", "outbox", healed...), KindRelation)
			row = make([]val, len(healed))
			for i := range row {
				row[i] = text("x")
			}
			decode(t, d, insertMsg(outboxOID, row...), KindInsert)
			if d.Event().Unmappable != nil {
				t.Fatalf("Unmappable = %v after a corrected Relation", d.Event().Unmappable)
			}
		})
	}
}

func TestMissingColumnOfOtherTableIsFine(t *testing.T) {
	d := newDecoder(t)
	decode(t, d, relationMsg(otherOID, "public", "orders", col("id", oidInt8)), KindRelation)
}

func TestRelationResent(t *testing.T) {
	d := ready(t)
	row := func(extra ...val) []byte {
		return insertMsg(outboxOID, append([]val{text(uuidText), text("order"), text("1"), text("T"), text(`{"v":1}`)}, extra...)...)
	}
	decode(t, d, row(), KindInsert)
	want := []string{uuidText, "order", "1", "T", `{"v":1}`}
	if got := vals(d.Event()); !slices.Equal(got, want) {
		t.Fatalf("before: %q", got)
	}

	// ALTER TABLE outbox ADD COLUMN created_at timestamptz: the old column
	// count is now malformed, the new one decodes.
	added := append(outboxCols(), col("created_at", 1184))
	decode(t, d, relationMsg(outboxOID, "public", "outbox", added...), KindRelation)
	_ = decodeErr(t, d, row(), ErrMalformed)
	decode(t, d, row(text("2025-01-01 00:00:00+00")), KindInsert)
	if got := vals(d.Event()); !slices.Equal(got, want) {
		t.Fatalf("after ADD COLUMN: %q", got)
	}

	// ALTER TABLE outbox DROP COLUMN aggregate_type: every later column
	// shifts left, and the mapping follows it.
	dropped := []relCol{col("id", oidUUID), col("aggregate_id", oidText), col("type", oidVarchar), col("payload", oidJSONB), col("aggregate_type", oidText)}
	decode(t, d, relationMsg(outboxOID, "public", "outbox", dropped...), KindRelation)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("7"), text("T2"), text(`{"v":2}`), text("invoice")), KindInsert)
	want = []string{uuidText, "invoice", "7", "T2", `{"v":2}`}
	if got := vals(d.Event()); !slices.Equal(got, want) {
		t.Fatalf("after DROP COLUMN: %q", got)
	}

	// A column changes type (ALTER COLUMN payload TYPE bytea): values follow.
	retyped := []relCol{col("id", oidUUID), col("aggregate_id", oidText), col("type", oidVarchar), col("payload", oidBytea), col("aggregate_type", oidText)}
	decode(t, d, relationMsg(outboxOID, "public", "outbox", retyped...), KindRelation)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("7"), text("T2"), text(`\x4869`), text("invoice")), KindInsert)
	if got := string(d.Event().Payload); got != "Hi" {
		t.Fatalf("after retype payload = %q", got)
	}

	// The table is renamed away: its rows are no longer outbox rows.
	decode(t, d, relationMsg(outboxOID, "public", "outbox_old", retyped...), KindRelation)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("7"), text("T2"), text(`\x4869`), text("invoice")), KindUnmapped)
	if tab, _ := d.Unmapped(); tab.String() != "public.outbox_old" {
		t.Fatalf("after rename Unmapped() = %v, want public.outbox_old", tab)
	}
}

// TestWideRelation checks that the scratch space follows the widest outbox
// relation, including one announced after a narrower one.
func TestWideRelation(t *testing.T) {
	d := ready(t)
	cols := outboxCols()
	row := []val{text(uuidText), text("a"), text("1"), null(), text("{}")}
	for i := range 300 {
		cols = append(cols, col(fmt.Sprintf("c%d", i), oidText))
		row = append(row, text(fmt.Sprint(i)))
	}
	decode(t, d, relationMsg(outboxOID, "public", "outbox", cols...), KindRelation)
	decode(t, d, insertMsg(outboxOID, row...), KindInsert)
	if got := string(d.Event().Payload); got != "{}" {
		t.Fatalf("payload %q", got)
	}
}

func TestHeaders(t *testing.T) {
	d := newDecoder(t, func(c *Config) {
		c.Mapping.Headers = []HeaderColumn{
			{Column: "trace_id", Header: "traceparent"},
			{Column: "tenant", Header: "tenant"},
			{Column: "aggregate_type", Header: "x-aggregate"}, // a column may be mapped twice
		}
	})
	cols := append(outboxCols(), col("tenant", oidText), col("trace_id", oidText))
	decode(t, d, relationMsg(outboxOID, "public", "outbox", cols...), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("1"), text("T"), text("{}"), null(), text("00-abc-01")), KindInsert)
	want := []string{uuidText, "order", "1", "T", "{}", "traceparent=00-abc-01", "tenant=<NULL>", "x-aggregate=order"}
	if got := vals(d.Event()); !slices.Equal(got, want) {
		t.Fatalf("event = %q, want %q", got, want)
	}
}

func TestNew(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"default", Config{Tables: []Table{{"public", "outbox"}}, Mapping: DefaultMapping()}, true},
		{"no type", Config{Tables: []Table{{"public", "outbox"}}, Mapping: Mapping{ID: "id", AggregateType: "t", AggregateID: "k", Payload: "p"}}, true},
		{"no tables", Config{Mapping: DefaultMapping()}, false},
		{"no schema", Config{Tables: []Table{{"", "outbox"}}, Mapping: DefaultMapping()}, false},
		{"no name", Config{Tables: []Table{{"public", ""}}, Mapping: DefaultMapping()}, false},
		{"duplicate table", Config{Tables: []Table{{"public", "outbox"}, {"public", "outbox"}}, Mapping: DefaultMapping()}, false},
		{"no id", Config{Tables: []Table{{"public", "outbox"}}, Mapping: Mapping{AggregateType: "t", AggregateID: "k", Payload: "p"}}, false},
		{"no aggregate type", Config{Tables: []Table{{"public", "outbox"}}, Mapping: Mapping{ID: "id", AggregateID: "k", Payload: "p"}}, false},
		{"no aggregate id", Config{Tables: []Table{{"public", "outbox"}}, Mapping: Mapping{ID: "id", AggregateType: "t", Payload: "p"}}, false},
		{"no payload", Config{Tables: []Table{{"public", "outbox"}}, Mapping: Mapping{ID: "id", AggregateType: "t", AggregateID: "k"}}, false},
		{"header without column", Config{Tables: []Table{{"public", "outbox"}}, Mapping: Mapping{ID: "id", AggregateType: "t", AggregateID: "k", Payload: "p", Headers: []HeaderColumn{{Header: "h"}}}}, false},
		{"header without key", Config{Tables: []Table{{"public", "outbox"}}, Mapping: Mapping{ID: "id", AggregateType: "t", AggregateID: "k", Payload: "p", Headers: []HeaderColumn{{Column: "c"}}}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := New(tc.cfg)
			if (err == nil) != tc.ok {
				t.Fatalf("New: err = %v, want ok %v", err, tc.ok)
			}
			if err == nil && d == nil {
				t.Fatal("New returned nil, nil")
			}
		})
	}
}

func TestNewCopiesTables(t *testing.T) {
	tables := []Table{{"public", "outbox"}}
	d, err := New(Config{Tables: tables, Mapping: DefaultMapping()})
	if err != nil {
		t.Fatal(err)
	}
	tables[0].Name = "changed"
	decode(t, d, relationMsg(outboxOID, "public", "outbox", outboxCols()...), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("a"), text("1"), null(), text("{}")), KindInsert)
}

func TestKindString(t *testing.T) {
	for k, want := range map[Kind]string{KindIgnored: "Ignored", KindBegin: "Begin", KindInsert: "Insert", KindCommit: "Commit", KindRelation: "Relation", KindMessage: "Message", KindUnmapped: "Unmapped", 9: "Kind(9)"} {
		if got := k.String(); got != want {
			t.Errorf("Kind(%d).String() = %q, want %q", k, got, want)
		}
	}
}

// TestTraceColumns: the default mapping sends the trace context columns
// as the W3C headers when the table has them, sends nothing for a NULL,
// leaves a table without them mappable (not Unmappable, and not required
// by Columns), and gives way to a Headers entry sending the same header.
func TestTraceColumns(t *testing.T) {
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	withTrace := func(c *Config) { c.Mapping = DefaultMapping() }

	d := newDecoder(t, withTrace)
	decode(t, d, relationMsg(outboxOID, "public", "outbox", append(outboxCols(), col("traceparent", oidText), col("tracestate", oidText))...), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("1"), text("T"), text("{}"), text(tp), text("v=1")), KindInsert)
	if got, want := vals(d.Event()), []string{uuidText, "order", "1", "T", "{}", "traceparent=" + tp, "tracestate=v=1"}; !slices.Equal(got, want) {
		t.Fatalf("event = %q, want %q", got, want)
	}
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("1"), text("T"), text("{}"), null(), null()), KindInsert)
	if got, want := vals(d.Event()), []string{uuidText, "order", "1", "T", "{}", "traceparent=<NULL>", "tracestate=<NULL>"}; !slices.Equal(got, want) {
		t.Fatalf("NULL trace columns: event = %q, want %q", got, want)
	}

	// A table created before the trace columns.
	d = newDecoder(t, withTrace)
	decode(t, d, relationMsg(outboxOID, "public", "outbox", outboxCols()...), KindRelation)
	decode(t, d, beginMsg(1, 1, 1), KindBegin)
	decode(t, d, insertMsg(outboxOID, text(uuidText), text("order"), text("1"), text("T"), text("{}")), KindInsert)
	if e := d.Event(); e.Unmappable != nil || string(e.Payload) != "{}" || e.Headers[0].Value != nil || e.Headers[1].Value != nil {
		t.Fatalf("table without trace columns: unmappable %v, event %q", e.Unmappable, vals(e))
	}
	if cols := DefaultMapping().Columns(); slices.Contains(cols, "traceparent") || slices.Contains(cols, "tracestate") {
		t.Errorf("Columns() = %q requires the optional trace columns", cols)
	}

	// A configured header column sending traceparent replaces the column.
	m := DefaultMapping()
	m.Headers = []HeaderColumn{{Column: "trace_parent", Header: "traceparent"}}
	if got := m.HeaderColumns(); len(got) != 2 || got[0] != m.Headers[0] || got[1] != (HeaderColumn{Column: "tracestate", Header: "tracestate", Optional: true}) {
		t.Errorf("HeaderColumns() = %+v, want the configured traceparent column and the optional tracestate", got)
	}
}
