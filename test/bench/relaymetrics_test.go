package bench

import (
	"math"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// The figures a latency row takes from the relay's /metrics: a counter
// summed over its labels, a histogram as its _sum and _count, and the
// per-transaction means between two scrapes.
func TestScrapeRelayCycleMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	cpu := promauto.With(reg).NewCounter(prometheus.CounterOpts{Name: "process_cpu_seconds_total"})
	commit := promauto.With(reg).NewHistogram(prometheus.HistogramOpts{Name: "walrelay_kafka_commit_seconds", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)})
	restarts := promauto.With(reg).NewCounterVec(prometheus.CounterOpts{Name: "walrelay_stream_restarts_total"}, []string{"cause"})
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")

	restarts.WithLabelValues("a").Add(2)
	restarts.WithLabelValues("b").Add(3)
	from, err := scrapeRelay(addr)
	if err != nil {
		t.Fatal(err)
	}
	if got := from.values["walrelay_stream_restarts_total"]; got != 5 {
		t.Errorf("a counter over two labels read %v, want 5", got)
	}
	cpu.Add(0.5)
	commit.Observe(0.002)
	commit.Observe(0.004)
	commit.Observe(0.030) // a stall
	to, err := scrapeRelay(addr)
	if err != nil {
		t.Fatal(err)
	}
	to.at = from.at.Add(time.Second)
	m := map[string]float64{}
	cycleMetrics(m, from, to)
	if got := m["relay_cpu_percent"]; math.Abs(got-50) > 1e-9 {
		t.Errorf("relay_cpu_percent = %v, want 50", got)
	}
	if got := m["commit_ms_per_txn"]; math.Abs(got-12) > 1e-9 {
		t.Errorf("commit_ms_per_txn = %v, want 12", got)
	}
	if got := m["commits_over_16ms"]; got != 1 {
		t.Errorf("commits_over_16ms = %v, want 1", got)
	}
	if _, ok := m["marker_wait_ms_per_txn"]; ok {
		t.Error("marker_wait_ms_per_txn set with no marker wait observed")
	}
}
