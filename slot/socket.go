package slot

import (
	"bufio"
	"context"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// How the stream is read matters as much as what is done with it. A
// client that reads every message the moment it arrives keeps the socket
// empty: the walsender then pays for a full loopback or network send per
// message. A client that reads large chunks and lets a little data pile up
// lets the kernel move the stream in large segments, which costs the
// walsender (usually the bottleneck) far less per event.

// DefaultReadBufferBytes is the read buffer ReadOptions.BufferBytes 0
// stands for.
const DefaultReadBufferBytes = 1 << 20

// ReadOptions tune how the replication socket is read.
type ReadOptions struct {
	// BufferBytes is the size of the read buffer: each read syscall takes
	// up to this much. 0 means DefaultReadBufferBytes.
	BufferBytes int
	// SocketReceiveBytes sets SO_RCVBUF on the connection; 0 leaves the
	// kernel's autotuning alone. A small buffer makes the walsender queue
	// data while the relay is busy, so it arrives in larger pieces.
	SocketReceiveBytes int
	// Coalesce is how long to wait before the next read when the last one
	// returned less than a quarter of the buffer, letting data accumulate.
	// 0 reads at once. It adds at most this much latency.
	Coalesce time.Duration
	// MaxMessageBytes caps the memory one protocol message may take: a
	// CopyData message larger than this is rewritten while it streams
	// through, without the column values that do not fit (see
	// oversize.go). 0 means no cap (pgproto3's own limit of about 1 GiB).
	MaxMessageBytes int
}

// maxMessageSlack is what a message may exceed MaxMessageBytes by in
// pgproto3's own check: the rewritten CopyData messages stay under the cap,
// other messages (errors, notices) are tiny; a larger one means a broken
// stream and fails the read.
const maxMessageSlack = 64 << 10

// readPath is what a Stream needs to see of the buffers applyReadOptions
// installs: the read buffer, set when the connection builds its frontend.
type readPath struct {
	br  *bufio.Reader
	cap *capReader // nil without MaxMessageBytes
}

// buffered is how many bytes of the stream wait in the read buffer or in
// a rewritten message not yet handed out.
func (p *readPath) buffered() int {
	if p == nil || p.br == nil {
		return 0
	}
	n := p.br.Buffered()
	if p.cap != nil {
		n += len(p.cap.out)
	}
	return n
}

// applyReadOptions installs the read path on a connection configuration.
func applyReadOptions(cfg *pgconn.Config, o ReadOptions) *readPath {
	size := o.BufferBytes
	if size <= 0 {
		size = DefaultReadBufferBytes
	}
	path := &readPath{}
	cfg.BuildFrontend = func(r io.Reader, w io.Writer) *pgproto3.Frontend {
		src := r
		if o.Coalesce > 0 {
			src = &pacedReader{r: r, pause: o.Coalesce, small: size / 4}
		}
		br := bufio.NewReaderSize(src, size)
		path.br = br
		if o.MaxMessageBytes <= 0 {
			return pgproto3.NewFrontend(br, w)
		}
		path.cap = &capReader{src: br, max: o.MaxMessageBytes}
		fe := pgproto3.NewFrontend(path.cap, w)
		fe.SetMaxBodyLen(o.MaxMessageBytes + maxMessageSlack)
		return fe
	}
	if o.SocketReceiveBytes > 0 {
		d := &net.Dialer{KeepAlive: 5 * time.Minute, Control: func(_, _ string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, o.SocketReceiveBytes)
			})
			if err != nil {
				return err
			}
			return serr
		}}
		cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			return d.DialContext(ctx, network, addr)
		}
	}
	return path
}

// pacedReader lets pause pass between a small read and the next one. A
// read that comes later than that anyway (after a Kafka commit, or a wait
// for the stream) does not sleep: the data had that time to pile up. That
// matters beyond the pause itself: Go's timers wake no sooner than the
// next millisecond tick of the poller when nothing else runs, so a 200 µs
// sleep measured 1.1 ms (p50) here, once per Kafka transaction.
type pacedReader struct {
	r      io.Reader
	pause  time.Duration
	small  int
	last   int
	lastAt time.Time           // when the last read returned
	sleep  func(time.Duration) // time.Sleep; tests replace it
}

func (p *pacedReader) Read(b []byte) (int, error) {
	if p.last > 0 && p.last < p.small {
		if left := p.pause - time.Since(p.lastAt); left > 0 {
			if p.sleep == nil {
				time.Sleep(left)
			} else {
				p.sleep(left)
			}
		}
	}
	n, err := p.r.Read(b)
	p.last, p.lastAt = n, time.Now()
	return n, err
}
