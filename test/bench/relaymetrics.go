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
			case m.Summary != nil:
				s.values[name+"_sum"] += m.GetSummary().GetSampleSum()
				s.values[name+"_count"] += float64(m.GetSummary().GetSampleCount())
			}
		}
	}
	return s, nil
}

// cycleMetrics adds the relay's figures between two samples to m: its CPU
// and, under exactly-once, the commit (flush and EndTxn) and the wait for
// the markers per Kafka transaction.
func cycleMetrics(m map[string]float64, from, to relaySample) {
	d := func(name string) float64 { return to.values[name] - from.values[name] }
	if secs := to.at.Sub(from.at).Seconds(); secs > 0 {
		m["relay_cpu_percent"] = 100 * d("process_cpu_seconds_total") / secs
	}
	if n := d("walrelay_kafka_commit_seconds_count"); n > 0 {
		m["commit_ms_per_txn"] = 1000 * d("walrelay_kafka_commit_seconds_sum") / n
	}
	if n := d("walrelay_kafka_marker_wait_seconds_count"); n > 0 {
		m["marker_wait_ms_per_txn"] = 1000 * d("walrelay_kafka_marker_wait_seconds_sum") / n
	}
}
