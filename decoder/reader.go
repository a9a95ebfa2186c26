package decoder

// reader.go: a tiny bounds-checked big-endian reader over one pgoutput
// message.
//
// pglogrepl indexes into the message without checking its length, so a
// truncated message panics the relay. Every read here checks the remaining
// length first. A failed read records the field it was reading and the offset
// where it started, and every later read fails too: callers read a whole
// message part in straight-line code and check r.failed once, which keeps the
// decoders readable and the error precise ("Begin: xid at offset 17").

import (
	"bytes"
	"encoding/binary"
)

// reader reads big-endian integers and strings from buf. The zero value is not
// useful; build one with a composite literal over the message bytes.
type reader struct {
	buf []byte
	off int

	failed bool   // a read ran past the end of buf
	field  string // the field the first failed read was reading
	at     int    // the offset where that field started
}

// fail records the first failed read; it keeps the earliest because later
// failures are only consequences of it.
func (r *reader) fail(field string) {
	if !r.failed {
		r.failed, r.field, r.at = true, field, r.off
	}
}

// has reports whether n more bytes can be read, failing the reader if not.
// n is never negative: callers check lengths read from the wire first.
func (r *reader) has(n int, field string) bool {
	if r.failed || len(r.buf)-r.off < n {
		r.fail(field)
		return false
	}
	return true
}

// u8 reads one byte.
func (r *reader) u8(field string) byte {
	if !r.has(1, field) {
		return 0
	}
	v := r.buf[r.off]
	r.off++
	return v
}

// u16 reads a big-endian uint16.
func (r *reader) u16(field string) uint16 {
	if !r.has(2, field) {
		return 0
	}
	v := binary.BigEndian.Uint16(r.buf[r.off:])
	r.off += 2
	return v
}

// u32 reads a big-endian uint32.
func (r *reader) u32(field string) uint32 {
	if !r.has(4, field) {
		return 0
	}
	v := binary.BigEndian.Uint32(r.buf[r.off:])
	r.off += 4
	return v
}

// u64 reads a big-endian uint64.
func (r *reader) u64(field string) uint64 {
	if !r.has(8, field) {
		return 0
	}
	v := binary.BigEndian.Uint64(r.buf[r.off:])
	r.off += 8
	return v
}

// skip advances over n bytes (n >= 0) and returns the offset they start at,
// so callers can keep positions instead of slices into a buffer they do not
// own.
func (r *reader) skip(n int, field string) int {
	if !r.has(n, field) {
		return r.off
	}
	start := r.off
	r.off += n
	return start
}

// cstring reads a NUL-terminated string and returns it without the NUL. The
// result aliases buf: convert it to a string before buf is reused.
func (r *reader) cstring(field string) []byte {
	if r.failed {
		return nil
	}
	n := bytes.IndexByte(r.buf[r.off:], 0)
	if n < 0 {
		r.fail(field)
		return nil
	}
	s := r.buf[r.off : r.off+n]
	r.off += n + 1
	return s
}

// rest returns the number of unread bytes.
func (r *reader) rest() int { return len(r.buf) - r.off }
