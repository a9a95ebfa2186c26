// Package pgoutputtest builds pgoutput messages byte by byte for tests,
// fuzz seeds and benchmarks, following "Logical Replication Message
// Formats" of the PostgreSQL documentation (protocol version 1), and the
// replication protocol's framing around them (XLogData in CopyData).
//
// It is the one builder of the decoder's, the slot reader's and the relay
// session's tests; only tests import it. It depends on no walrelay package,
// so the decoder's own tests can use it. Nothing here validates: a test
// builds malformed messages with the same calls (Start and the Msg methods).
package pgoutputtest

import "encoding/binary"

// Type OIDs of pg_type that the tests use (PostgreSQL's fixed catalog
// OIDs).
const (
	OIDBytea   = 17
	OIDName    = 19
	OIDInt8    = 20
	OIDInt2    = 21
	OIDInt4    = 23
	OIDText    = 25
	OIDJSON    = 114
	OIDBpchar  = 1042
	OIDVarchar = 1043
	OIDUUID    = 2950
	OIDJSONB   = 3802
)

// Msg accumulates one message; each method appends a field in network
// byte order and returns the longer message.
type Msg []byte

// Start begins a message of type t ('B', 'I', …).
func Start(t byte) Msg { return Msg{t} }

// U8 appends a byte.
func (m Msg) U8(v byte) Msg { return append(m, v) }

// U16 appends an Int16.
func (m Msg) U16(v uint16) Msg { return binary.BigEndian.AppendUint16(m, v) }

// U32 appends an Int32.
func (m Msg) U32(v uint32) Msg { return binary.BigEndian.AppendUint32(m, v) }

// U64 appends an Int64.
func (m Msg) U64(v uint64) Msg { return binary.BigEndian.AppendUint64(m, v) }

// I32 appends a signed Int32.
func (m Msg) I32(v int32) Msg { return m.U32(uint32(v)) }

// I64 appends a signed Int64.
func (m Msg) I64(v int64) Msg { return m.U64(uint64(v)) }

// Str appends a NUL-terminated String.
func (m Msg) Str(s string) Msg { return append(append(m, s...), 0) }

// Raw appends b as it is.
func (m Msg) Raw(b []byte) Msg { return append(m, b...) }

// Column is one column of a Relation message.
type Column struct {
	Name  string
	Type  uint32 // pg_type OID
	Flags byte   // 1: part of the replica identity key
}

// Col is a column of type typ, not part of the key.
func Col(name string, typ uint32) Column { return Column{Name: name, Type: typ} }

// TextColumns are columns of type text, named names.
func TextColumns(names ...string) []Column {
	cols := make([]Column, len(names))
	for i, n := range names {
		cols[i] = Col(n, OIDText)
	}
	return cols
}

// OutboxColumns are the columns of the usual outbox table: id uuid,
// aggregate_type text, aggregate_id text, type varchar, payload jsonb.
func OutboxColumns() []Column {
	return []Column{
		Col("id", OIDUUID),
		Col("aggregate_type", OIDText),
		Col("aggregate_id", OIDText),
		Col("type", OIDVarchar),
		Col("payload", OIDJSONB),
	}
}

// Relation builds a Relation message (replica identity default, type
// modifier -1).
func Relation(oid uint32, schema, name string, cols ...Column) []byte {
	m := Start('R').U32(oid).Str(schema).Str(name).U8('d').U16(uint16(len(cols)))
	for _, c := range cols {
		m = m.U8(c.Flags).Str(c.Name).U32(c.Type).I32(-1)
	}
	return m
}

// Begin builds a Begin message: the transaction's final (commit) LSN, its
// commit time in microseconds since 2000-01-01, its xid.
func Begin(final uint64, ts int64, xid uint32) []byte {
	return Start('B').U64(final).I64(ts).U32(xid)
}

// Commit builds a Commit message.
func Commit(flags byte, commitLSN, endLSN uint64, ts int64) []byte {
	return Start('C').U8(flags).U64(commitLSN).U64(endLSN).I64(ts)
}

// Value is one TupleData column: Kind 'n' (null), 'u' (unchanged TOAST),
// 't' (text), 'b' (binary) or 'o' (walrelay's omitted-value marker, which
// carries the left-out value's length and no data).
type Value struct {
	Kind byte
	Data []byte // for 't' and 'b'; for 'o' only its length counts
}

// Null is a NULL value.
func Null() Value { return Value{Kind: 'n'} }

// Toast is an unchanged TOASTed value.
func Toast() Value { return Value{Kind: 'u'} }

// Text is a value in text format.
func Text(s string) Value { return Value{Kind: 't', Data: []byte(s)} }

// Binary is a value in binary format.
func Binary(b []byte) Value { return Value{Kind: 'b', Data: b} }

// Omitted is a value of n bytes that the stream reader left out.
func Omitted(n int) Value { return Value{Kind: 'o', Data: make([]byte, n)} }

// Tuple appends a TupleData to m.
func Tuple(m Msg, vals ...Value) Msg {
	m = m.U16(uint16(len(vals)))
	for _, v := range vals {
		m = m.U8(v.Kind)
		switch v.Kind {
		case 't', 'b':
			m = m.U32(uint32(len(v.Data))).Raw(v.Data)
		case 'o':
			m = m.U32(uint32(len(v.Data)))
		}
	}
	return m
}

// Insert builds an Insert message.
func Insert(oid uint32, vals ...Value) []byte {
	return Tuple(Start('I').U32(oid).U8('N'), vals...)
}

// Update builds an Update message with an old key and a new tuple.
func Update(oid uint32, key Value, vals ...Value) []byte {
	m := Tuple(Start('U').U32(oid).U8('K'), key)
	return Tuple(m.U8('N'), vals...)
}

// Delete builds a Delete message with the old key.
func Delete(oid uint32, key Value) []byte {
	return Tuple(Start('D').U32(oid).U8('K'), key)
}

// Truncate builds a Truncate message (no options).
func Truncate(oids ...uint32) []byte {
	m := Start('T').U32(uint32(len(oids))).U8(0)
	for _, o := range oids {
		m = m.U32(o)
	}
	return m
}

// Origin builds an Origin message.
func Origin(lsn uint64, name string) []byte { return Start('O').U64(lsn).Str(name) }

// Type builds a Type message.
func Type(oid uint32, schema, name string) []byte {
	return Start('Y').U32(oid).Str(schema).Str(name)
}

// Logical builds a logical decoding Message (pg_logical_emit_message).
func Logical(transactional bool, lsn uint64, prefix string, content []byte) []byte {
	var flags byte
	if transactional {
		flags = 1
	}
	return Start('M').U8(flags).U64(lsn).Str(prefix).U32(uint32(len(content))).Raw(content)
}

// XLogData frames a pgoutput message as the walsender sends it: 'w', the
// WAL start and the server's WAL end (both walStart here), a send time of
// 0, the message.
func XLogData(walStart uint64, msg []byte) []byte {
	m := Start('w').U64(walStart).U64(walStart).U64(0)
	return m.Raw(msg)
}

// CopyData frames body as a CopyData protocol message ('d', its length).
func CopyData(body []byte) []byte {
	return Start('d').U32(uint32(4 + len(body))).Raw(body)
}
