package relay

// live.go: what the relay is doing now. live owns the streaming flag, the
// newest WAL position received, the replication lag, the session in
// progress and the router in use: sessions and Run's loop write them
// through its methods; readiness, status, the slot poller and the
// heartbeat read them, and a part that must end the session in progress
// (a record Kafka refused for good, a server shutting down) asks live.

import (
	"sync/atomic"
	"time"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
)

// live is what the relay is doing now.
type live struct {
	metrics   *metrics.Metrics
	streaming atomic.Bool
	received  atomic.Uint64 // newest WAL position received
	lag       atomic.Int64  // replication lag in nanoseconds
	current   atomic.Pointer[session]
	router    atomic.Pointer[router.Router]
	// promoted is set when the standby the relay decodes on
	// (Config.PrimaryURL set) was found promoted: it takes writes itself
	// from then on.
	promoted atomic.Bool
}

// writeURL is where the relay writes (the heartbeat, its record): the
// primary of the standby it decodes on, or the source database itself.
func (l *live) writeURL(cfg Config) string {
	if cfg.PrimaryURL == "" || l.promoted.Load() {
		return cfg.PGURL
	}
	return cfg.PrimaryURL
}

// begin records that s streams.
func (l *live) begin(s *session) {
	l.current.Store(s)
	l.streaming.Store(true)
	l.metrics.Streaming.Set(1)
}

// streamEnded records that the stream is over, whatever its session still
// waits for (Kafka's acks): a relay whose connection broke while Kafka was
// out must not look streaming until Kafka is back.
func (l *live) streamEnded() {
	l.streaming.Store(false)
	l.metrics.Streaming.Set(0)
}

// end records that s is over.
func (l *live) end(s *session) { l.current.CompareAndSwap(s, nil) }

// endSession ends the session in progress with err; its successor starts
// from the confirmed position.
func (l *live) endSession(err error) {
	if s := l.current.Load(); s != nil {
		select {
		case s.failed <- err:
		default: // another error ends it already
		}
		s.stream.Interrupt()
	}
}

// receivedAt records the newest WAL position received.
func (l *live) receivedAt(lsn decoder.LSN) { l.received.Store(uint64(lsn)) }

// lagged records the replication lag.
func (l *live) lagged(d time.Duration) { l.lag.Store(int64(d)) }

// useRouter records the router in use (nil: none).
func (l *live) useRouter(rt *router.Router) { l.router.Store(rt) }
