package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// walStatuses are the values pg_replication_slots.wal_status takes.
var walStatuses = []string{"reserved", "extended", "unreserved", "lost"}

// watchSlot reads the slot's row every SlotPollInterval for the slot
// metrics, and stops the relay (through stop) when the slot is invalidated:
// its missing WAL cannot be streamed, and recreating it would skip events.
// It also moves the record's confirmed position forward, so that a
// refusal after a failover names a recent one; reads what holds the slot
// (doctor.Facts) for the metrics; names its connection after what the relay
// does, for walrelay status --explain; and warns once, when it first
// knows, that a setting of the server could invalidate the slot during a
// relay outage of PlannedOutage.
func (r *Relay) watchSlot(ctx context.Context, stop context.CancelCauseFunc) {
	var conn *pgx.Conn
	var recorded decoder.LSN
	w := &slotWatch{}
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
			w.named, w.nameable = "", conn != nil && defaultAppName(ctx, conn)
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
				if info.Invalidated() {
					gap := doctor.ReadInvalidatedError(ctx, conn, info, r.Confirmed())
					r.refuse(ctx, conn, gap)
					stop(gap)
					return
				}
				r.nameWatch(ctx, conn, w, info)
				r.recordFacts(ctx, conn, w, info)
				if f, err := doctor.ReadFailover(ctx, conn, info, r.cfg.StandbyURLs); err == nil {
					r.recordFailover(f)
				}
				if c := r.Confirmed(); c > recorded {
					if after, err := source.RecordConfirmed(ctx, conn, r.cfg.RecordSchema, r.cfg.Slot, c); err != nil {
						if ctx.Err() == nil {
							r.log.Warn("cannot move walrelay's record forward; a refusal after a failover would name an older position", zap.Error(err))
						}
					} else {
						recorded = after
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

// slotWatch is what watchSlot keeps between polls.
type slotWatch struct {
	// samples are the server's WAL position at the polls of the last
	// rateWindow, oldest first.
	samples []walSample
	// named is the state the connection is named after; nameable is
	// false when --pg-url set an application_name of its own.
	named    string
	nameable bool
	// acks counts what Kafka acknowledged at the last poll.
	acks     float64
	acksSeen bool
	// warned* are the startup warnings already logged.
	warnedIdle, warnedKeep, warnedFacts bool
}

type walSample struct {
	at  time.Time
	lsn decoder.LSN
}

// rateWindow is how much history the WAL rate is measured over.
const rateWindow = 5 * time.Minute

// rate adds the server's WAL position at the poll and returns the WAL
// rate in bytes per second over the window, and whether it is known
// (two polls apart in time).
func (w *slotWatch) rate(info slot.Info) (float64, bool) {
	w.samples = append(w.samples, walSample{info.Now, info.CurrentLSN})
	for len(w.samples) > 2 && info.Now.Sub(w.samples[1].at) >= rateWindow {
		w.samples = w.samples[1:]
	}
	first := w.samples[0]
	dt := info.Now.Sub(first.at).Seconds()
	if dt <= 0 || info.CurrentLSN < first.lsn {
		if info.CurrentLSN < first.lsn {
			w.samples = w.samples[len(w.samples)-1:] // a new server (a failover): start again
		}
		return 0, false
	}
	return float64(info.CurrentLSN-first.lsn) / dt, true
}

// relayState is what the relay does, in the words status reads back from
// the watch connection's name (doctor.Relay*).
func (r *Relay) relayState(info slot.Info, w *slotWatch) string {
	rt := r.router.Load()
	if !r.Streaming() {
		switch {
		case info.Active:
			return doctor.RelayStandby
		case !r.everStreamed.Load():
			return doctor.RelayStarting
		case rt == nil:
			return doctor.RelayConnectingKafka
		default:
			return doctor.RelayRestarting
		}
	}
	if rt == nil {
		return doctor.RelayStreaming
	}
	acks := sumCounter(r.metrics.EventsPublished) + sumCounter(r.metrics.EventsDeadLettered)
	stuck := w.acksSeen && acks == w.acks
	w.acks, w.acksSeen = acks, true
	switch n := rt.Inflight(); {
	case n >= r.cfg.Router.MaxInflightEvents:
		return doctor.RelayBackpressure
	case n > 0 && stuck:
		return doctor.RelayWaitingForKafka
	}
	return doctor.RelayStreaming
}

// sumCounter adds up a counter vector's series.
func sumCounter(v *prometheus.CounterVec) float64 {
	ch := make(chan prometheus.Metric, 16)
	go func() {
		v.Collect(ch)
		close(ch)
	}()
	var sum float64
	for m := range ch {
		var d dto.Metric
		if m.Write(&d) == nil {
			sum += d.GetCounter().GetValue()
		}
	}
	return sum
}

// defaultAppName reports whether conn carries walrelay's default
// application_name: one --pg-url sets is the operator's, and kept.
func defaultAppName(ctx context.Context, conn *pgx.Conn) bool {
	var name string
	return conn.QueryRow(ctx, "SELECT current_setting('application_name')").Scan(&name) == nil && name == "walrelay"
}

// nameConn sets conn's application_name, unless --pg-url chose one.
func nameConn(ctx context.Context, conn *pgx.Conn, name string) error {
	_, err := conn.Exec(ctx, "SELECT set_config('application_name', $1, false)", name)
	return err
}

// nameWatch names the watch connection after the relay's state, so that
// pg_stat_activity (and walrelay status --explain) shows what the relay
// does: PostgreSQL alone cannot tell a relay waiting for Kafka from one
// that is gone.
func (r *Relay) nameWatch(ctx context.Context, conn *pgx.Conn, w *slotWatch, info slot.Info) {
	state := r.relayState(info, w)
	if !w.nameable || state == w.named {
		return
	}
	if err := nameConn(ctx, conn, doctor.RelayAppName(r.cfg.Slot, state)); err == nil {
		w.named = state
	}
}

// recordFacts sets the metrics of what holds the slot and of the time it
// has left, and logs the startup warnings once it knows enough.
func (r *Relay) recordFacts(ctx context.Context, conn *pgx.Conn, w *slotWatch, info slot.Info) {
	m := r.metrics
	rate, known := w.rate(info)
	if known {
		m.ServerWALRate.Set(rate)
	}
	switch {
	case info.SafeWALSize == nil:
		m.SlotTimeToInvalidation.Clear()
	case known && rate > 0:
		m.SlotTimeToInvalidation.Set(float64(*info.SafeWALSize) / rate)
	case known:
		m.SlotTimeToInvalidation.Set(math.Inf(1))
	}
	if info.ConfirmedLSN > info.RestartLSN && info.RestartLSN != 0 {
		m.SlotRestartLag.Set(float64(info.ConfirmedLSN - info.RestartLSN))
	} else {
		m.SlotRestartLag.Set(0)
	}
	if info.CatalogXminAge != nil {
		m.SlotCatalogXminAge.Set(float64(*info.CatalogXminAge))
	}
	f, err := doctor.ReadFacts(ctx, conn, info)
	if err != nil {
		if ctx.Err() == nil && !w.warnedFacts {
			w.warnedFacts = true
			r.log.Warn("cannot read what holds the slot (pg_stat_activity, pg_locks, pg_prepared_xacts, pg_replication_slots); those metrics stay unset", zap.Error(err))
		}
		return
	}
	var oldest time.Duration
	for _, x := range f.Xacts {
		if x.Visible {
			oldest = max(oldest, x.Age)
		}
	}
	m.SourceOldestXactAge.Set(oldest.Seconds())
	m.SourcePreparedXacts.Set(float64(len(f.Prepared)))
	var prepared time.Duration
	for _, p := range f.Prepared {
		prepared = max(prepared, p.Age)
	}
	m.SourceOldestPreparedXactAge.Set(prepared.Seconds())
	retained, xminAge := info.RetainedWALBytes, int64(0)
	for _, o := range f.Slots {
		if o.WALStatus == "lost" {
			continue
		}
		retained = max(retained, o.RetainedWALBytes)
		for _, a := range []*int64{o.XminAge, o.CatalogXminAge} {
			if a != nil {
				xminAge = max(xminAge, *a)
			}
		}
	}
	for _, s := range f.Standbys {
		xminAge = max(xminAge, s.XminAge)
	}
	m.SourceOldestSlotRetainedWAL.Set(float64(retained))
	m.SourceReplicationXminAge.Set(float64(xminAge))
	r.warnOutage(w, f.Settings, info, rate, known)
}

// warnOutage logs, once each, that idle_replication_slot_timeout or
// max_slot_wal_keep_size (at the WAL rate measured) would invalidate the
// slot during a relay outage of PlannedOutage: the slot would be lost,
// and events with it, before the relay is back.
func (r *Relay) warnOutage(w *slotWatch, s doctor.Settings, info slot.Info, rate float64, known bool) {
	plan := r.cfg.PlannedOutage
	if plan <= 0 {
		return
	}
	if d := s.IdleSlotTimeoutDur; d > 0 && d < plan && !w.warnedIdle {
		w.warnedIdle = true
		r.log.Warn(fmt.Sprintf("idle_replication_slot_timeout = %s invalidates the slot once no relay has streamed from it that long, less than the outage to plan for (relay.Config.PlannedOutage %s): after a longer outage the slot and the events it holds are lost. Set idle_replication_slot_timeout to 0 or above %s (ALTER SYSTEM SET idle_replication_slot_timeout = ...; SELECT pg_reload_conf())",
			s.IdleSlotTimeout, doctor.DurationText(plan), doctor.DurationText(plan)), zap.String("slot", r.cfg.Slot))
	}
	if info.SafeWALSize == nil || !known || rate <= 0 || w.warnedKeep {
		return
	}
	if left := time.Duration(float64(*info.SafeWALSize) / rate * float64(time.Second)); left < plan {
		w.warnedKeep = true
		r.log.Warn(fmt.Sprintf("max_slot_wal_keep_size = %s: at the server's WAL rate (%s/s over the last %s) the slot survives about %s without a relay confirming, less than the outage to plan for (relay.Config.PlannedOutage %s): after a longer outage it is invalidated and the events it holds are lost. Raise max_slot_wal_keep_size to at least %s if the disk holds it (or -1)",
			s.MaxSlotWALKeepSize, doctor.BytesText(int64(rate)), doctor.DurationText(info.Now.Sub(w.samples[0].at)), doctor.DurationText(left), doctor.DurationText(plan), doctor.BytesText(int64(rate*plan.Seconds()))),
			zap.String("slot", r.cfg.Slot), zap.Int64("safe_wal_size", *info.SafeWALSize))
	}
}

func (r *Relay) recordSlot(info slot.Info) {
	m := r.metrics
	m.SlotRetainedWAL.Set(float64(info.RetainedWALBytes))
	m.SlotLag.Set(float64(info.LagBytes))
	if info.SafeWALSize != nil {
		m.SlotSafeWALSize.Set(float64(*info.SafeWALSize))
	} else {
		m.SlotSafeWALSize.Clear()
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
		// Named, so that walrelay status --explain sees the heartbeat.
		Connect: func(ctx context.Context, url string) (*pgx.Conn, error) {
			conn, err := slot.Connect(ctx, url)
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
