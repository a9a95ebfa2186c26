package relay

// beat.go: the heartbeat's wiring: WAL nudges in the source database and,
// when a topic is set, heartbeat records through a Kafka client of its own.

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/slot"
)

// beater builds the heartbeat: WAL nudges in the source database and, when
// a topic is set, heartbeat records through hb.
func (r *Relay) beater(hb *heartbeatProducer) *heartbeat.Beater {
	return heartbeat.NewBeater(heartbeat.BeaterConfig{
		Interval: r.cfg.HeartbeatInterval,
		URL:      r.cfg.PGURL,
		Query:    r.cfg.HeartbeatQuery,
		Topic:    r.cfg.HeartbeatTopic,
		// Named, so that walrelay status --explain sees the heartbeat.
		// On a standby, the primary (whichever it is now): the standby's
		// decoding sees the heartbeat once it replays it.
		Connect: func(ctx context.Context, _ string) (*pgx.Conn, error) {
			conn, err := slot.Connect(ctx, r.live.writeURL(r.cfg))
			if err == nil && defaultAppName(ctx, conn) {
				if err := nameConn(ctx, conn, doctor.HeartbeatAppName(r.cfg.Slot)); err != nil {
					conn.Close(context.Background())
					return nil, err
				}
			}
			return conn, err
		},
		Status: func() heartbeat.Status {
			return heartbeat.Status{
				Slot:         r.cfg.Slot,
				Time:         time.Now().UTC(),
				Streaming:    r.live.streaming.Load(),
				ConfirmedLSN: r.progress.Confirmed().String(),
				ReceivedLSN:  decoder.LSN(r.live.received.Load()).String(),
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
