package source

import (
	"strings"
	"testing"
	"time"

	"github.com/walrelay/walrelay/doctor"
)

// creation is a creation of slot s through the initial snapshot's
// temporary slot, waiting on an open transaction (xid 700), with another
// role's transaction and a prepared one open since before it began.
func creation() doctor.Creation {
	return doctor.Creation{Slot: "s", Creating: "walrelay_snapshot_1", PID: 9, ClientAddr: "10.0.0.5", Waited: 45 * time.Second, WaitXid: 700,
		Xacts: []doctor.Xact{
			{PID: 11, Xid: 700, XidAge: 30, Visible: true, Database: "app", User: "batch", State: "idle in transaction",
				Query: "INSERT INTO ledger\n SELECT …", ApplicationName: "nightly", Age: 50 * time.Second, BackendType: "client backend", ClientAddr: "10.0.0.7"},
			{PID: 12, Xid: 690, XidAge: 40, Database: "app", User: "other"},
		},
		Prepared: []doctor.PreparedXact{{GID: "xa'1", Owner: "app", Database: "app", Xid: 650, XidAge: 80, Age: 150 * time.Second}},
	}
}

// TestCreateWaitError: the give-up names what the creation waited for and
// each fix, on one line.
func TestCreateWaitError(t *testing.T) {
	c := creation()
	msg := (&createWaitError{Waited: 2 * time.Minute, Creation: &c}).Error()
	for _, w := range []string{"waited 2m for the transactions", "leaving no slot", "pid 11", "(waited on now)",
		"pid 11: end it", "'xa''1': finish it", "ROLLBACK PREPARED 'xa''1'"} {
		if !strings.Contains(msg, w) {
			t.Errorf("error lacks %q: %s", w, msg)
		}
	}
	if strings.Contains(msg, "\n") {
		t.Errorf("error spans lines: %s", msg)
	}
	if msg := (&createWaitError{Waited: time.Minute}).Error(); strings.Contains(msg, "waited for") || strings.Contains(msg, "fix") {
		t.Errorf("without a reading, the error names no transaction: %s", msg)
	}
}
