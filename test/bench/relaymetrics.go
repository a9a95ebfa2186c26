package bench

import (
	"net"
	"net/http"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// relaymetrics.go: the latency scenario reads the relay's own /metrics
// before and after its writers, to say where an exactly-once cycle goes
// (commit, wait for the markers) beside the broker-alone floor's figures
// (txnfloor), in the same run.

// freeAddr is a loopback address no one listens on, for the relay's
// --metrics-addr.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// relaySample is the relay's counters at one moment, each summed over its
// labels.
type relaySample struct {
	at     time.Time
	values map[string]float64
}

func scrapeRelay(addr string) (relaySample, error) {
	s := relaySample{at: time.Now(), values: map[string]float64{}}
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return s, err
	}
	// A histogram or summary counts as its _sum and _count, as exposed.
	for name, f := range families {
		for _, m := range f.GetMetric() {
			switch {
			case m.Counter != nil:
				s.values[name] += m.GetCounter().GetValue()
			case m.Gauge != nil:
				s.values[name] += m.GetGauge().GetValue()
			case m.Untyped != nil:
				s.values[name] += m.GetUntyped().GetValue()
			case m.Histogram != nil:
				s.values[name+"_sum"] += m.GetHistogram().GetSampleSum()
				s.values[name+"_count"] += float64(m.GetHistogram().GetSampleCount())
				for _, b := range m.GetHistogram().GetBucket() {
					if b.GetUpperBound() == slowBound {
						s.values[name+"_fast"] += float64(b.GetCumulativeCount())
					}
				}
			case m.Summary != nil:
				s.values[name+"_sum"] += m.GetSummary().GetSampleSum()
				s.values[name+"_count"] += float64(m.GetSummary().GetSampleCount())
			}
		}
	}
	return s, nil
}

// slowBound is a bucket bound of the relay's Kafka commit and marker wait
// histograms (0.5 ms doubling): a step that took longer is a stall, which
// at 5,000 events/s decides a 15 s run's p99 on its own (a 100 ms stall
// holds 500 events, two thirds of the run's slowest 1 %).
const slowBound = 0.016

// cycleMetrics adds the relay's figures between two samples to m: its CPU
// and, under exactly-once, the commit (flush and EndTxn) and the wait for
// the markers per Kafka transaction, and how many of each stalled.
func cycleMetrics(m map[string]float64, from, to relaySample) {
	d := func(name string) float64 { return to.values[name] - from.values[name] }
	if secs := to.at.Sub(from.at).Seconds(); secs > 0 {
		m["relay_cpu_percent"] = 100 * d("process_cpu_seconds_total") / secs
	}
	if n := d("walrelay_kafka_commit_seconds_count"); n > 0 {
		m["commit_ms_per_txn"] = 1000 * d("walrelay_kafka_commit_seconds_sum") / n
		m["commits_over_16ms"] = n - d("walrelay_kafka_commit_seconds_fast")
	}
	if n := d("walrelay_kafka_marker_wait_seconds_count"); n > 0 {
		m["marker_wait_ms_per_txn"] = 1000 * d("walrelay_kafka_marker_wait_seconds_sum") / n
		m["marker_waits_over_16ms"] = n - d("walrelay_kafka_marker_wait_seconds_fast")
	}
}
