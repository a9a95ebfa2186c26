package main

import (
	"strings"
	"testing"
	"time"

	"github.com/walrelay/walrelay/inbox"
)

// TestSetField: -set names inbox.Config's tunables by name, so that the
// program builds against inbox packages that predate some of them; one
// the build lacks, or a value of the wrong kind, is refused by name.
func TestSetField(t *testing.T) {
	var cfg inbox.Config
	for _, s := range []string{"MaxAttempts=7", "RetryBackoff=250ms"} {
		if err := setField(&cfg, s); err != nil {
			t.Fatalf("setField(%q): %v", s, err)
		}
	}
	if cfg.MaxAttempts != 7 || cfg.RetryBackoff != 250*time.Millisecond {
		t.Errorf("cfg %+v, want MaxAttempts 7 and RetryBackoff 250ms", cfg)
	}
	for s, want := range map[string]string{
		"NoSuchField=1": "has no field NoSuchField",
		"Group=g":       "not an int or a duration",
		"MaxAttempts":   "want Name=value",
		"MaxAttempts=x": "MaxAttempts=x",
	} {
		if err := setField(&cfg, s); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("setField(%q) = %v, want an error containing %q", s, err, want)
		}
	}
}
