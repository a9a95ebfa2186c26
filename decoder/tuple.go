package decoder

// tuple.go: Insert messages, the hot path.
//
// An Insert is the relation OID, the tag 'N' and a TupleData: a column count
// and per column a kind byte ('n' NULL, 'u' unchanged TOAST, 't' text, 'b'
// binary) followed, for 't' and 'b', by an int32 length and the bytes. The
// relay's stream reader adds the kind OmittedKind ('o'): an int32 length
// and no bytes, for a value too large to read into memory.
//
// Decoding runs in three passes so that an outbox row costs exactly one
// allocation: walk the tuple once recording where each column's bytes are,
// compute the decoded size of every mapped value, then allocate one buffer
// and decode the values into it. Rows of other tables stop after the map
// lookup and a column count check (KindUnmapped).

import "fmt"

// OmittedKind is the TupleData kind byte of a value the stream reader left
// out (slot's oversize reader writes it, Decode reads it): an int32 length
// and no bytes. PostgreSQL never sends it.
const OmittedKind = 'o'

// colSpan is where one column's value lies in the message being decoded.
// Offsets rather than slices, so that the decoder keeps no reference to the
// caller's buffer after Decode returns.
type colSpan struct {
	kind byte // 'n', 't', 'b' or OmittedKind (n is then the omitted value's size)
	off  int
	n    int
}

// decodeInsert decodes an Insert message into d.event.
func (d *Decoder) decodeInsert(r *reader) (Kind, error) {
	oid := r.u32("relation OID")
	tag := r.u8("tuple tag")
	if r.failed {
		return KindIgnored, d.end(r, 'I')
	}
	if !d.inTxn {
		return KindIgnored, malformed('I', "message", 0, "Insert outside a transaction")
	}
	rel := d.relations[oid]
	if rel == nil {
		return KindIgnored, fmt.Errorf("decoder: Insert message: relation OID %d: %w", oid, ErrUnknownRelation)
	}
	if tag != 'N' {
		return KindIgnored, malformed('I', "tuple tag", 5, fmt.Sprintf("want 'N', got 0x%02x", tag))
	}
	if rel.table == nil {
		// Rows of other tables are not parsed; only the column count is
		// checked, because a mismatch means a Relation message was missed
		// and the stream is out of step.
		if err := d.checkColumnCount(r, rel); err != nil {
			return KindIgnored, err
		}
		d.unmapped = rel
		return KindUnmapped, nil
	}

	cols, err := d.walkTuple(r, rel)
	if err != nil {
		return KindIgnored, err
	}

	// Size every mapped value first, so the one buffer is allocated once and
	// exactly; a NULL has size -1 and stays nil, and so does a value over
	// the limit or left out by the reader (size -2, counted in Omitted).
	// A value that cannot be decoded stays nil too: the tuple was walked
	// whole, so the stream is in step, and the row is an invalid event
	// (Event.Undecodable) rather than a reason to stop the stream.
	total, omitted := 0, 0
	var undecodable error
	for f := range d.fields {
		c := rel.fieldCols[f]
		if c < 0 { // a column the table lacks (rel.err says which, unless optional): nil
			d.sizes[f] = -1
			continue
		}
		sp := cols[c]
		if sp.kind == OmittedKind {
			d.sizes[f] = -2
			omitted += sp.n
			continue
		}
		n, err := valueLen(sp.kind, rel.columns[c].typ, r.buf[sp.off:sp.off+sp.n])
		if err != nil {
			if undecodable == nil {
				undecodable = d.valueError(rel, c, sp, err)
			}
			d.sizes[f] = -1
			continue
		}
		if d.limit > 0 && n > d.limit {
			n, omitted = -2, omitted+n
		}
		d.sizes[f] = n
		total += max(n, 0)
	}
	buf := make([]byte, total)
	off := 0
	for f, fl := range d.fields {
		n := d.sizes[f]
		if n < 0 {
			*fl.dst = nil
			continue
		}
		c := rel.fieldCols[f]
		sp := cols[c]
		// Capped at its own length: appending to one value must not
		// overwrite the next one in the shared buffer.
		dst := buf[off : off+n : off+n]
		off += n
		if err := decodeValue(dst, sp.kind, rel.columns[c].typ, r.buf[sp.off:sp.off+sp.n]); err != nil {
			if undecodable == nil {
				undecodable = d.valueError(rel, c, sp, err)
			}
			*fl.dst = nil
			continue
		}
		*fl.dst = dst
	}
	d.event.Table = rel.table
	d.event.Omitted = omitted
	d.event.Unmappable = rel.err
	d.event.Undecodable = undecodable
	d.event.CommitTime = d.begin.CommitTime
	d.event.Xid = d.begin.Xid
	return KindInsert, nil
}

// walkTuple reads the TupleData of an outbox insert and returns where each
// column's value lies. The column count must match the relation: a mismatch
// means a Relation message was missed and positions cannot be trusted.
func (d *Decoder) walkTuple(r *reader, rel *relation) ([]colSpan, error) {
	if err := d.checkColumnCount(r, rel); err != nil {
		return nil, err
	}
	cols := d.cols[:len(rel.columns)]
	for i := range cols {
		at := r.off
		kind := r.u8("column kind")
		if r.failed {
			return nil, d.columnError(rel, i, r.field, r.at, "message truncated")
		}
		switch kind {
		case 'n':
			cols[i] = colSpan{kind: kind}
		case 't', 'b':
			if kind == 'b' && !d.binary {
				return nil, d.columnError(rel, i, "column kind", at, "binary value, but binary format was not requested")
			}
			at = r.off
			size := int32(r.u32("column length"))
			if !r.failed && size < 0 {
				return nil, d.columnError(rel, i, "column length", at, fmt.Sprintf("negative length %d", size))
			}
			cols[i] = colSpan{kind: kind, off: r.skip(int(size), "column value"), n: int(size)}
		case OmittedKind:
			at = r.off
			size := int32(r.u32("omitted length"))
			if !r.failed && size < 0 {
				return nil, d.columnError(rel, i, "omitted length", at, fmt.Sprintf("negative length %d", size))
			}
			cols[i] = colSpan{kind: kind, n: int(size)}
		case 'u':
			return nil, d.columnError(rel, i, "column kind", at, "unchanged TOAST value in an insert")
		default:
			return nil, d.columnError(rel, i, "column kind", at, fmt.Sprintf("unknown kind 0x%02x", kind))
		}
		if r.failed {
			return nil, d.columnError(rel, i, r.field, r.at, "message truncated")
		}
	}
	if err := d.end(r, 'I'); err != nil {
		return nil, err
	}
	return cols, nil
}

// checkColumnCount reads the TupleData column count and checks it against the
// relation.
func (d *Decoder) checkColumnCount(r *reader, rel *relation) error {
	at := r.off
	n := int(r.u16("column count"))
	if r.failed {
		return d.end(r, 'I')
	}
	if n != len(rel.columns) {
		return malformed('I', "column count", at,
			fmt.Sprintf("%d columns, relation %s.%s has %d", n, rel.namespace, rel.name, len(rel.columns)))
	}
	return nil
}

// columnError is an ErrMalformed error about column i of an insert.
func (d *Decoder) columnError(rel *relation, i int, field string, at int, why string) error {
	return malformed('I', fmt.Sprintf("%s %q of %s", field, rel.columns[i].name, rel.table), at, why)
}

// valueError wraps an error decoding the value of column c, naming the table,
// the column, its type OID and where the value starts.
func (d *Decoder) valueError(rel *relation, c int, sp colSpan, err error) error {
	format := "text"
	if sp.kind == 'b' {
		format = "binary"
	}
	return fmt.Errorf("decoder: Insert message: column %q of %s (type OID %d, %s) at offset %d: %w",
		rel.columns[c].name, rel.table, rel.columns[c].typ, format, sp.off, err)
}
