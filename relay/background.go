package relay

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
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
// a topic is set, heartbeat records through the current producer.
func (r *Relay) beater() *heartbeat.Beater {
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
		Produce: func(ctx context.Context, topic string, key, value []byte) error {
			rt := r.router.Load()
			if rt == nil {
				return errors.New("no producer: Kafka is not connected")
			}
			return rt.ProduceHeartbeat(ctx, topic, key, value)
		},
	}, r.log.Named("heartbeat"), r.metrics)
}
