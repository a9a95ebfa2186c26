// Package heartbeat keeps a replication slot moving and shows the relay is
// alive, however quiet the outbox is: a Beater, every Interval, nudges WAL
// in the source database (pg_logical_emit_message, or a configured query,
// like Debezium's heartbeat.action.query), so that a slot on an idle
// database advances while only other databases of the cluster write, and
// optionally produces a heartbeat record to Kafka so that consumers can see
// the relay is alive. The nudge reaches the relay's stream as a logical
// decoding message, a marker of package confirm; when status updates go out
// is package confirm's too (Schedule).
package heartbeat

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/metrics"
)

// MessagePrefix is the logical decoding message prefix of walrelay's WAL
// nudges.
const MessagePrefix = "walrelay.heartbeat"

// DefaultQuery writes a non-transactional logical decoding message: a few
// bytes of WAL that pgoutput forwards to the slot's client, which confirms
// its position once everything before it is acknowledged. It needs no
// table and no privilege beyond the REPLICATION the relay already has.
const DefaultQuery = "SELECT pg_logical_emit_message(false, '" + MessagePrefix + "', now()::text)"

// Kind is what a heartbeat was: the kind label of
// walrelay_heartbeats_total.
type Kind string

const (
	// KindWAL is a WAL nudge in the source database.
	KindWAL Kind = "wal"
	// KindKafka is a heartbeat record produced to the heartbeat topic.
	KindKafka Kind = "kafka"
)

// Kinds lists every Kind (a new slice each call).
func Kinds() []Kind { return []Kind{KindWAL, KindKafka} }

// Status is what a heartbeat record reports.
type Status struct {
	Slot         string    `json:"slot"`
	Time         time.Time `json:"time"`
	Streaming    bool      `json:"streaming"`
	ConfirmedLSN string    `json:"confirmed_lsn"`
	ReceivedLSN  string    `json:"received_lsn,omitempty"`
}

// BeaterConfig configures a Beater.
type BeaterConfig struct {
	// Interval between heartbeats; 0 disables the Beater.
	Interval time.Duration
	// URL of the source database, for the WAL nudge.
	URL string
	// Query is the nudge; empty means DefaultQuery. "-" disables the
	// nudge (heartbeat records only).
	Query string
	// Topic receives a heartbeat record every Interval; empty disables.
	Topic string
	// Connect opens the nudge's connection (slot.Connect: it keeps the
	// password out of errors).
	Connect func(ctx context.Context, url string) (*pgx.Conn, error)
	// Status reports the relay's state for heartbeat records.
	Status func() Status
	// Produce sends a heartbeat record (value JSON of Status, key the slot
	// name) and returns once Kafka acknowledged it.
	Produce func(ctx context.Context, topic string, key, value []byte) error
}

// Beater sends WAL nudges and heartbeat records.
type Beater struct {
	cfg     BeaterConfig
	log     *zap.Logger
	metrics *metrics.Metrics
	conn    *pgx.Conn
	// nudgeFails and recordFails are the failures in a row of each kind.
	nudgeFails, recordFails failStreak
}

// FailureWarnEvery is how often a heartbeat failure that lasts is logged
// at WARN again: a server that stays unreachable (a primary gone in a
// failover) would otherwise log a line every beat, burying what else the
// log says; walrelay_heartbeats_total staying flat shows it meanwhile.
const FailureWarnEvery = 5 * time.Minute

// failStreak is a run of failures of one kind of heartbeat.
type failStreak struct {
	n      int
	warned time.Time
}

// failed logs err: at WARN when the streak is new or was last warned of
// FailureWarnEvery ago, else at DEBUG.
func (f *failStreak) failed(log *zap.Logger, msg string, now time.Time, err error, fields ...zap.Field) {
	f.n++
	fields = append(fields, zap.Int("failures_in_a_row", f.n), zap.Error(err))
	if f.n == 1 || now.Sub(f.warned) >= FailureWarnEvery {
		f.warned = now
		log.Warn(msg+"; retrying at every beat, logged again when it works or every "+FailureWarnEvery.String()+" while it fails", fields...)
		return
	}
	log.Debug(msg, fields...)
}

// worked ends a streak, saying so when there was one.
func (f *failStreak) worked(log *zap.Logger, msg string, fields ...zap.Field) {
	if f.n > 0 {
		log.Info(msg, append(fields, zap.Int("failures_in_a_row", f.n))...)
	}
	*f = failStreak{}
}

// NewBeater returns a Beater; Run it in a goroutine.
func NewBeater(cfg BeaterConfig, log *zap.Logger, m *metrics.Metrics) *Beater {
	if cfg.Query == "" {
		cfg.Query = DefaultQuery
	}
	return &Beater{cfg: cfg, log: log, metrics: m}
}

// Run beats every Interval until ctx ends. Failures are retried at the
// next beat, logged at the first of a run (failStreak): a heartbeat must
// never stop the relay.
func (b *Beater) Run(ctx context.Context) {
	if b.cfg.Interval <= 0 {
		return
	}
	defer func() {
		if b.conn != nil {
			b.conn.Close(context.Background())
		}
	}()
	t := time.NewTicker(b.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if b.cfg.Query != "-" {
			if err := b.nudge(ctx); err != nil && ctx.Err() == nil {
				b.nudgeFails.failed(b.log, "heartbeat WAL nudge failed", time.Now(), err)
			} else if err == nil {
				b.nudgeFails.worked(b.log, "heartbeat WAL nudge works again")
				b.metrics.Heartbeats.WithLabelValues(string(KindWAL)).Inc()
			}
		}
		if b.cfg.Topic != "" && b.cfg.Produce != nil {
			if err := b.record(ctx); err != nil && ctx.Err() == nil {
				b.recordFails.failed(b.log, "heartbeat record failed", time.Now(), err, zap.String("topic", b.cfg.Topic))
			} else if err == nil {
				b.recordFails.worked(b.log, "heartbeat record works again", zap.String("topic", b.cfg.Topic))
				b.metrics.Heartbeats.WithLabelValues(string(KindKafka)).Inc()
			}
		}
	}
}

func (b *Beater) nudge(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, max(b.cfg.Interval, 5*time.Second))
	defer cancel()
	if b.conn == nil || b.conn.IsClosed() {
		conn, err := b.cfg.Connect(ctx, b.cfg.URL)
		if err != nil {
			return err
		}
		b.conn = conn
	}
	if _, err := b.conn.Exec(ctx, b.cfg.Query); err != nil {
		b.conn.Close(context.Background())
		b.conn = nil
		return fmt.Errorf("heartbeat query %q: %w", b.cfg.Query, err)
	}
	return nil
}

func (b *Beater) record(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, max(b.cfg.Interval, 5*time.Second))
	defer cancel()
	st := b.cfg.Status()
	value, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return b.cfg.Produce(ctx, b.cfg.Topic, []byte(st.Slot), value)
}
