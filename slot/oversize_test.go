package slot

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/walrelay/walrelay/decoder"
	pgo "github.com/walrelay/walrelay/test/pgoutputtest"
)

// The pgoutput messages and their framing, for short.
var (
	copyData = pgo.CopyData
	xlog     = pgo.XLogData
	text     = pgo.Text
	null     = pgo.Null
)

// choppy hands out its data in small random pieces with deadline errors
// between them, as a socket read with short deadlines does.
type choppy struct {
	data []byte
	rng  *rand.Rand
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func (c *choppy) Read(p []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	if c.rng.IntN(4) == 0 {
		return 0, timeoutErr{}
	}
	n := min(len(p), 1+c.rng.IntN(4096), len(c.data))
	copy(p, c.data[:n])
	c.data = c.data[n:]
	return n, nil
}

// A CopyData message over the cap reaches pgproto3 rewritten: the mapped
// small values kept, the large one replaced by the omitted marker with its
// size; the messages around it pass unchanged, whatever the read pieces
// and deadlines; no message pgproto3 sees is over the cap.
func TestCapReaderRewritesOversizeInsert(t *testing.T) {
	const limit = 64 << 10
	id := []byte("0b3c8f6e-4a51-4c2e-9d7a-1f2e3d4c5b6a")
	big := []byte(`"` + strings.Repeat("x", 5*limit) + `"`)
	small := pgo.Insert(16384, text(string(id)), text("order"), text("1"), null(), text(`{}`))
	msgs := [][]byte{
		xlog(1, pgo.Relation(16384, "public", "outbox", pgo.TextColumns("id", "aggregate_type", "aggregate_id", "type", "payload")...)),
		xlog(2, pgo.Begin(9, 1, 7)),
		xlog(3, small),
		xlog(4, pgo.Insert(16384, text(string(id)), text("order"), text("2"), null(), text(string(big)))),
		xlog(5, append([]byte{'U'}, bytes.Repeat([]byte("u"), 2*limit)...)),
		xlog(6, pgo.Logical(false, 1, "walrelay", bytes.Repeat([]byte("m"), 1<<20))),
		xlog(7, small),
	}
	var stream []byte
	for _, m := range msgs {
		stream = append(stream, copyData(m)...)
	}
	for seed := range uint64(20) {
		src := &choppy{data: stream, rng: rand.New(rand.NewPCG(seed, 1))}
		fe := pgproto3.NewFrontend(&capReader{src: bufio.NewReaderSize(src, 8192), max: limit}, io.Discard)
		fe.SetMaxBodyLen(limit)
		dec, err := decoder.New(decoder.Config{Tables: []decoder.Table{{Schema: "public", Name: "outbox"}}, Mapping: decoder.DefaultMapping()})
		if err != nil {
			t.Fatal(err)
		}
		var got [][]byte
		for len(got) < len(msgs) {
			m, err := fe.Receive()
			if err != nil {
				var te timeoutErr
				if errors.As(err, &te) {
					continue
				}
				t.Fatalf("seed %d: message %d: %v", seed, len(got), err)
			}
			cd, ok := m.(*pgproto3.CopyData)
			if !ok {
				t.Fatalf("seed %d: %T", seed, m)
			}
			got = append(got, bytes.Clone(cd.Data))
		}
		for _, i := range []int{0, 1, 2, 6} {
			if !bytes.Equal(got[i], msgs[i]) {
				t.Fatalf("seed %d: message %d changed", seed, i)
			}
		}
		for i := 0; i < 4; i++ {
			if _, err := dec.Decode(got[i][25:]); err != nil {
				t.Fatalf("seed %d: decode %d: %v", seed, i, err)
			}
		}
		ev := dec.Event()
		if !bytes.Equal(ev.ID, id) || string(ev.AggregateID) != "2" || ev.Payload != nil || ev.Omitted != len(big) {
			t.Fatalf("seed %d: oversize event id %q key %q payload %d bytes omitted %d", seed, ev.ID, ev.AggregateID, len(ev.Payload), ev.Omitted)
		}
		if !bytes.Equal(got[4], msgs[4][:26]) {
			t.Fatalf("seed %d: update cut to %d bytes, want its type byte", seed, len(got[4]))
		}
		if k, err := dec.Decode(got[5][25:]); err != nil || k != decoder.KindMessage || dec.MessageLSN() != 1 {
			t.Fatalf("seed %d: logical message: %v %v lsn %v", seed, k, err, dec.MessageLSN())
		}
	}
}

// FuzzCapReader feeds arbitrary bytes through the reader: it never panics
// or loops, and pgproto3 never receives a CopyData message over the cap
// (plus the header it keeps), whatever the framing claims.
func FuzzCapReader(f *testing.F) {
	id := []byte("0b3c8f6e")
	f.Add(copyData(xlog(1, pgo.Insert(1, text(string(id)), text(strings.Repeat("x", 300))))))
	f.Add(copyData(xlog(1, append([]byte{'U'}, make([]byte, 200)...))))
	f.Add(copyData(xlog(1, append([]byte("M\x01\x00\x00\x00\x00\x00\x00\x00\x01p\x00\x00\x00\x01\x00"), make([]byte, 256)...))))
	f.Add(append(copyData([]byte("k")), copyData(xlog(2, []byte("I\x00\x00\x00\x01N\x00\x02b\x00\x00\x01\x00")))...))
	const limit = 128
	f.Fuzz(func(t *testing.T, in []byte) {
		tm := time.AfterFunc(30*time.Second, func() { panic(fmt.Sprintf("hang on %q", in)) })
		defer tm.Stop()
		fe := pgproto3.NewFrontend(&capReader{src: bufio.NewReaderSize(bytes.NewReader(in), 16), max: limit}, io.Discard)
		fe.SetMaxBodyLen(limit + maxMessageSlack)
		for range len(in) + 1 {
			m, err := fe.Receive()
			if err != nil {
				return
			}
			if cd, ok := m.(*pgproto3.CopyData); ok && len(cd.Data) > limit {
				t.Fatalf("CopyData of %d bytes passed a cap of %d", len(cd.Data), limit)
			}
		}
		t.Fatalf("more messages than input bytes")
	})
}
