package outbox

import (
	"crypto/rand"
	"encoding/hex"
	"sync"
	"time"
)

// ID is an event id: a UUIDv7 (RFC 9562), whose first 48 bits are the Unix
// time in milliseconds, so ids sort by creation time and index well as a
// primary key.
type ID [16]byte

// String is the canonical text form, the value of the record's id header.
func (id ID) String() string {
	var b [36]byte
	hex.Encode(b[0:8], id[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], id[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], id[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], id[8:10])
	b[23] = '-'
	hex.Encode(b[24:], id[10:])
	return string(b[:])
}

// IsZero reports whether id is the zero value (no id chosen).
func (id ID) IsZero() bool { return id == ID{} }

var v7 struct {
	sync.Mutex
	ms  int64  // milliseconds of the last id
	seq uint16 // 12-bit counter within ms (RFC 9562 method 1)
}

// NewID returns a new UUIDv7. Ids from one process are strictly increasing:
// within a millisecond a 12-bit counter (started at a random value) orders
// them, and when it overflows the timestamp is moved one millisecond on.
func NewID() ID {
	var id ID
	if _, err := rand.Read(id[:]); err != nil {
		panic("outbox: crypto/rand failed: " + err.Error()) // never on supported platforms
	}
	v7.Lock()
	ms := time.Now().UnixMilli()
	if ms > v7.ms {
		v7.ms, v7.seq = ms, uint16(id[6])<<4&0x7ff // random start, leaving room to count
	} else {
		v7.seq++
		if v7.seq > 0xfff {
			v7.ms, v7.seq = v7.ms+1, 0
		}
	}
	ms, seq := v7.ms, v7.seq
	v7.Unlock()
	for i := range 6 {
		id[i] = byte(ms >> (40 - 8*i))
	}
	id[6] = 0x70 | byte(seq>>8)
	id[7] = byte(seq)
	id[8] = id[8]&0x3f | 0x80 // variant 10
	return id
}
