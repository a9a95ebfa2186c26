package bench

import (
	"testing"

	"github.com/walrelay/walrelay/inbox"
)

// TestSetConfigField: the floor mirrors the Workers and MaxBatchRecords
// of the consumer under test (--inbox-set), and the consumer's defaults
// otherwise.
func TestSetConfigField(t *testing.T) {
	var cfg inbox.Config
	for _, s := range []string{"Workers=8", "MaxBatchRecords=100", "MaxBatchTime=50ms"} {
		if err := setConfigField(&cfg, s); err != nil {
			t.Fatalf("setConfigField(%q): %v", s, err)
		}
	}
	if cfg.Workers != 8 || cfg.MaxBatchRecords != 100 {
		t.Errorf("cfg %+v, want Workers 8 and MaxBatchRecords 100", cfg)
	}
	if err := setConfigField(&cfg, "Workers=many"); err == nil {
		t.Error("Workers=many accepted")
	}
	if d := (inbox.Config{}).WithDefaults(); d.Workers < 1 || d.MaxBatchRecords < 1 {
		t.Errorf("inbox defaults %+v: the floor needs Workers and MaxBatchRecords", d)
	}
}
