package integration

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestExactlyOnceCommitLandedUnanswered: the broker commits the relay's
// Kafka transaction, and its answer never arrives (the connection is cut
// as the answer comes, and Kafka stays unreachable until the relay gives
// the commit up). The relay cannot know the outcome; the next session finds
// the newer checkpoint, reads back that the transaction landed on every
// partition, and skips by it: read_committed reads each event once, and no
// resend is counted. (Resending after the last confirmed checkpoint, as
// the relay did before it read commits back, duplicated the transaction's
// events.) It runs on kfake and, under make test-kafka, Apache Kafka.
func TestExactlyOnceCommitLandedUnanswered(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.ExactlyOnce = true
	cfg.Router.CheckpointTopic = e.checkpointTopic()
	cfg.TxnMaxInterval = 300 * time.Millisecond
	cut := &commitCutter{}
	cfg.KafkaOptions = append(cfg.KafkaOptions, kgo.Dialer(cut.dial))
	rr, reg := e.startRelayGathered(cfg)
	rc := e.consumeIsolated(true)

	const writers, perWriter = 4, 400
	wr := e.startWriters(writers, 0, perWriter, 20*time.Millisecond)
	rc.waitDistinct(writers*perWriter/4, 2*time.Minute)
	cut.arm()
	select {
	case <-cut.fired:
	case <-time.After(time.Minute):
		t.Fatal("no Kafka commit came within a minute of arming the cut")
	}
	e.waitFor("the relay to give the unanswered commit up", time.Minute, func() (bool, error) {
		return gathered(reg, "walrelay_stream_restarts_total")["kafka"] > 0, errors.New("no session ended on a Kafka failure")
	})
	cut.heal()
	wr.wait(t)
	_, n := e.deliveredExactlyOnce(rc, 3*time.Minute)
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay Run returned: %v", err)
	}
	if v := gathered(reg, "walrelay_kafka_unconfirmed_commits_total")[""]; v != 0 {
		t.Errorf("walrelay_kafka_unconfirmed_commits_total = %v: the relay resent a commit that had landed", v)
	}
	t.Logf("commit answered to nobody, Kafka refused for %s; %d events read exactly once; kafka transactions %v, stream restarts %v",
		cut.downFor().Round(time.Millisecond), n, gathered(reg, "walrelay_kafka_transactions_total"), gathered(reg, "walrelay_stream_restarts_total"))
}

// commitCutter dials Kafka for a client (kgo.Dialer) and, once armed, cuts
// the connection that carries the next EndTxn (commit or abort) just as
// the broker's answer arrives, so that the broker has acted on it and the
// client never learns how; from then on until heal it refuses every dial.
type commitCutter struct {
	armed, down atomic.Bool
	fired       chan struct{}
	mu          sync.Mutex
	cutAt       time.Time
	healedAt    time.Time
}

func (c *commitCutter) arm() {
	c.fired = make(chan struct{})
	c.armed.Store(true)
}

func (c *commitCutter) heal() {
	c.mu.Lock()
	c.healedAt = time.Now()
	c.mu.Unlock()
	c.down.Store(false)
}

func (c *commitCutter) downFor() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.healedAt.Sub(c.cutAt)
}

func (c *commitCutter) dial(ctx context.Context, network, host string) (net.Conn, error) {
	if c.down.Load() {
		return nil, errors.New("test: Kafka unreachable (commitCutter)")
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, network, host)
	if err != nil {
		return nil, err
	}
	return &cutConn{Conn: conn, c: c, endTxn: -1}, nil
}

// cutConn reads the client's requests as they are written (size, api key,
// version, correlation id) and hands the broker's responses over one whole
// frame at a time, so that it can hold back the answer to an EndTxn.
type cutConn struct {
	net.Conn
	c *commitCutter

	wmu    sync.Mutex
	whead  []byte // the next request's first bytes, until its header is whole
	wskip  int    // bytes left of the request being written
	endTxn int64  // correlation id of the EndTxn to cut at, or -1

	pending []byte // a response frame being handed over
}

func (cc *cutConn) Write(p []byte) (int, error) {
	cc.wmu.Lock()
	for b := p; len(b) > 0; {
		if cc.wskip > 0 {
			n := min(cc.wskip, len(b))
			cc.wskip, b = cc.wskip-n, b[n:]
			continue
		}
		need := 12 - len(cc.whead)
		n := min(need, len(b))
		cc.whead, b = append(cc.whead, b[:n]...), b[n:]
		if len(cc.whead) < 12 {
			break
		}
		size := int(binary.BigEndian.Uint32(cc.whead[0:4]))
		key := int16(binary.BigEndian.Uint16(cc.whead[4:6]))
		if key == int16(kmsg.EndTxn) && cc.c.armed.CompareAndSwap(true, false) {
			cc.endTxn = int64(binary.BigEndian.Uint32(cc.whead[8:12]))
		}
		cc.wskip, cc.whead = size+4-12, cc.whead[:0]
	}
	cc.wmu.Unlock()
	return cc.Conn.Write(p)
}

func (cc *cutConn) Read(p []byte) (int, error) {
	if len(cc.pending) == 0 {
		var head [8]byte
		if _, err := io.ReadFull(cc.Conn, head[:]); err != nil {
			return 0, err
		}
		size := int(binary.BigEndian.Uint32(head[0:4]))
		cc.wmu.Lock()
		target := cc.endTxn
		cc.wmu.Unlock()
		if target >= 0 && int64(binary.BigEndian.Uint32(head[4:8])) == target {
			// The broker answered the EndTxn: the client never hears.
			cc.c.mu.Lock()
			cc.c.cutAt = time.Now()
			cc.c.mu.Unlock()
			cc.c.down.Store(true)
			close(cc.c.fired)
			cc.Conn.Close()
			return 0, errors.New("test: connection cut as the commit's answer arrived (commitCutter)")
		}
		frame := make([]byte, 4+size)
		copy(frame, head[:])
		if _, err := io.ReadFull(cc.Conn, frame[8:]); err != nil {
			return 0, err
		}
		cc.pending = frame
	}
	n := copy(p, cc.pending)
	cc.pending = cc.pending[n:]
	return n, nil
}
