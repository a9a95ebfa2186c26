package doctor

import (
	"strings"
	"testing"
	"time"
)

// creation is a creation of slot s through the initial snapshot's
// temporary slot, waiting on an open transaction (xid 700), with another
// role's transaction and a prepared one open since before it began.
func creation() Creation {
	return Creation{Slot: "s", Creating: "walrelay_snapshot_1", PID: 9, ClientAddr: "10.0.0.5", Waited: 45 * time.Second, WaitXid: 700,
		Xacts: []Xact{
			{PID: 11, Xid: 700, XidAge: 30, Visible: true, Database: "app", User: "batch", State: "idle in transaction",
				Query: "INSERT INTO ledger\n SELECT …", ApplicationName: "nightly", Age: 50 * time.Second, BackendType: "client backend", ClientAddr: "10.0.0.7"},
			{PID: 12, Xid: 690, XidAge: 40, Database: "app", User: "other"},
		},
		Prepared: []PreparedXact{{GID: "xa'1", Owner: "app", Database: "app", Xid: 650, XidAge: 80, Age: 150 * time.Second}},
	}
}

// TestCreationCauses: status --explain names the creation, then each
// transaction it waits for with its fix, the one waited on now marked.
func TestCreationCauses(t *testing.T) {
	causes := creation().Causes()
	var kinds []string
	for _, c := range causes {
		kinds = append(kinds, c.Kind)
	}
	if strings.Join(kinds, " ") != "slot_creation open_transaction open_transaction prepared_transaction" {
		t.Fatalf("kinds %v", kinds)
	}
	for i, want := range [][]string{
		{`creating replication slot "s" (walsender pid 9, from 10.0.0.5; first the initial snapshot's temporary slot "walrelay_snapshot_1")`,
			"has waited 45s", "it waits on xid 700 now", "in its initial snapshot", "relay.Config.StartupTimeout"},
		{`pid 11 in database "app" (user "batch", application "nightly", from 10.0.0.7)`, "open 50s", `"INSERT INTO ledger …"`,
			"(it waits on it now)", "SELECT pg_terminate_backend(11)"},
		{"pid 12", "show only to its role or pg_read_all_stats", "SELECT pg_terminate_backend(12)"},
		{`prepared transaction 'xa''1' (xid 650) in database "app", prepared 2m30s ago by "app"`, "across restarts",
			"COMMIT PREPARED 'xa''1' or ROLLBACK PREPARED 'xa''1'"},
	} {
		text := causes[i].Text + " fix: " + causes[i].Fix
		for _, w := range want {
			if !strings.Contains(text, w) {
				t.Errorf("cause %d lacks %q: %s", i, w, text)
			}
		}
	}
	if strings.Contains(causes[2].Text+causes[3].Text, "waits on it now") {
		t.Error("a transaction not waited on now is marked as such")
	}

	c := creation()
	c.Creating, c.WaitXid, c.Xacts, c.Prepared = "s", 0, nil, nil
	causes = c.Causes()
	if len(causes) != 1 || !strings.Contains(causes[0].Text, "no transaction it waits for is open at this moment") ||
		!strings.Contains(causes[0].Fix, "not published") || strings.Contains(causes[0].Text, "temporary slot") {
		t.Errorf("a creation without the snapshot, between two rounds: %+v", causes)
	}
}
