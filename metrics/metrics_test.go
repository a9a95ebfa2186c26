package metrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// exported reports whether reg exports a series named name, and its value.
func exported(t *testing.T, reg *prometheus.Registry, name string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// TestOptionalGauges: safe_wal_size and the time left are absent until
// the slot watch sets them, and absent again once cleared (no
// max_slot_wal_keep_size, a lost slot): a 0 would fire every alert on a
// low value.
func TestOptionalGauges(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg)
	for name, g := range map[string]*OptionalGauge{
		"walrelay_slot_safe_wal_size_bytes":          m.SlotSafeWALSize,
		"walrelay_slot_time_to_invalidation_seconds": m.SlotTimeToInvalidation,
	} {
		if _, ok := exported(t, reg, name); ok {
			t.Errorf("%s exported before it was set", name)
		}
		g.Set(42)
		if v, ok := exported(t, reg, name); !ok || v != 42 {
			t.Errorf("%s after Set(42): %v, exported %v", name, v, ok)
		}
		if v, ok := g.Value(); !ok || v != 42 {
			t.Errorf("%s Value() = %v, %v", name, v, ok)
		}
		g.Clear()
		if _, ok := exported(t, reg, name); ok {
			t.Errorf("%s exported after Clear", name)
		}
	}
}
