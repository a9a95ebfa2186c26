package relay

// slotpoll_pg_test.go: the slot poller reading the package's real
// PostgreSQL (pg_test.go).

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/slot"
)

// pollSlot runs r's slot poller until the test ends; the returned channel
// receives what it stopped the relay with.
func pollSlot(t *testing.T, r *Relay) <-chan error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.poller().watchSlot(ctx, func(err error) { stopped <- err })
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return stopped
}

// TestSlotPollerNamesItsConnectionAfterWhatTheRelayDoes: pg_stat_activity
// (and so walrelay status --explain) shows what the relay does in the name
// of its slot watch connection: starting, waiting for Kafka, a standby
// while another client streams from the slot. A name the operator set in
// the URL is theirs, and kept.
func TestSlotPollerNamesItsConnectionAfterWhatTheRelayDoes(t *testing.T) {
	e := newPGEnv(t)
	r, _, _, s := preparedRelay(t, e)
	named := func(state string) {
		t.Helper()
		e.waitFor("the watch connection named "+state, func() bool {
			return slices.Contains(e.appNames(), doctor.AppNameAsShown(doctor.RelayAppName(e.name, state)))
		})
	}
	func() {
		ctx, cancel := context.WithCancel(e.ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			r.poller().watchSlot(ctx, func(error) {})
		}()
		defer func() { cancel(); <-done }()
		named(doctor.RelayStarting)
		r.sup.streamed.Store(true)
		named(doctor.RelayConnectingKafka)
		stream, err := slot.Start(e.ctx, e.url, s, slot.StreamOptions{Slot: e.name, Publication: r.cfg.Publication})
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close(context.Background())
		named(doctor.RelayStandby)
	}()

	cfg := e.pgConfig()
	cfg.PGURL += "&application_name=billing-relay"
	own, _, _ := observedRelay(t, cfg)
	ackedUpTo(own, s, s+0x100, s+0x100)
	pollSlot(t, own)
	// The poll that moves the record forward names the connection first.
	e.waitFor("the record moved forward", func() bool { return e.record().ConfirmedLSN >= s+0x100 })
	names := e.appNames()
	if !slices.Contains(names, "billing-relay") || slices.ContainsFunc(names, func(n string) bool { return strings.HasPrefix(n, "walrelay "+e.name) }) {
		t.Fatalf("connections named %q: want the operator's name kept", names)
	}
}

// TestSlotPollerReadsWhatHoldsTheSlot: the slot's metrics follow
// pg_replication_slots (its WAL status, how far it lags), and the poller
// counts the prepared transactions that hold it back.
func TestSlotPollerReadsWhatHoldsTheSlot(t *testing.T) {
	e := newPGEnv(t)
	r, _, m, _ := preparedRelay(t, e)
	e.insert("00000000-0000-0000-0000-0000000000c1") // WAL the slot holds: nobody confirms it
	conn := e.conn()
	defer conn.Close(context.Background())
	if _, err := conn.Exec(e.ctx, "BEGIN; INSERT INTO outbox DEFAULT VALUES; PREPARE TRANSACTION '"+e.name+"'"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.exec("ROLLBACK PREPARED '" + e.name + "'") })
	pollSlot(t, r)
	e.waitFor("the prepared transaction counted", func() bool { return testutil.ToFloat64(m.SourcePreparedXacts) == 1 })
	if v := testutil.ToFloat64(m.SlotWALStatus.WithLabelValues("reserved")); v != 1 {
		t.Errorf(`walrelay_slot_wal_status{status="reserved"} = %v, want 1`, v)
	}
	if v := testutil.ToFloat64(m.SlotLag); v <= 0 {
		t.Errorf("walrelay_slot_lag_bytes = %v with an insert nobody confirmed, want more than 0", v)
	}
}

// TestSlotPollerStopsTheRelayOnAnInvalidatedSlot: a slot PostgreSQL
// invalidated (max_slot_wal_keep_size) lacks WAL it can never stream: the
// poller stops the relay with a refusal, written into walrelay's record.
func TestSlotPollerStopsTheRelayOnAnInvalidatedSlot(t *testing.T) {
	e := newPGEnv(t)
	r, _, m, _ := preparedRelay(t, e)
	// Settings of the whole cluster, for this test only.
	settings := map[string]string{"max_slot_wal_keep_size": "1MB", "max_wal_size": "32MB", "min_wal_size": "32MB", "wal_keep_size": "0"}
	for k, v := range settings {
		e.exec("ALTER SYSTEM SET " + k + " = '" + v + "'")
	}
	e.exec("SELECT pg_reload_conf()")
	t.Cleanup(func() {
		for k := range settings {
			e.exec("ALTER SYSTEM RESET " + k)
		}
		e.exec("SELECT pg_reload_conf()")
	})
	stopped := pollSlot(t, r)
	conn := e.conn()
	defer conn.Close(context.Background())
	for i := 0; ; i++ {
		info, err := slot.ReadInfo(e.ctx, conn, e.name)
		if err != nil {
			t.Fatal(err)
		}
		if info.Invalidated() {
			break
		}
		if i == 40 {
			t.Fatalf("slot not invalidated after writing ~%d MB of WAL past max_slot_wal_keep_size: %+v", 8*i, info)
		}
		for _, q := range []string{`SELECT pg_logical_emit_message(false, 'walrelay.test', repeat('x', 8000000))`, `SELECT pg_switch_wal()`, `CHECKPOINT`} {
			if _, err := conn.Exec(e.ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
	}
	var err error
	select {
	case err = <-stopped:
	case <-time.After(pgPatience):
		t.Fatal("the poller did not stop the relay")
	}
	if !isGap(err) || !isFatal(err) {
		t.Fatalf("stopped with %v, want a refusal", err)
	}
	if rec := e.record(); rec.Stopped == "" {
		t.Error("the refusal is not in walrelay's record")
	}
	if n := testutil.ToFloat64(m.GapRefusals); n != 1 {
		t.Errorf("walrelay_gap_refusals_total = %v, want 1", n)
	}
}
