package slot

import (
	"bufio"
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"

	pgo "github.com/walrelay/walrelay/test/pgoutputtest"
)

// benchStream is 10,000 CopyData messages of a typical outbox row.
func benchStream() []byte {
	var b []byte
	msg := copyData(xlog(1, pgo.Insert(1, text("0b3c8f6e-4a51-4c2e-9d7a-1f2e3d4c5b6a"), text("order"), text("42"), null(), text(strings.Repeat("p", 150)))))
	for range 10000 {
		b = append(b, msg...)
	}
	return b
}

// benchRead parses the stream with pgproto3, through the capReader or not:
// passing messages under the cap must cost nothing measurable.
func benchRead(b *testing.B, capped bool) {
	data := benchStream()
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		br := bufio.NewReaderSize(bytes.NewReader(data), 1<<20)
		var r io.Reader = br
		if capped {
			r = &capReader{src: br, max: 64 << 20}
		}
		fe := pgproto3.NewFrontend(r, io.Discard)
		for range 10000 {
			if _, err := fe.Receive(); err != nil {
				b.Fatal(err)
			}
		}
	}
}

func BenchmarkReadPlain(b *testing.B)  { benchRead(b, false) }
func BenchmarkReadCapped(b *testing.B) { benchRead(b, true) }
