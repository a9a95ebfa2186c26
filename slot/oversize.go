package slot

// oversize.go: bounding what one replication message may cost.
//
// An outbox row travels as one protocol message (CopyData carrying
// XLogData carrying a pgoutput Insert), and pgproto3 reads a message whole
// into memory before parsing it. A writer can make that message as large
// as PostgreSQL allows (1 GB per value), so a relay in a memory-limited
// container would be killed by one row, restart, and meet the same row
// again: a crash loop while WAL piles up.
//
// Refusing the message is no way out: pgproto3 fails the read of a message
// over its limit after its header, the body is left in the socket and the
// connection is unusable; the next connection resends the same row. So the
// reader below sits between the socket and pgproto3 and rewrites, in a
// bounded buffer, every CopyData message larger than the cap while it
// streams through: it keeps the message's framing, the XLogData header and
// every column value that still fits under the cap, and replaces each
// other value by the marker kind decoder.OmittedKind followed by the
// value's length (a kind PostgreSQL never sends; the decoder turns a mapped
// omitted value into an event marked oversize, which the router
// dead-letters with its id and size).
// The connection stays in step, the row is dead-lettered, the stream goes
// on, and no message pgproto3 sees is larger than the cap.
//
// Update, Delete and Truncate messages over the cap (large rows of other
// tables in the publication) are cut to their type byte, which is all the
// decoder reads of them; a logical decoding message keeps its header and
// loses its content. Other message types cannot be that large.

import (
	"bufio"
	"encoding/binary"
	"fmt"

	"github.com/walrelay/walrelay/decoder"
)

// capReader passes the protocol stream through unchanged, except CopyData
// messages whose body exceeds max, which it rewrites (see above). It is
// resumable: a read that fails (a deadline) leaves its state intact, and
// the next read continues where it stopped.
type capReader struct {
	src *bufio.Reader
	max int

	pass int    // bytes of the current message still to pass through as is
	out  []byte // a rewritten message (or part of it) still to hand out
	rw   *rewrite
}

// rewrite is the state of one oversize CopyData message being rewritten.
type rewrite struct {
	left  int    // body bytes not yet read from the source
	body  []byte // the rewritten body so far
	field []byte // the fixed-size field being accumulated
	need  int    // its size
	state rwState
	kind  byte // pgoutput message type
	cols  int  // columns of an Insert
	col   int  // the column being read
	val   int  // bytes of the current value still to read
	keep  bool // whether the current value is copied into body
}

type rwState uint8

const (
	rwXLog    rwState = iota // XLogData header: 'w' + 24 bytes
	rwType                   // pgoutput message type
	rwInsert                 // relation OID, tuple tag, column count
	rwColKind                // column kind
	rwColLen                 // column length
	rwColVal                 // column value bytes
	rwMsgHead                // logical decoding message: flags, LSN
	rwMsgPfx                 // its prefix, NUL-terminated
	rwMsgLen                 // its content length
	rwSkip                   // the rest is dropped
	rwTail                   // the rest is kept (bytes after an Insert's columns)
)

// maxPrefix bounds a logical decoding message's prefix kept by a rewrite.
const maxPrefix = 64 << 10

func (c *capReader) Read(p []byte) (int, error) {
	// Fill p with as many messages as are at hand, as a plain buffered
	// read would (pgproto3 then parses many messages per read), but never
	// block once some bytes are in hand.
	n := 0
	for n < len(p) {
		switch {
		case len(c.out) > 0:
			k := copy(p[n:], c.out)
			c.out = c.out[k:]
			if len(c.out) == 0 {
				c.out = nil // let a large rewritten message be collected
			}
			n += k
		case c.pass > 0:
			want := min(len(p)-n, c.pass)
			if n > 0 {
				if want = min(want, c.src.Buffered()); want == 0 {
					return n, nil
				}
			}
			k, err := c.src.Read(p[n : n+want])
			c.pass -= k
			n += k
			if err != nil {
				return n, err
			}
		case c.rw != nil:
			if n > 0 {
				return n, nil
			}
			if err := c.rewriteMore(); err != nil {
				return 0, err
			}
		default:
			if n > 0 && c.src.Buffered() < 5 {
				return n, nil
			}
			hdr, err := c.src.Peek(5)
			if err != nil {
				// A deadline (or EOF) inside a header: the bytes stay
				// buffered and the next read starts on the same header.
				return n, err
			}
			length := int(int32(binary.BigEndian.Uint32(hdr[1:])))
			if hdr[0] != 'd' || length-4 <= c.max {
				c.pass = 1 + length
				if length < 4 {
					c.pass = 5 // pgproto3 reports the bad length
				}
				continue
			}
			if n > 0 {
				return n, nil // rewriting may block: hand over what is in hand first
			}
			_, _ = c.src.Discard(5) // peeked above: cannot fail
			c.rw = &rewrite{left: length - 4, need: 25}
		}
	}
	return n, nil
}

// rewriteMore consumes what the source has buffered (waiting for at least
// one byte) of the oversize message; when the message is complete it
// queues the rewritten message in c.out.
func (c *capReader) rewriteMore() error {
	w := c.rw
	for w.left > 0 {
		if c.src.Buffered() == 0 {
			if _, err := c.src.Peek(1); err != nil {
				return err
			}
		}
		chunk, _ := c.src.Peek(min(c.src.Buffered(), w.left))
		used, err := c.step(chunk)
		_, _ = c.src.Discard(used) // at most what was peeked: cannot fail
		w.left -= used
		if err != nil {
			return err
		}
		if len(w.body) > c.max {
			// Only the fixed parts and one 5-byte marker per column are
			// kept unconditionally: a real row (at most 1664 columns)
			// fits in any sane cap; a message that does not is broken.
			return fmt.Errorf("replication stream: message of %d bytes cannot be shortened under slot.ReadOptions.MaxMessageBytes %d (%d columns); raise it", len(w.body)+w.left, c.max, w.cols)
		}
	}
	body := w.body
	if w.need > 0 && len(w.field) > 0 {
		body = append(body, w.field...) // truncated: the decoder reports it
	}
	c.rw = nil
	c.out = make([]byte, 5, 5+len(body))
	c.out[0] = 'd'
	binary.BigEndian.PutUint32(c.out[1:], uint32(4+len(body)))
	c.out = append(c.out, body...)
	return nil
}

// fixed accumulates a fixed-size field; it returns the bytes used and the
// field once complete.
func (w *rewrite) fixed(chunk []byte) (int, []byte) {
	n := min(w.need-len(w.field), len(chunk))
	w.field = append(w.field, chunk[:n]...)
	if len(w.field) < w.need {
		return n, nil
	}
	f := w.field
	w.field = w.field[:0:0]
	return n, f
}

// step consumes a prefix of chunk according to the state.
func (c *capReader) step(chunk []byte) (int, error) {
	w := c.rw
	switch w.state {
	case rwColVal:
		n := min(w.val, len(chunk))
		if w.keep {
			w.body = append(w.body, chunk[:n]...)
		}
		w.val -= n
		if w.val == 0 {
			c.nextColumn()
		}
		return n, nil
	case rwSkip:
		return len(chunk), nil
	case rwTail:
		if len(w.body)+len(chunk) > c.max {
			return 0, fmt.Errorf("replication stream: message of %d bytes over slot.ReadOptions.MaxMessageBytes %d that cannot be shortened", len(w.body)+w.left, c.max)
		}
		w.body = append(w.body, chunk...)
		return len(chunk), nil
	case rwMsgPfx:
		i := 0
		for i < len(chunk) && chunk[i] != 0 {
			i++
		}
		if i < len(chunk) {
			i++ // the NUL
			w.state, w.need = rwMsgLen, 4
		}
		w.body = append(w.body, chunk[:i]...)
		if len(w.body) > maxPrefix {
			return 0, fmt.Errorf("replication stream: logical decoding message with a prefix over %d bytes", maxPrefix)
		}
		return i, nil
	}
	n, f := w.fixed(chunk)
	if f == nil {
		return n, nil
	}
	switch w.state {
	case rwXLog:
		if f[0] != 'w' {
			return n, fmt.Errorf("replication stream: CopyData message of type %q and %d bytes over slot.ReadOptions.MaxMessageBytes %d", f[0], w.left+25, c.max)
		}
		w.body = append(w.body, f...)
		w.state, w.need = rwType, 1
	case rwType:
		w.kind = f[0]
		w.body = append(w.body, f[0])
		switch w.kind {
		case 'I':
			w.state, w.need = rwInsert, 7
		case 'M':
			w.state, w.need = rwMsgHead, 9
		case 'U', 'D', 'T':
			w.state = rwSkip
		default:
			return n, fmt.Errorf("replication stream: pgoutput message of type %q and %d bytes over slot.ReadOptions.MaxMessageBytes %d", w.kind, w.left+26, c.max)
		}
	case rwInsert:
		w.body = append(w.body, f...)
		w.cols = int(binary.BigEndian.Uint16(f[5:]))
		w.col = -1
		c.nextColumn()
	case rwColKind:
		w.body = append(w.body, f[0])
		if f[0] == 't' || f[0] == 'b' {
			w.state, w.need = rwColLen, 4
		} else {
			c.nextColumn() // 'n' or 'u' carry no bytes; anything else the decoder reports
		}
	case rwColLen:
		size := int(int32(binary.BigEndian.Uint32(f)))
		if size < 0 {
			w.body = append(w.body, f...)
			w.state = rwTail // malformed: the decoder reports it
			break
		}
		// Keep the value while the rewritten message stays under the
		// cap, with room for the marker of every column still to come.
		room := c.max - len(w.body) - 4 - 5*(w.cols-w.col-1)
		w.keep = size <= room
		if !w.keep {
			w.body[len(w.body)-1] = decoder.OmittedKind
		}
		w.body = append(w.body, f...)
		w.val = size
		w.state = rwColVal
		if size == 0 {
			c.nextColumn()
		}
	case rwMsgHead:
		w.body = append(w.body, f...)
		w.state = rwMsgPfx
	case rwMsgLen:
		w.body = binary.BigEndian.AppendUint32(w.body, 0) // the content is dropped
		w.state = rwSkip
	}
	return n, nil
}

// nextColumn moves to the next column of an Insert, or past the last.
func (c *capReader) nextColumn() {
	w := c.rw
	w.col++
	if w.col < w.cols {
		w.state, w.need = rwColKind, 1
		return
	}
	w.state = rwTail
}
