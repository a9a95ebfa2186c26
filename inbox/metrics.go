package inbox

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	processed, duplicates, failures, dbErrors, pruned, rewinds *prometheus.CounterVec
	deadLettered                                               *prometheus.CounterVec
	lag                                                        *prometheus.GaugeVec
	batchRecords                                               *prometheus.HistogramVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		processed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inbox_processed_total",
			Help: "Records whose handler transaction committed (one effect each)."}, []string{"consumer"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inbox_duplicates_total",
			Help: "Records skipped because their id was already in the inbox: redeliveries, expected after relay or consumer restarts; a steady rise means offsets are not being committed."}, []string{"consumer"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inbox_handler_failures_total",
			Help: "Handler errors (each failed attempt); read the consumer's log for the error, the record is retried and then dead-lettered."}, []string{"consumer"}),
		dbErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inbox_database_errors_total",
			Help: "Inbox transactions that failed for a database reason (retried without counting an attempt): check PostgreSQL if it keeps rising."}, []string{"consumer"}),
		deadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inbox_dead_lettered_total",
			Help: "Records sent to the dead-letter topic, by reason (handler-failed, no-id); inspect and replay them from that topic."}, []string{"consumer", "reason"}),
		rewinds: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inbox_rewinds_total",
			Help: "Times a partition's position in the database was not where this consumer left it, so it re-read the partition from the database's position: after a database failover that lost committed transactions, or another member that handled the partition meanwhile."}, []string{"consumer"}),
		pruned: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inbox_pruned_rows_total",
			Help: "Inbox rows deleted by retention."}, []string{"consumer"}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "inbox_lag_records",
			Help: "Records in the partition after the last one handled, as of the last fetch; a growing value means the handler cannot keep up."}, []string{"consumer", "topic", "partition"}),
		batchRecords: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "inbox_batch_records",
			Help:    "Records per committed transaction (a batch of one partition's records): near 1 when the consumer keeps up, near Config.MaxBatchRecords when it catches up.",
			Buckets: []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000}}, []string{"consumer"}),
	}
	if reg == nil {
		return m
	}
	m.processed = register(reg, m.processed)
	m.duplicates = register(reg, m.duplicates)
	m.failures = register(reg, m.failures)
	m.dbErrors = register(reg, m.dbErrors)
	m.deadLettered = register(reg, m.deadLettered)
	m.pruned = register(reg, m.pruned)
	m.rewinds = register(reg, m.rewinds)
	m.lag = register(reg, m.lag)
	m.batchRecords = register(reg, m.batchRecords)
	return m
}

// register registers c, or returns the collector already registered under
// its name, so that several consumers can share a registry (the consumer
// label tells them apart).
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		panic("inbox: register metrics: " + err.Error())
	}
	return c
}
