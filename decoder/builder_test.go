package decoder

// builder_test.go: builds pgoutput messages byte by byte for the tests, the
// fuzz seeds and the benchmarks, following "Logical Replication Message
// Formats" of the PostgreSQL documentation (protocol version 1).

import "encoding/binary"

// msg accumulates one message.
type msg []byte

func (m msg) u8(v byte) msg    { return append(m, v) }
func (m msg) u16(v uint16) msg { return binary.BigEndian.AppendUint16(m, v) }
func (m msg) u32(v uint32) msg { return binary.BigEndian.AppendUint32(m, v) }
func (m msg) u64(v uint64) msg { return binary.BigEndian.AppendUint64(m, v) }
func (m msg) str(s string) msg { return append(append(m, s...), 0) }
func (m msg) raw(b []byte) msg { return append(m, b...) }
func (m msg) i32(v int32) msg  { return m.u32(uint32(v)) }
func (m msg) i64(v int64) msg  { return m.u64(uint64(v)) }
func (m msg) bytes() []byte    { return []byte(m) }
func start(t byte) msg         { return msg{t} }

// relCol is one column of a Relation message.
type relCol struct {
	name  string
	typ   uint32
	flags byte
}

func col(name string, typ uint32) relCol { return relCol{name: name, typ: typ} }

// relationMsg builds a Relation message.
func relationMsg(oid uint32, schema, name string, cols ...relCol) []byte {
	m := start('R').u32(oid).str(schema).str(name).u8('d').u16(uint16(len(cols)))
	for _, c := range cols {
		m = m.u8(c.flags).str(c.name).u32(c.typ).i32(-1)
	}
	return m
}

// outboxCols are the columns of the usual outbox table.
func outboxCols() []relCol {
	return []relCol{
		col("id", oidUUID),
		col("aggregate_type", oidText),
		col("aggregate_id", oidText),
		col("type", oidVarchar),
		col("payload", oidJSONB),
	}
}

// beginMsg builds a Begin message; ts is microseconds since 2000-01-01.
func beginMsg(final uint64, ts int64, xid uint32) []byte {
	return start('B').u64(final).i64(ts).u32(xid)
}

// commitMsg builds a Commit message.
func commitMsg(flags byte, commitLSN, endLSN uint64, ts int64) []byte {
	return start('C').u8(flags).u64(commitLSN).u64(endLSN).i64(ts)
}

// val is one TupleData column.
type val struct {
	kind byte
	data []byte
}

// Column values of each kind.
func null() val           { return val{kind: 'n'} }
func toast() val          { return val{kind: 'u'} }
func text(s string) val   { return val{kind: 't', data: []byte(s)} }
func binval(b []byte) val { return val{kind: 'b', data: b} }

// omitted is a value the stream reader left out: kind 'o' and its length.
func omitted(n int) val { return val{kind: 'o', data: make([]byte, n)} }

// tuple appends a TupleData to m.
func tuple(m msg, vals ...val) msg {
	m = m.u16(uint16(len(vals)))
	for _, v := range vals {
		m = m.u8(v.kind)
		if v.kind == 't' || v.kind == 'b' {
			m = m.u32(uint32(len(v.data))).raw(v.data)
		}
		if v.kind == 'o' {
			m = m.u32(uint32(len(v.data)))
		}
	}
	return m
}

// insertMsg builds an Insert message.
func insertMsg(oid uint32, vals ...val) []byte {
	return tuple(start('I').u32(oid).u8('N'), vals...)
}

// updateMsg builds an Update message with an old key and a new tuple.
func updateMsg(oid uint32, key val, vals ...val) []byte {
	m := tuple(start('U').u32(oid).u8('K'), key)
	return tuple(m.u8('N'), vals...)
}

// deleteMsg builds a Delete message with the old key.
func deleteMsg(oid uint32, key val) []byte {
	return tuple(start('D').u32(oid).u8('K'), key)
}

// truncateMsg builds a Truncate message.
func truncateMsg(oids ...uint32) []byte {
	m := start('T').u32(uint32(len(oids))).u8(0)
	for _, o := range oids {
		m = m.u32(o)
	}
	return m
}

// originMsg, typeMsg and logicalMsg build the other ignored messages.
func originMsg(lsn uint64, name string) []byte { return start('O').u64(lsn).str(name) }
func typeMsg(oid uint32, schema, name string) []byte {
	return start('Y').u32(oid).str(schema).str(name)
}
func logicalMsg(transactional bool, lsn uint64, prefix string, content []byte) []byte {
	var flags byte
	if transactional {
		flags = 1
	}
	return start('M').u8(flags).u64(lsn).str(prefix).u32(uint32(len(content))).raw(content)
}
