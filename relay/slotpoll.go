package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/confirm"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// walStatuses are the values pg_replication_slots.wal_status takes.
var walStatuses = []string{"reserved", "extended", "unreserved", "lost"}

// slotPoller reads the slot's row of pg_replication_slots every
// SlotPollInterval, and what holds the slot, for the slot metrics and the
// name of its connection (what the relay does, for walrelay status
// --explain); it stops the relay when the slot is invalidated, and moves
// the record's confirmed position forward. Its state is its goroutine's.
type slotPoller struct {
	cfg      Config
	log      *zap.Logger
	metrics  *metrics.Metrics
	guard    *guard
	live     *live
	sup      *supervisor
	progress *confirm.Progress
	// replay is the standby_replay condition (package holds), held while
	// replay on the standby the relay decodes on is paused or lags.
	replay *holds.Condition
}

// watchSlot reads the slot's row every SlotPollInterval for the slot
// metrics, and stops the relay (through stop) when the slot is invalidated:
// its missing WAL cannot be streamed, and recreating it would skip events.
// It also moves the record's confirmed position forward, so that a
// refusal after a failover names a recent one; reads what holds the slot
// (doctor.Facts) for the metrics; names its connection after what the relay
// does, for walrelay status --explain; and warns once, when it first
// knows, that a setting of the server could invalidate the slot during a
// relay outage of PlannedOutage.
func (p *slotPoller) watchSlot(ctx context.Context, stop context.CancelCauseFunc) {
	var conn *pgx.Conn
	// wconn is where the record is written: the primary of a standby the
	// relay decodes on (which cannot write), else conn.
	var wconn *pgx.Conn
	var recorded decoder.LSN
	w := &slotWatch{}
	pw := &primaryWatch{}
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
		if wconn != nil {
			wconn.Close(context.Background())
		}
	}()
	t := time.NewTicker(p.cfg.SlotPollInterval)
	defer t.Stop()
	for {
		if conn == nil || conn.IsClosed() {
			c, err := slot.Connect(ctx, p.cfg.PGURL)
			if err != nil && ctx.Err() == nil {
				p.log.Warn("slot metrics: cannot connect; retrying", zap.Error(err))
			}
			conn = c
			w.named, w.nameable = "", conn != nil && defaultAppName(ctx, conn)
		}
		if conn != nil {
			info, err := slot.ReadInfo(ctx, conn, p.cfg.Slot)
			switch {
			case err != nil && ctx.Err() == nil && !errors.Is(err, slot.ErrNoSlot):
				p.log.Warn("slot metrics: reading pg_replication_slots failed; retrying", zap.Error(err))
				conn.Close(context.Background())
				conn = nil
			case err == nil:
				recordSlot(p.metrics, info)
				if info.Invalidated() {
					gap := doctor.ReadInvalidatedError(ctx, conn, info, p.progress.Confirmed())
					p.guard.refuse(ctx, conn, gap)
					stop(gap)
					return
				}
				p.nameWatch(ctx, conn, w, info)
				p.recordFacts(ctx, conn, w, info)
				if f, err := doctor.ReadFailover(ctx, conn, info, p.cfg.StandbyURLs); err == nil {
					f.DecodedHere = f.DecodedHere || f.Local != nil && p.cfg.PrimaryURL != ""
					p.guard.recordFailover(f)
				}
				p.watchStandby(ctx, conn)
				rconn := conn
				if url := p.live.writeURL(p.cfg); url != p.cfg.PGURL {
					// nil while the primary is unreachable, which
					// reachPrimary says once.
					wconn = p.reachPrimary(ctx, wconn, url, pw)
					rconn = wconn
				}
				if c := p.progress.Confirmed(); c > recorded && rconn != nil {
					if after, err := source.RecordConfirmed(ctx, rconn, p.cfg.RecordSchema, p.cfg.Slot, c); err != nil {
						if ctx.Err() == nil {
							pw.recordFailed(p.log, err)
						}
					} else {
						recorded = after
						pw.recordFails = 0
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
func (p *slotPoller) relayState(info slot.Info, w *slotWatch) string {
	rt := p.live.router.Load()
	if !p.live.streaming.Load() {
		switch {
		case info.Active:
			return doctor.RelayStandby
		case !p.sup.streamed.Load():
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
	acks := sumCounter(p.metrics.EventsPublished) + sumCounter(p.metrics.EventsDeadLettered)
	stuck := w.acksSeen && acks == w.acks
	w.acks, w.acksSeen = acks, true
	switch n := rt.Inflight(); {
	case n >= p.cfg.Router.MaxInflightEvents:
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
func (p *slotPoller) nameWatch(ctx context.Context, conn *pgx.Conn, w *slotWatch, info slot.Info) {
	state := p.relayState(info, w)
	if !w.nameable || state == w.named {
		return
	}
	if err := nameConn(ctx, conn, doctor.RelayAppName(p.cfg.Slot, state)); err == nil {
		w.named = state
	}
}

// recordFacts sets the metrics of what holds the slot and of the time it
// has left, and logs the startup warnings once it knows enough.
func (p *slotPoller) recordFacts(ctx context.Context, conn *pgx.Conn, w *slotWatch, info slot.Info) {
	m := p.metrics
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
			p.log.Warn("cannot read what holds the slot (pg_stat_activity, pg_locks, pg_prepared_xacts, pg_replication_slots); those metrics stay unset", zap.Error(err))
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
	p.warnOutage(w, f.Settings, info, rate, known)
}

// warnOutage logs, once each, that idle_replication_slot_timeout or
// max_slot_wal_keep_size (at the WAL rate measured) would invalidate the
// slot during a relay outage of PlannedOutage: the slot would be lost,
// and events with it, before the relay is back.
func (p *slotPoller) warnOutage(w *slotWatch, s doctor.Settings, info slot.Info, rate float64, known bool) {
	plan := p.cfg.PlannedOutage
	if plan <= 0 {
		return
	}
	if d := s.IdleSlotTimeoutDur; d > 0 && d < plan && !w.warnedIdle {
		w.warnedIdle = true
		p.log.Warn(fmt.Sprintf("idle_replication_slot_timeout = %s invalidates the slot once no relay has streamed from it that long, less than the outage to plan for (relay.Config.PlannedOutage %s): after a longer outage the slot and the events it holds are lost. Set idle_replication_slot_timeout to 0 or above %s (ALTER SYSTEM SET idle_replication_slot_timeout = ...; SELECT pg_reload_conf())",
			s.IdleSlotTimeout, doctor.DurationText(plan), doctor.DurationText(plan)), zap.String("slot", p.cfg.Slot))
	}
	if info.SafeWALSize == nil || !known || rate <= 0 || w.warnedKeep {
		return
	}
	if left := time.Duration(float64(*info.SafeWALSize) / rate * float64(time.Second)); left < plan {
		w.warnedKeep = true
		p.log.Warn(fmt.Sprintf("max_slot_wal_keep_size = %s: at the server's WAL rate (%s/s over the last %s) the slot survives about %s without a relay confirming, less than the outage to plan for (relay.Config.PlannedOutage %s): after a longer outage it is invalidated and the events it holds are lost. Raise max_slot_wal_keep_size to at least %s if the disk holds it (or -1)",
			s.MaxSlotWALKeepSize, doctor.BytesText(int64(rate)), doctor.DurationText(info.Now.Sub(w.samples[0].at)), doctor.DurationText(left), doctor.DurationText(plan), doctor.BytesText(int64(rate*plan.Seconds()))),
			zap.String("slot", p.cfg.Slot), zap.Int64("safe_wal_size", *info.SafeWALSize))
	}
}

func recordSlot(m *metrics.Metrics, info slot.Info) {
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
