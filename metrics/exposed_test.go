package metrics

// exposed_test.go: what New exposes, as a scrape sees it. The names,
// types, labels, help and histogram buckets are a public interface
// (dashboards, alerts, deploy/'s rules): testdata/exposed.prom pins them,
// and a change to it is reviewed like an API change. After adding a metric
// on purpose: go test ./metrics -run TestExposed -update, then read the
// diff.

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"
)

var update = flag.Bool("update", false, "rewrite testdata/exposed.prom with what New exposes")

const exposedFile = "testdata/exposed.prom"

// exposed returns a registry with New's metrics, each labelled family with
// one series (a vector shows nothing until a label value is used), each
// optional gauge set (it shows nothing until then), and walrelay_ready
// ready.
func exposed(t *testing.T) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	m := New(reg)
	m.EventsPublished.WithLabelValues("outbox.event.order")
	m.EventsDeadLettered.WithLabelValues("missing_id")
	m.Heartbeats.WithLabelValues("wal")
	m.StreamRestarts.WithLabelValues("kafka")
	m.SlotWALStatus.WithLabelValues("reserved").Set(1)
	m.UnmappedInserts.WithLabelValues("public.other")
	m.SchemaReads.WithLabelValues("ok")
	m.SlotSafeWALSize.Set(1 << 30)
	m.SlotTimeToInvalidation.Set(3600)
	m.SetReadiness(func() error { return nil })
	return reg
}

func TestExposed(t *testing.T) {
	reg := exposed(t)
	if *update {
		// (testutil.GatherAndFormat without names formats nothing.)
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		enc := expfmt.NewEncoder(&out, expfmt.NewFormat(expfmt.TypeTextPlain))
		for _, mf := range families {
			if err := enc.Encode(mf); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(exposedFile, out.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.Open(exposedFile)
	if err != nil {
		t.Fatal(err)
	}
	defer want.Close()
	if err := testutil.GatherAndCompare(reg, want); err != nil {
		t.Errorf("the metrics exposed differ from %s (after a deliberate change: go test ./metrics -run TestExposed -update):\n%v", exposedFile, err)
	}
}

// Prometheus's own naming rules (promlint): counters end in _total, units
// are base units, no reserved suffixes.
func TestMetricNamesFollowPrometheusConventions(t *testing.T) {
	problems, err := testutil.GatherAndLint(exposed(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("%s: %s", p.Metric, p.Text)
	}
}

// walrelay_ready is read at scrape time from the readiness function: 0
// until one is set, then whatever it says at that scrape.
func TestReadyIsReadAtScrape(t *testing.T) {
	m := NewUnregistered()
	scrape := func(want string) {
		t.Helper()
		exposition := "# HELP walrelay_ready 1 while the relay is streaming and its replication lag is under the readiness threshold (what /readyz reports).\n" +
			"# TYPE walrelay_ready gauge\n" +
			"walrelay_ready " + want + "\n"
		if err := testutil.CollectAndCompare(m.Ready, strings.NewReader(exposition)); err != nil {
			t.Error(err)
		}
	}
	scrape("0")
	notReady := errors.New("replication lag over the threshold")
	state := notReady
	m.SetReadiness(func() error { return state })
	scrape("0")
	state = nil
	scrape("1")
	state = notReady
	scrape("0")
}
