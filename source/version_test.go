package source

import (
	"strings"
	"testing"

	"github.com/walrelay/walrelay/slot"
)

func TestVersionErrorRefusesBelowMinimum(t *testing.T) {
	for _, c := range []struct {
		num     int
		version string
		refused bool
	}{
		{90624, "9.6.24", true},
		{130018, "13.18 (Debian 13.18-0+deb11u1)", true},
		{139999, "13.99", true},
		{140000, "14.0", false},
		{140023, "14.23", false},
		{180004, "18.4", false},
	} {
		err := versionError(c.num, c.version)
		if !c.refused {
			if err != nil {
				t.Errorf("PostgreSQL %s refused: %v", c.version, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("PostgreSQL %s accepted, want a refusal below 14", c.version)
			continue
		}
		if !slot.IsSetupError(err) {
			t.Errorf("PostgreSQL %s: %T is not a SetupError (exit 2, no retry)", c.version, err)
		}
		msg := err.Error()
		if strings.Contains(msg, "\n") {
			t.Errorf("refusal is not one line: %q", msg)
		}
		for _, want := range []string{"PostgreSQL " + c.version, "14"} {
			if !strings.Contains(msg, want) {
				t.Errorf("refusal %q does not name %q", msg, want)
			}
		}
	}
}
