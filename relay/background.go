package relay

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/slot"
)

// walStatuses are the values pg_replication_slots.wal_status takes.
var walStatuses = []string{"reserved", "extended", "unreserved", "lost"}

// watchSlot reads the slot's row every SlotPollInterval for the slot
// metrics, and stops the relay (through stop) when the slot is invalidated:
// its missing WAL cannot be streamed, and recreating it would skip events.
// It also moves the record's confirmed position forward, so that a
// refusal after a failover names a recent one.
func (r *Relay) watchSlot(ctx context.Context, stop context.CancelCauseFunc) {
	var conn *pgx.Conn
	var recorded decoder.LSN
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	t := time.NewTicker(r.cfg.SlotPollInterval)
	defer t.Stop()
	for {
		if conn == nil || conn.IsClosed() {
			c, err := slot.Connect(ctx, r.cfg.PGURL)
			if err != nil && ctx.Err() == nil {
				r.log.Warn("slot metrics: cannot connect; retrying", zap.Error(err))
			}
			conn = c
		}
		if conn != nil {
			info, err := slot.ReadInfo(ctx, conn, r.cfg.Slot)
			switch {
			case err != nil && ctx.Err() == nil && !errors.Is(err, slot.ErrNoSlot):
				r.log.Warn("slot metrics: reading pg_replication_slots failed; retrying", zap.Error(err))
				conn.Close(context.Background())
				conn = nil
			case err == nil:
				r.recordSlot(info)
				if info.WALStatus == "lost" {
					stop(slot.InvalidatedError(r.cfg.Slot))
					return
				}
				if f, err := slot.ReadFailover(ctx, conn, info); err == nil {
					r.recordFailover(f)
				}
				if c := r.Confirmed(); c > recorded {
					if err := slot.RecordConfirmed(ctx, conn, r.cfg.RecordSchema, r.cfg.Slot, c); err != nil && ctx.Err() == nil {
						r.log.Warn("cannot move walrelay's record forward; a refusal after a failover would name an older position", zap.Error(err))
					} else {
						recorded = c
					}
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (r *Relay) recordSlot(info slot.Info) {
	m := r.metrics
	m.SlotRetainedWAL.Set(float64(info.RetainedWALBytes))
	m.SlotLag.Set(float64(info.LagBytes))
	if info.SafeWALSize != nil {
		m.SlotSafeWALSize.Set(float64(*info.SafeWALSize))
	}
	for _, s := range walStatuses {
		v := 0.0
		if s == info.WALStatus {
			v = 1
		}
		m.SlotWALStatus.WithLabelValues(s).Set(v)
	}
}

// beater builds the heartbeat: WAL nudges in the source database and, when
// a topic is set, heartbeat records through hb.
func (r *Relay) beater(hb *heartbeatProducer) *heartbeat.Beater {
	return heartbeat.NewBeater(heartbeat.BeaterConfig{
		Interval: r.cfg.HeartbeatInterval,
		URL:      r.cfg.PGURL,
		Query:    r.cfg.HeartbeatQuery,
		Topic:    r.cfg.HeartbeatTopic,
		Connect:  slot.Connect,
		Status: func() heartbeat.Status {
			return heartbeat.Status{
				Slot:         r.cfg.Slot,
				Time:         time.Now().UTC(),
				Streaming:    r.Streaming(),
				ConfirmedLSN: r.Confirmed().String(),
				ReceivedLSN:  decoder.LSN(r.received.Load()).String(),
			}
		},
		Produce: hb.produce,
	}, r.log.Named("heartbeat"), r.metrics)
}

// heartbeatProducer produces heartbeat records through a Kafka client of
// its own, made on first use: a heartbeat is never part of an exactly-once
// Kafka transaction, and it is sent whether or not the events' producer is
// being replaced.
type heartbeatProducer struct {
	opts []kgo.Opt
	mu   sync.Mutex
	cl   *kgo.Client
}

func (h *heartbeatProducer) produce(ctx context.Context, topic string, key, value []byte) error {
	h.mu.Lock()
	if h.cl == nil {
		cl, err := kgo.NewClient(h.opts...)
		if err != nil {
			h.mu.Unlock()
			return err
		}
		h.cl = cl
	}
	cl := h.cl
	h.mu.Unlock()
	return cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Key: key, Value: value}).FirstErr()
}

func (h *heartbeatProducer) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cl != nil {
		h.cl.Close()
	}
}
