// Package decoder turns pgoutput logical replication messages into outbox
// events.
//
// The relay hands the pgoutput message of every XLogData message the slot
// package receives to Decoder.Decode. The decoder keeps the relation cache that pgoutput expects its client to keep,
// tracks the enclosing transaction, and reports one of a few kinds per message:
// Begin and Commit delimit a transaction, Insert carries one outbox row
// (Decoder.Event), Relation says the cache changed, Unmapped is an insert into
// a table the publication sends but no outbox table maps (Decoder.Unmapped
// names it), and everything else that carries nothing for the relay is
// Ignored.
//
// It speaks pgoutput protocol version 1 without streaming. It is pure (no I/O),
// never panics on any input, and allocates exactly one buffer per outbox row:
// the hot path of the relay decodes every outbox INSERT of the database, and
// the rows of other tables cost a map lookup and a column count check, and
// allocate nothing. pglogrepl's own tuple decoder is not used: it allocates
// per column (16 allocations for a five-column outbox row, against one here:
// BenchmarkPglogreplInsert) and indexes the message without checking
// lengths, so a truncated message panics instead of returning an error.
//
// A Decoder is not safe for concurrent use. Use one per replication
// connection: pgoutput announces every relation again on a new connection, so
// a reconnect should start with a new Decoder.
package decoder

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pglogrepl"
)

// LSN is a PostgreSQL log sequence number, the one position type of
// walrelay: the decoder is where stream positions are born, and every
// package that keeps or confirms one (checkpoint, slot, heartbeat, relay,
// router) uses this name. It is pglogrepl's type so that positions flow to
// standby status updates and pglogrepl.ParseLSN without conversion.
type LSN = pglogrepl.LSN

// Error is the type of the decoder's sentinel errors: it says how to treat
// the failure, as pgx's SafeToRetry and franz-go's Retriable do.
type Error struct {
	msg   string
	fatal bool
}

func (e *Error) Error() string { return e.msg }

// Fatal reports whether a new stream cannot help: the same WAL decodes
// the same way again (ErrUnsupported). The other decoder errors end the
// stream, and a new one may not meet them.
func (e *Error) Fatal() bool { return e.fatal }

// Sentinel errors. Decode wraps one of them with what went wrong and where;
// test with errors.Is.
var (
	// ErrMalformed means the message does not follow the pgoutput protocol
	// (truncated, bad lengths, trailing bytes, unknown message type, an
	// Insert outside a transaction). The stream cannot be trusted after it.
	// A mapped value that breaks its type's format inside a well-formed
	// Insert is not a stream error: Event.Undecodable wraps it.
	ErrMalformed error = &Error{msg: "malformed pgoutput message"}

	// ErrMissingColumn is what Event.Unmappable wraps: the row's outbox
	// table lacks a mapped column (dropped or renamed after the relay
	// started; the WAL keeps the old shape, so restarting cannot help). It
	// is not a stream error: the row is an invalid event, and the rows after
	// it decode as usual.
	ErrMissingColumn = errors.New("outbox table is missing a mapped column")

	// ErrUnknownRelation means an Insert named a relation OID that no Relation
	// message announced. pgoutput always announces a relation before its first
	// row on a connection, so this means a lost message or a reused Decoder.
	ErrUnknownRelation error = &Error{msg: "insert into a relation that was never announced"}

	// ErrUnsupported means the message uses a protocol feature the relay does
	// not request (streaming, two-phase), or (wrapped by Event.Undecodable,
	// not returned by Decode) a binary value of a type it cannot render as
	// text.
	ErrUnsupported error = &Error{msg: "unsupported pgoutput feature", fatal: true}
)

// Table names one outbox table.
type Table struct {
	// Schema is the namespace as the Relation message sends it ("public" for
	// the default schema).
	Schema string
	// Name is the table name, unquoted and case-sensitive as stored in
	// pg_class.
	Name string
}

// String returns "schema.name" for logs and Kafka headers.
func (t Table) String() string { return t.Schema + "." + t.Name }

// HeaderColumn maps an extra outbox column to a Kafka header.
type HeaderColumn struct {
	Column string // the outbox column
	Header string // the Kafka header key
	// Optional: a table without the column sends no header, as for a
	// NULL, instead of its rows being unmappable; setup does not require
	// it. The trace context columns are optional (Mapping.HeaderColumns).
	Optional bool
}

// Mapping names the outbox columns. The defaults follow the common outbox
// schema; Debezium users map AggregateType and AggregateID to
// "aggregatetype" and "aggregateid".
type Mapping struct {
	ID            string // required: becomes the id header consumers dedupe on
	AggregateType string // required: selects the topic
	AggregateID   string // required: the record key
	Type          string // optional: "" means no type header
	Payload       string // required: the record value

	// Headers are extra columns copied into headers, in this order.
	Headers []HeaderColumn

	// TraceParent and TraceState are the columns of the W3C trace context
	// the writer stored (outbox.Writer does), sent as the traceparent and
	// tracestate headers: what walrelay's producer span, and a consumer's
	// span after it, are parented on. Optional: a table without them, or
	// a NULL, sends no header. "" maps none; a Headers entry that sends a
	// header of that name replaces the column.
	TraceParent, TraceState string
}

// The W3C trace context headers (https://www.w3.org/TR/trace-context/).
const (
	HeaderTraceParent = "traceparent"
	HeaderTraceState  = "tracestate"
)

// DefaultMapping returns the mapping of the common outbox schema: id,
// aggregate_type, aggregate_id, type and payload, and the trace context
// columns traceparent and tracestate when the table has them.
func DefaultMapping() Mapping {
	return Mapping{
		ID:            "id",
		AggregateType: "aggregate_type",
		AggregateID:   "aggregate_id",
		Type:          "type",
		Payload:       "payload",
		TraceParent:   HeaderTraceParent,
		TraceState:    HeaderTraceState,
	}
}

// HeaderColumns lists the columns that become headers, in the order of
// Event.Headers: Headers, then the trace context columns (Optional), each
// unless a Headers entry sends its header already.
func (m Mapping) HeaderColumns() []HeaderColumn {
	hs := m.Headers
	for _, tc := range []HeaderColumn{{Column: m.TraceParent, Header: HeaderTraceParent}, {Column: m.TraceState, Header: HeaderTraceState}} {
		if tc.Column == "" || slices.ContainsFunc(m.Headers, func(h HeaderColumn) bool { return h.Header == tc.Header }) {
			continue
		}
		tc.Optional = true
		hs = append(slices.Clip(hs), tc)
	}
	return hs
}

// Columns lists the columns m requires: id, aggregate type, aggregate id,
// payload, the type column when set, then the header columns in order,
// less the optional ones. Setup checks each exists and, with a column
// list, is published.
func (m Mapping) Columns() []string {
	cols := []string{m.ID, m.AggregateType, m.AggregateID, m.Payload}
	if m.Type != "" {
		cols = append(cols, m.Type)
	}
	for _, h := range m.Headers {
		if !h.Optional {
			cols = append(cols, h.Column)
		}
	}
	return cols
}

// Config configures a Decoder.
type Config struct {
	// Tables are the outbox tables. Relations of other tables are cached only
	// so that their rows can be told apart, named (KindUnmapped) and not
	// decoded.
	Tables []Table

	// Mapping names the outbox columns; it applies to every table.
	Mapping Mapping

	// Binary tells the decoder whether values may come in binary format
	// (pgoutput's binary option). Text-format values are always accepted; a
	// binary value when Binary is false means the server and the relay
	// disagree about the stream and is reported as ErrMalformed.
	Binary bool

	// MaxValueBytes, when positive, is the largest mapped value copied
	// into an event: a larger one could never be produced (the relay sets
	// it to the record limit), so it is left nil and counted in
	// Event.Omitted instead of costing memory a second time. A value the
	// stream reader already left out (column kind OmittedKind, see
	// Event.Omitted) is treated the same way whatever this is.
	MaxValueBytes int
}

// Kind says what a decoded message was.
type Kind uint8

// Kinds of decoded messages.
const (
	// KindIgnored is a message that carries nothing for the relay: Update,
	// Delete, Truncate, Origin, Type or a transactional logical decoding
	// message ('M'). Decode also returns it with every error.
	KindIgnored Kind = iota
	// KindBegin starts a transaction: Decoder.Begin is valid.
	KindBegin
	// KindInsert is an outbox insert: Decoder.Event is valid.
	KindInsert
	// KindCommit ends a transaction: Decoder.Commit is valid, and its EndLSN
	// is the position to confirm once the transaction's records are acked.
	KindCommit
	// KindRelation means a relation (re)definition was cached.
	KindRelation
	// KindMessage is a non-transactional logical decoding message (from
	// pg_logical_emit_message(false, …), as walrelay's heartbeat sends):
	// Decoder.MessageLSN is its position. Everything before it in the
	// stream has been received, so it is a marker like a keepalive's.
	// Transactional messages are KindIgnored.
	KindMessage
	// KindUnmapped is an insert into a relation that is not a configured
	// outbox table: the publication sends rows nothing maps, such as
	// another table of a shared publication or a partition published
	// under its own name. Decoder.Unmapped names the relation; the row is
	// not decoded.
	KindUnmapped
)

// String returns the kind's name for logs.
func (k Kind) String() string {
	switch k {
	case KindIgnored:
		return "Ignored"
	case KindBegin:
		return "Begin"
	case KindInsert:
		return "Insert"
	case KindCommit:
		return "Commit"
	case KindRelation:
		return "Relation"
	case KindMessage:
		return "Message"
	case KindUnmapped:
		return "Unmapped"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Begin is a pgoutput Begin message.
type Begin struct {
	FinalLSN   LSN       // the LSN of the transaction's commit record
	CommitTime time.Time // when the transaction committed (UTC)
	Xid        uint32    // the transaction id
}

// Commit is a pgoutput Commit message.
type Commit struct {
	Flags     uint8 // unused by PostgreSQL so far (0)
	CommitLSN LSN   // the LSN of the commit record
	// EndLSN is the end of the commit record (pglogrepl's
	// TransactionEndLSN). Confirming it, and never a message's start LSN,
	// is what makes a resume start after this transaction and not inside it.
	EndLSN     LSN
	CommitTime time.Time // when the transaction committed (UTC)
}

// Header is one extra header of an event.
type Header struct {
	Key   string // the configured header key
	Value []byte // the column's value; nil for SQL NULL
}

// Event is one outbox row.
//
// Every []byte is nil when the column is SQL NULL and non-nil (possibly empty)
// otherwise. All byte slices point into one buffer allocated for this event
// alone, each capped at its own length: the caller owns them and may keep
// them after the next Decode without copying. The Event struct itself (and
// its Headers slice) is reused by the decoder: copy what you need before the
// next Decode.
type Event struct {
	Table         *Table   // the configured table this row belongs to (stable pointer)
	ID            []byte   // text form (a uuid as 36 chars, a bigint as digits)
	AggregateType []byte   // text form
	AggregateID   []byte   // text form
	Type          []byte   // nil also when Mapping.Type is ""
	Payload       []byte   // json/jsonb/text as is, bytea as raw bytes
	Headers       []Header // one per Mapping.HeaderColumns entry, in that order

	// Omitted is the size of the mapped values that were not copied
	// because each was over Config.MaxValueBytes, or was left out of the
	// message by the stream reader (column kind OmittedKind: its size in
	// the stream); those fields are nil. 0 when nothing was left out. Such an
	// event cannot be produced: it is dead-lettered as too large.
	Omitted int

	// CommitTime and Xid come from the enclosing Begin: the default Kafka
	// record timestamp is the commit time, shared by the whole transaction.
	CommitTime time.Time
	Xid        uint32

	// Unmappable is nil for a row that has every mapped column. It is set
	// (wrapping ErrMissingColumn and naming the missing columns) for a row
	// whose table, as its last Relation message described it, lacks one:
	// such a row cannot become a record and is an invalid event. The fields
	// of the columns the table still has are filled as usual (the id and
	// aggregate id identify it in a dead-letter record); the others are nil.
	Unmappable error

	// Undecodable is nil for a row whose mapped values all decoded. It is
	// set (wrapping ErrUnsupported or ErrMalformed, naming the column, its
	// type OID and format) for a row with a mapped value the decoder cannot
	// render: a binary value of a type it does not know (a column whose
	// type changed to, say, text[] after the startup check), or a value
	// that breaks its type's format. The message itself was well formed,
	// so the rows after it decode as usual, and the same WAL would fail
	// the same way after a restart: such a row is an invalid event, not a
	// stream error. That value's field is nil; the others are filled.
	Undecodable error
}

// field is one event value the mapping asks for: where it comes from and
// where it goes. The list is built once in New so that Insert decoding is a
// loop over it instead of a switch per value.
type field struct {
	role     string  // "id", "payload", or "header <key>": for error messages
	column   string  // the outbox column
	dst      *[]byte // the Event field (or header value) it fills
	optional bool    // a table may lack the column (HeaderColumn.Optional)
}

// Decoder decodes the pgoutput messages of one replication connection.
type Decoder struct {
	tables []Table // copy of Config.Tables; Event.Table points into it
	binary bool
	limit  int // Config.MaxValueBytes
	fields []field

	relations map[uint32]*relation

	// Scratch reused by every Insert so that decoding allocates nothing but
	// the event buffer: column positions in the message, sized at Relation
	// time for the widest outbox relation, and the decoded length per field.
	cols  []colSpan
	sizes []int

	inTxn  bool
	begin  Begin
	commit Commit
	event  Event

	messageLSN LSN
	unmapped   *relation // the relation of the last KindUnmapped
}

// New validates cfg and returns a Decoder for it.
func New(cfg Config) (*Decoder, error) {
	if len(cfg.Tables) == 0 {
		return nil, errors.New("decoder: no outbox tables configured")
	}
	tables := make([]Table, len(cfg.Tables))
	for i, t := range cfg.Tables {
		if t.Schema == "" || t.Name == "" {
			return nil, fmt.Errorf("decoder: outbox table %d needs both schema and name, got %q", i, t.String())
		}
		for _, u := range tables[:i] {
			if u == t {
				return nil, fmt.Errorf("decoder: outbox table %s configured twice", t)
			}
		}
		tables[i] = t
	}

	m := cfg.Mapping
	d := &Decoder{
		tables:    tables,
		binary:    cfg.Binary,
		limit:     cfg.MaxValueBytes,
		relations: make(map[uint32]*relation),
	}
	headers := m.HeaderColumns()
	d.event.Headers = make([]Header, len(headers))
	add := func(role, column string, dst *[]byte) {
		d.fields = append(d.fields, field{role: role, column: column, dst: dst})
	}
	required := []struct {
		role, column string
		dst          *[]byte
	}{
		{"id", m.ID, &d.event.ID},
		{"aggregate_type", m.AggregateType, &d.event.AggregateType},
		{"aggregate_id", m.AggregateID, &d.event.AggregateID},
		{"payload", m.Payload, &d.event.Payload},
	}
	for _, f := range required {
		if f.column == "" {
			return nil, fmt.Errorf("decoder: mapping has no column for %s", f.role)
		}
		add(f.role, f.column, f.dst)
	}
	if m.Type != "" {
		add("type", m.Type, &d.event.Type)
	}
	for i, h := range headers {
		if h.Column == "" || h.Header == "" {
			return nil, fmt.Errorf("decoder: header mapping %d needs both column and header, got %+v", i, h)
		}
		d.event.Headers[i].Key = h.Header
		add("header "+h.Header, h.Column, &d.event.Headers[i].Value)
		d.fields[len(d.fields)-1].optional = h.Optional
	}
	d.sizes = make([]int, len(d.fields))
	return d, nil
}

// Begin returns the last Begin message.
func (d *Decoder) Begin() Begin { return d.begin }

// Commit returns the last Commit message.
func (d *Decoder) Commit() Commit { return d.commit }

// Event returns the event of the last KindInsert. The pointer is the same for
// every event; see Event for what may be kept.
func (d *Decoder) Event() *Event { return &d.event }

// MessageLSN is the position of the last KindMessage.
func (d *Decoder) MessageLSN() LSN { return d.messageLSN }

// Unmapped names the relation of the last KindUnmapped as its Relation
// message did (schema and name, not quoted), and returns its relation OID.
// It allocates nothing: the strings were made when the relation was cached.
func (d *Decoder) Unmapped() (Table, uint32) {
	if d.unmapped == nil {
		return Table{}, 0
	}
	return Table{Schema: d.unmapped.namespace, Name: d.unmapped.name}, d.unmapped.oid
}

// Decode decodes one pgoutput message. data is only read during the call (the
// caller reuses its buffer). It never panics on any input; malformed input
// returns an error wrapping ErrMalformed with the message type, the field and
// its offset. On error the kind is KindIgnored; Begin, Commit and the
// transaction state are unchanged, and Event is not valid until the next
// KindInsert. A Relation message of an outbox table that lacks mapped
// columns is not an error: it is cached, and its rows are KindInsert with
// Event.Unmappable set; nor is an outbox row with a mapped value that
// cannot be decoded (KindInsert with Event.Undecodable set).
func (d *Decoder) Decode(data []byte) (Kind, error) {
	if len(data) == 0 {
		return KindIgnored, fmt.Errorf("decoder: empty message: %w", ErrMalformed)
	}
	r := reader{buf: data, off: 1}
	switch t := data[0]; t {
	case 'B':
		return d.decodeBegin(&r)
	case 'C':
		return d.decodeCommit(&r)
	case 'R':
		return d.decodeRelation(&r)
	case 'I':
		return d.decodeInsert(&r)
	case 'U', 'D', 'T':
		// Outbox rows are usually deleted in the transaction that inserted
		// them: these are as frequent as inserts, so they are skipped by
		// type without parsing.
		return KindIgnored, nil
	case 'O':
		r.u64("commit LSN")
		r.cstring("name")
		return KindIgnored, d.end(&r, t)
	case 'Y':
		r.u32("type OID")
		r.cstring("namespace")
		r.cstring("name")
		return KindIgnored, d.end(&r, t)
	case 'M':
		flags := r.u8("flags")
		lsn := LSN(r.u64("LSN"))
		r.cstring("prefix")
		at := r.off
		n := int32(r.u32("content length"))
		if n < 0 {
			return KindIgnored, malformed(t, "content length", at, fmt.Sprintf("negative length %d", n))
		}
		r.skip(int(n), "content")
		if err := d.end(&r, t); err != nil {
			return KindIgnored, err
		}
		if flags&1 != 0 { // transactional: part of a transaction's changes
			return KindIgnored, nil
		}
		d.messageLSN = lsn
		return KindMessage, nil
	case 'S', 'E', 'c', 'A':
		return KindIgnored, fmt.Errorf("decoder: %s message: streaming is not requested: %w", messageName(t), ErrUnsupported)
	case 'b', 'P', 'K', 'r', 'p':
		return KindIgnored, fmt.Errorf("decoder: %s message: two-phase commit is not requested: %w", messageName(t), ErrUnsupported)
	default:
		return KindIgnored, malformed(t, "message type", 0, fmt.Sprintf("unknown message type 0x%02x", t))
	}
}

// end turns a failed read or unread trailing bytes into an error. Trailing
// bytes are an error because pgoutput messages have no padding: they mean the
// decoder and the server disagree about the format.
func (d *Decoder) end(r *reader, t byte) error {
	if r.failed {
		return malformed(t, r.field, r.at, "message truncated")
	}
	if n := r.rest(); n != 0 {
		return malformed(t, "message", r.off, fmt.Sprintf("%d trailing bytes", n))
	}
	return nil
}

// malformed builds an ErrMalformed error naming the message type, the field
// and its offset in the message (the type byte is offset 0).
func malformed(t byte, field string, off int, why string) error {
	return fmt.Errorf("decoder: %s message: %s at offset %d: %s: %w", messageName(t), field, off, why, ErrMalformed)
}

// messageName names a message type byte for errors.
func messageName(t byte) string {
	switch t {
	case 'B':
		return "Begin"
	case 'C':
		return "Commit"
	case 'O':
		return "Origin"
	case 'R':
		return "Relation"
	case 'Y':
		return "Type"
	case 'I':
		return "Insert"
	case 'U':
		return "Update"
	case 'D':
		return "Delete"
	case 'T':
		return "Truncate"
	case 'M':
		return "logical decoding"
	case 'S':
		return "Stream Start"
	case 'E':
		return "Stream Stop"
	case 'c':
		return "Stream Commit"
	case 'A':
		return "Stream Abort"
	case 'b':
		return "Begin Prepare"
	case 'P':
		return "Prepare"
	case 'K':
		return "Commit Prepared"
	case 'r':
		return "Rollback Prepared"
	case 'p':
		return "Stream Prepare"
	}
	return fmt.Sprintf("unknown (0x%02x)", t)
}
