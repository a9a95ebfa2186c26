// Package metrics defines walrelay's Prometheus metrics. The names are a
// public interface (dashboards and alerts depend on them): add, never
// rename.
//
// There is no global registry: New registers everything on the registerer it
// is given as it builds it (promauto.With), so tests and several relays in
// one process do not collide, and a metric cannot be built and forgotten.
// State that is derived from other state (walrelay_ready) is a GaugeFunc
// read at scrape time, never set from the places that change it.
package metrics

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	dto "github.com/prometheus/client_model/go"
)

// Metrics holds every collector walrelay updates.
type Metrics struct {
	EventsPublished       *prometheus.CounterVec
	EventsDeadLettered    *prometheus.CounterVec
	Transactions          prometheus.Counter
	ProduceErrors         prometheus.Counter
	KafkaDenied           *prometheus.CounterVec
	ReceivedLSN           prometheus.Gauge
	ConfirmedLSN          prometheus.Gauge
	ServerWALEndLSN       prometheus.Gauge
	SlotRetainedWAL       prometheus.Gauge
	SlotLag               prometheus.Gauge
	ReplicationLag        prometheus.Gauge
	CommitToAck           prometheus.Histogram
	InflightEvents        prometheus.Gauge
	Heartbeats            *prometheus.CounterVec
	StandbyStatusSent     prometheus.Counter
	StreamRestarts        *prometheus.CounterVec
	Streaming             prometheus.Gauge
	ReceivedBytes         prometheus.Counter
	SlotSafeWALSize       *OptionalGauge
	SlotWALStatus         *prometheus.GaugeVec
	Ready                 prometheus.GaugeFunc
	KafkaTransactions     prometheus.Counter
	KafkaCommit           prometheus.Histogram
	KafkaMarkerWait       prometheus.Histogram
	KafkaTxnProducers     prometheus.Gauge
	UnmappedInserts       *prometheus.CounterVec
	SnapshotRows          prometheus.Counter
	SnapshotRunning       prometheus.Gauge
	SlotFailover          prometheus.Gauge
	SlotFailoverProtected prometheus.Gauge
	GapRefusals           prometheus.Counter
	UnconfirmedCommits    prometheus.Counter
	HangingAborted        prometheus.Counter
	SlotCreationWait      prometheus.Gauge
	TraceSpansDropped     *prometheus.CounterVec
	SchemaReads           *prometheus.CounterVec
	DeliveryHeld          *prometheus.GaugeVec

	// What holds the slot (doctor.Facts), read with the slot every
	// relay.Config.SlotPollInterval.
	ServerWALRate               prometheus.Gauge
	SlotTimeToInvalidation      *OptionalGauge
	SlotRestartLag              prometheus.Gauge
	SlotCatalogXminAge          prometheus.Gauge
	SourceOldestXactAge         prometheus.Gauge
	SourcePreparedXacts         prometheus.Gauge
	SourceOldestPreparedXactAge prometheus.Gauge
	SourceOldestSlotRetainedWAL prometheus.Gauge
	SourceReplicationXminAge    prometheus.Gauge
	StandbyReplayLagBytes       *OptionalGauge
	StandbyReplayLagSeconds     *OptionalGauge
	StandbyReplayPaused         *OptionalGauge
	StandbyPrimaryReachable     *OptionalGauge

	ready atomic.Pointer[func() error] // what walrelay_ready reports; see SetReadiness
}

// OptionalGauge is a gauge exported only while it has a value: a figure
// PostgreSQL does not have (safe_wal_size without max_slot_wal_keep_size)
// must be absent, not 0, or every alert on a low value fires.
type OptionalGauge struct {
	g   prometheus.Gauge
	set atomic.Bool
}

// optional registers g on reg, exported only once set.
func optional(reg prometheus.Registerer, g prometheus.Gauge) *OptionalGauge {
	o := &OptionalGauge{g: g}
	if reg != nil {
		reg.MustRegister(o)
	}
	return o
}

// Set gives the gauge a value, exporting it.
func (o *OptionalGauge) Set(v float64) { o.g.Set(v); o.set.Store(true) }

// Clear stops exporting the gauge.
func (o *OptionalGauge) Clear() { o.set.Store(false) }

// Value is the gauge's value, and whether it has one.
func (o *OptionalGauge) Value() (float64, bool) {
	var d dto.Metric
	_ = o.g.Write(&d) // a gauge's Write cannot fail
	return d.GetGauge().GetValue(), o.set.Load()
}

// Describe implements prometheus.Collector.
func (o *OptionalGauge) Describe(ch chan<- *prometheus.Desc) { o.g.Describe(ch) }

// Collect implements prometheus.Collector.
func (o *OptionalGauge) Collect(ch chan<- prometheus.Metric) {
	if o.set.Load() {
		o.g.Collect(ch)
	}
}

// New creates the metrics and registers them on reg.
func New(reg prometheus.Registerer) *Metrics {
	f := promauto.With(reg)
	m := &Metrics{}
	*m = Metrics{
		EventsPublished: f.NewCounterVec(prometheus.CounterOpts{
			Name: "walrelay_events_published_total",
			Help: "Outbox events acknowledged by Kafka, by topic (topics past router.Config.MaxTopicSeries under topic=\"other\"). Flat while walrelay_inflight_events is high means the broker is not accepting writes.",
		}, []string{"topic"}),
		EventsDeadLettered: f.NewCounterVec(prometheus.CounterOpts{
			Name: "walrelay_events_dead_lettered_total",
			Help: "Outbox events sent to the dead-letter topic instead of their own, by reason. Any increase means a writer produced an invalid outbox row (or, reason unmappable, a mapped column was dropped or renamed): inspect the dead-letter topic.",
		}, []string{"reason"}),
		Transactions: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_transactions_total",
			Help: "PostgreSQL transactions received from the replication slot (committed ones only).",
		}),
		ProduceErrors: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_produce_errors_total",
			Help: "Records Kafka refused after the producer's retries; each one restarts the stream from the last confirmed LSN. Check broker health and ACLs.",
		}),
		KafkaDenied: f.NewCounterVec(prometheus.CounterOpts{
			Name: "walrelay_kafka_authorization_denied_total",
			Help: "Times Kafka's authorizer denied the relay an operation it needs, by resource (topic, transactional id, cluster) and operation (WRITE, DESCRIBE, IDEMPOTENT_WRITE): a topic check, a producer's first refused record, a transactional call. The relay waits meanwhile (not ready, nothing confirmed past the event) and resumes by itself once an ACL allows it; the log names the principal and the resource.",
		}, []string{"resource", "operation"}),
		ReceivedLSN: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_received_lsn",
			Help: "WAL position of the newest replication message received, as a number.",
		}),
		ConfirmedLSN: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_confirmed_lsn",
			Help: "WAL position last confirmed to PostgreSQL (everything before it is acknowledged by Kafka), as a number.",
		}),
		ServerWALEndLSN: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_server_wal_end_lsn",
			Help: "Server WAL end reported by the newest replication message, as a number.",
		}),
		SlotRetainedWAL: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_retained_wal_bytes",
			Help: "WAL the slot keeps on the server's disk (current LSN minus restart_lsn). Growing without bound fills the disk: check the relay is running and confirming.",
		}),
		SlotLag: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_lag_bytes",
			Help: "WAL between the server's current position and the slot's confirmed_flush_lsn.",
		}),
		ReplicationLag: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_replication_lag_seconds",
			Help: "Now minus the commit time of the newest confirmed transaction; 0 when nothing is in flight.",
		}),
		CommitToAck: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "walrelay_commit_to_ack_seconds",
			Help:    "Time from a transaction's commit in PostgreSQL to Kafka acknowledging its last event.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		InflightEvents: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_inflight_events",
			Help: "Events handed to the producer and not yet acknowledged. Pinned at the limit means Kafka is the bottleneck.",
		}),
		Heartbeats: f.NewCounterVec(prometheus.CounterOpts{
			Name: "walrelay_heartbeats_total",
			Help: "Heartbeats sent, by kind: wal (a WAL nudge in the source database) or kafka (a heartbeat record). Flat while enabled means the heartbeat fails: read the log.",
		}, []string{"kind"}),
		StandbyStatusSent: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_standby_status_updates_total",
			Help: "Standby status updates sent to PostgreSQL.",
		}),
		StreamRestarts: f.NewCounterVec(prometheus.CounterOpts{
			Name: "walrelay_stream_restarts_total",
			Help: "Replication stream restarts from the last confirmed LSN, by cause. A steady rate means a recurring fault: read the logs.",
		}, []string{"cause"}),
		Streaming: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_streaming",
			Help: "1 while the replication stream is open, 0 while connecting, waiting for the slot or backing off.",
		}),
		ReceivedBytes: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_received_bytes_total",
			Help: "Bytes of pgoutput messages received from the replication slot.",
		}),
		SlotSafeWALSize: optional(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_safe_wal_size_bytes",
			Help: "WAL that may still be written before the slot risks invalidation (pg_replication_slots.safe_wal_size); absent when max_slot_wal_keep_size is unlimited or the slot is lost. Near zero: the slot is about to be lost, get the relay confirming now.",
		})),
		StandbyReplayLagBytes: optional(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_standby_replay_lag_bytes",
			Help: "WAL the hot standby the relay decodes on received but has not replayed: decoding sees a commit only once replayed, so this adds to the relay's lag. Absent unless decoding on a standby.",
		})),
		StandbyReplayLagSeconds: optional(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_standby_replay_lag_seconds",
			Help: "How long ago the standby the relay decodes on replayed its last transaction, while it has received WAL it has not replayed (0 when caught up): the delay replay adds before the relay sees a commit. Absent unless decoding on a standby.",
		})),
		StandbyReplayPaused: optional(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_standby_replay_paused",
			Help: "1 while replay is paused on the standby the relay decodes on (pg_is_wal_replay_paused(); resume with SELECT pg_wal_replay_resume()): nothing new reaches the relay. Absent unless decoding on a standby.",
		})),
		StandbyPrimaryReachable: optional(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_standby_primary_reachable",
			Help: "1 when the relay, decoding on a hot standby, reached the primary relay.Config.PrimaryURL names at its last slot poll and found it taking writes; 0 when not: its heartbeat and record are not written (decoding goes on with what the standby replays). 0 after a failover of the primary: repoint relay.Config.PrimaryURL to the new primary, or give a multi-host URL with target_session_attrs=read-write. Absent unless decoding on a standby.",
		})),
		SlotWALStatus: f.NewGaugeVec(prometheus.GaugeOpts{
			Name: "walrelay_slot_wal_status",
			Help: "1 for the slot's current wal_status (reserved, extended, unreserved, lost), 0 for the others. lost means the slot was invalidated and events are gone from it.",
		}, []string{"status"}),
		Ready: f.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "walrelay_ready",
			Help: "1 while the relay is streaming and its replication lag is under the readiness threshold (what /readyz reports).",
		}, m.readyValue),
		KafkaTransactions: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_kafka_transactions_total",
			Help: "Kafka transactions committed (exactly-once delivery only), each with a checkpoint record.",
		}),
		KafkaCommit: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "walrelay_kafka_commit_seconds",
			Help:    "Exactly-once: time to close a Kafka transaction (wait for its records, produce the checkpoint, commit), successful or not. It is most of the latency exactly-once adds; rising towards router.Config.TransactionTimeout means the broker's transaction coordinator struggles.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		KafkaMarkerWait: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "walrelay_kafka_marker_wait_seconds",
			Help:    "Exactly-once: how long the first record of a Kafka transaction waited for the transaction coordinator to complete the previous commit (write its markers; 0 when it was complete already), so that the broker does not hold the record for its CONCURRENT_TRANSACTIONS retry. With walrelay_kafka_commit_seconds it is most of each Kafka transaction's cycle; high, it is the broker's time.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		KafkaTxnProducers: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_kafka_transactional_producers",
			Help: "Exactly-once: transactional producers taking turns in the session (router.Config.TxnProducers; 1 when Kafka denied the second id, with a warning naming the ACL to add); 0 before the transactional ids are taken.",
		}),
		UnmappedInserts: f.NewCounterVec(prometheus.CounterOpts{
			Name: "walrelay_unmapped_inserts_total",
			Help: "Inserts the publication streamed for a table that is not a configured outbox table (relay.Config.Tables), by table. One the publication lists by name stops the relay before the slot moves past it; those of a table only FOR ALL TABLES or TABLES IN SCHEMA covers, or no longer in the publication, are not published.",
		}, []string{"table"}),
		SnapshotRows: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_snapshot_rows_total",
			Help: "Rows read by snapshots (the initial snapshot when walrelay creates the slot, or relay.PublishSnapshot) and handed to Kafka. Rows of a snapshot interrupted by a crash are counted again when it is redone.",
		}),
		SlotFailover: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_failover",
			Help: "1 when the slot is a failover slot (PostgreSQL 17+), which standbys with sync_replication_slots keep a copy of; 0 when a failover of the primary loses it.",
		}),
		SlotFailoverProtected: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_failover_protected",
			Help: "1 when a promoted standby keeps the slot, verified: a failover slot, synchronized_standby_slots naming only standbys that stream, and on every standby (read through relay.Config.StandbyURLs) a copy that slot synchronization keeps current (synced = true). 0 otherwise: a failover can lose the slot or events, or resume from a stale copy and send events again; also 0 when walrelay was not given the standbys' URLs, since the primary cannot see their copies.",
		}),
		UnconfirmedCommits: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_kafka_unconfirmed_commits_total",
			Help: "Exactly-once: sessions that resent events after a Kafka commit whose outcome was not confirmed (a broker lost during the commit) and that, read back, did not land on every partition (or could not be read), rather than skip them on a newer checkpoint's word; read_committed consumers may see some of those events twice.",
		}),
		HangingAborted: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_kafka_hanging_transactions_aborted_total",
			Help: "Exactly-once: partitions on which the relay aborted its own Kafka transaction that the transaction coordinator had left open after a commit whose outcome was not confirmed (it skips the markers of a partition whose leader it cannot find, as when a broker restarts): their events are resent once rather than committed twice or lost. Rising: brokers restarting during commits.",
		}),
		SchemaReads: f.NewCounterVec(prometheus.CounterOpts{
			Name: "walrelay_schema_registry_reads_total",
			Help: "Reads of a subject's schema from the schema registry (relay.Config.Values), by result: ok, invalid (no such subject or version, or a schema that does not compile: its events are dead-lettered) or error (the registry did not answer: the subject's events wait, and the slot is not confirmed past them). A rising error count is a registry outage delaying delivery.",
		}, []string{"result"}),
		GapRefusals: f.NewCounter(prometheus.CounterOpts{
			Name: "walrelay_gap_refusals_total",
			Help: "Times the relay stopped because something it streamed from changed under it (slot gone, publication dropped or altered, outbox table recreated or removed from the publication): events after the confirmed position may be missing. The log names the change and the command that accepts the gap.",
		}),
		SlotCreationWait: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_creation_wait_seconds",
			Help: "How long creating the slot has waited for transactions to end (PostgreSQL creates a logical slot only once every transaction that held an xid when the creation began has ended, prepared ones included), updated every relay.Config.SlotPollInterval; 0 when no creation waits. The relay's WARN, and doctor.StatusOptions.Explain, name them.",
		}),
		ServerWALRate: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_server_wal_bytes_per_second",
			Help: "WAL the source server writes per second, measured over the last 5 minutes of slot polls (its current LSN). With walrelay_slot_safe_wal_size_bytes it says how long the slot lasts without a relay confirming.",
		}),
		SlotTimeToInvalidation: optional(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_time_to_invalidation_seconds",
			Help: "Seconds until max_slot_wal_keep_size invalidates the slot if it stops moving now, at the current WAL rate (safe_wal_size / walrelay_server_wal_bytes_per_second): the relay outage the slot survives, or, while it is stuck, the time left. +Inf while no WAL is written; absent when max_slot_wal_keep_size is unlimited.",
		})),
		SlotRestartLag: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_restart_lag_bytes",
			Help: "WAL the slot keeps beyond what the relay confirmed (confirmed_flush_lsn minus restart_lsn). Growing while the slot lag is small: an open or prepared transaction holds the slot (doctor.StatusOptions.Explain names it).",
		}),
		SlotCatalogXminAge: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_slot_catalog_xmin_age",
			Help: "Transactions since the slot's catalog_xmin (age()): catalog rows vacuum keeps for the slot. It grows while an open transaction or a stopped relay holds the slot.",
		}),
		SourceOldestXactAge: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_source_oldest_xact_age_seconds",
			Help: "Age of the oldest open transaction with an xid on the source cluster (any database; 0 when none, or when only other roles' transactions are open and the role lacks pg_read_all_stats). Such a transaction holds every logical slot's restart_lsn and catalog_xmin until it ends.",
		}),
		SourcePreparedXacts: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_source_prepared_xacts",
			Help: "Prepared transactions on the source cluster (pg_prepared_xacts): each holds the slot like an open transaction until COMMIT PREPARED or ROLLBACK PREPARED, across restarts.",
		}),
		SourceOldestPreparedXactAge: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_source_oldest_prepared_xact_age_seconds",
			Help: "Age of the oldest prepared transaction on the source cluster; 0 when none.",
		}),
		SourceOldestSlotRetainedWAL: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_source_oldest_slot_retained_wal_bytes",
			Help: "WAL the source server keeps for its oldest replication slot, this one or another (pg_wal keeps WAL for the oldest). Far above walrelay_slot_retained_wal_bytes: another slot fills the disk (doctor.StatusOptions.Explain names it).",
		}),
		SourceReplicationXminAge: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_source_replication_xmin_age",
			Help: "Transactions since the oldest xmin or catalog_xmin another replication slot or a standby's hot_standby_feedback holds (0 when none): rows vacuum keeps for them. It does not hold this slot.",
		}),
		TraceSpansDropped: f.NewCounterVec(prometheus.CounterOpts{
			Name: "walrelay_trace_spans_dropped_total",
			Help: "Spans of the OpenTelemetry tracing (on through the OTEL_* variables) not exported, by reason: queue_full (the export queue, OTEL_BSP_MAX_QUEUE_SIZE, default 16384, was full: the collector is slow or down; the log says so once per streak of drops, with the count), export_failed (the collector refused them or could not be reached before OTEL_BSP_EXPORT_TIMEOUT), shutdown (still queued when walrelay stopped). Events are never held back or lost for them: rising means gaps in the traces, check the collector.",
		}, []string{"reason"}),
		DeliveryHeld: f.NewGaugeVec(prometheus.GaugeOpts{
			Name: "walrelay_delivery_held",
			Help: "1 while a dependency holds delivery, by dependency (kafka, kafka_authorization, token_source, schema_registry, postgresql, standby_replay, publication_watch) and reason (one CamelCase word: Unreachable, NotAnswering, NotAcknowledging, Denied, Expired, Paused, Lagging…); 0, with an empty reason, for a dependency that holds nothing. What readiness and the relay's /status report, from the same place: the log has one WARN when a hold starts (its message names the cause and the fix) and one when it ends.",
		}, []string{"dependency", "reason"}),
		SnapshotRunning: f.NewGauge(prometheus.GaugeOpts{
			Name: "walrelay_snapshot_running",
			Help: "1 while a snapshot is read and published; the stream starts after it. Stuck at 1 with walrelay_inflight_events at its limit means Kafka is the bottleneck.",
		}),
	}
	for _, reason := range []string{DropQueueFull, DropExportFailed, DropShutdown} {
		m.TraceSpansDropped.WithLabelValues(reason) // export zeros: alerts see the series
	}
	return m
}

// The reasons of walrelay_trace_spans_dropped_total.
const (
	DropQueueFull    = "queue_full"
	DropExportFailed = "export_failed"
	DropShutdown     = "shutdown"
)

// SetReadiness makes walrelay_ready report ready: 1 when it returns nil,
// else 0 (also before any is set).
func (m *Metrics) SetReadiness(ready func() error) { m.ready.Store(&ready) }

func (m *Metrics) readyValue() float64 {
	if p := m.ready.Load(); p != nil && (*p)() == nil {
		return 1
	}
	return 0
}

// NewUnregistered returns metrics registered nowhere, for tools and tests
// that do not serve them.
func NewUnregistered() *Metrics { return New(prometheus.NewRegistry()) }
