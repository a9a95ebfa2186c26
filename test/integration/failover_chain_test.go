package integration

// The chain across failovers, in a file of its own so that it runs in the
// other process than TestFailoverSlotCarriesOn (scripts/test-integration
// splits by file): the two longest tests of 17's core run, side by side.

import (
	"fmt"
	"testing"
	"time"
)

// TestChainFailover is the chain soak across failovers: PostgreSQL 17+
// with failover slots, the example writers and ledger consumer and the
// relay all connected through the replica set's multi-host URL; the
// primary is killed and the standby promoted twice while orders are
// written. At the end the ledger equals the orders the surviving history
// holds: one effect per committed order event, in version order.
func TestChainFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("soak test")
	}
	rs := startReplicaSet(t, replicaSetOptions{FailoverSlots: true, SynchronizedStandbySlots: true})
	e := rs.newEnv()
	ch := newChainOn(e)
	ch.createTopics()
	relay := watch(t, e.runBinary(e.args()...))
	e.waitFor("slot active", 60*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	consumer := watch(t, e.runExample(ch.consumeArgs()...))
	writers := []*watched{
		watch(t, e.runExample("write", "-pg-url", e.url, "-pause", "2ms")),
		watch(t, e.runExample("write", "-pg-url", e.url, "-pause", "2ms")),
	}
	begin := time.Now()
	for i := 1; i <= 2; i++ {
		n := ch.ledgerRows()
		e.waitFor(fmt.Sprintf("ledger rows before failover %d", i), 2*time.Minute, func() (bool, error) {
			got := ch.ledgerRows()
			return got >= n+100, fmt.Errorf("%d ledger rows", got)
		})
		rs.waitSynced(e.name)
		rs.failover(nil)
	}
	n := ch.ledgerRows()
	e.waitFor("ledger rows after the last failover", 2*time.Minute, func() (bool, error) {
		got := ch.ledgerRows()
		return got >= n+100, fmt.Errorf("%d ledger rows", got)
	})
	for _, w := range writers {
		w.kill()
	}
	events := ch.events()
	e.waitFor("the ledger to catch up", 3*time.Minute, func() (bool, error) {
		for name, p := range map[string]*watched{"relay": relay, "consumer": consumer} {
			if exited, err := p.exited(); exited {
				return false, fmt.Errorf("the %s exited: %v", name, err)
			}
		}
		got := ch.ledgerRows()
		return got >= events, fmt.Errorf("%d ledger rows for %d events", got, events)
	})
	rows := ch.waitLedger(time.Minute)
	t.Logf("chain across 2 failovers: %d order events committed in the surviving history, ledger %d rows = events, per order in version order; elapsed %s",
		events, rows, time.Since(begin).Round(time.Second))
}
