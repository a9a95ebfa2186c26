package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/checkpoint"
)

// forgeCheckpoint writes d as the slot's checkpoint, as anyone allowed to
// write the checkpoint topic could: a plain record, which read_committed
// readers see like a committed one.
func (e *env) forgeCheckpoint(d checkpoint.Durable) {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	compact := "compact"
	ctx, cancel := context.WithTimeout(e.ctx, 30*time.Second)
	defer cancel()
	if _, err := kadm.NewClient(cl).CreateTopic(ctx, 1, -1, map[string]*string{"cleanup.policy": &compact}, e.checkpointTopic()); err != nil &&
		!strings.Contains(err.Error(), "TOPIC_ALREADY_EXISTS") {
		e.t.Fatal(err)
	}
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: e.checkpointTopic(), Key: []byte(e.name), Value: d.Marshal()}).FirstErr(); err != nil {
		e.t.Fatal(err)
	}
}

// systemID is the test cluster's system identifier.
func (e *env) systemID() string {
	e.t.Helper()
	var id string
	if err := e.conn().QueryRow(e.ctx, "SELECT system_identifier::text FROM pg_control_system()").Scan(&id); err != nil {
		e.t.Fatal(err)
	}
	return id
}

// A checkpoint record is trusted to skip events, so one that cannot be
// this slot's on this server is refused at start, with one line naming the
// fix: written for another PostgreSQL system, or at a position beyond the
// server's WAL. A record of an older walrelay, without a system
// identifier, is accepted with a warning.
func TestExactlyOnceRefusesForgedCheckpoint(t *testing.T) {
	for _, tc := range []struct {
		name string
		d    func(e *env) checkpoint.Durable
		want string
	}{
		{"other system", func(e *env) checkpoint.Durable {
			return checkpoint.Durable{Slot: e.name, SystemID: "1234567890", LSN: 0x1000, Time: time.Now()}
		}, "was written for PostgreSQL system 1234567890"},
		{"beyond the WAL", func(e *env) checkpoint.Durable {
			return checkpoint.Durable{Slot: e.name, SystemID: e.systemID(), LSN: 0xFFFF_00000000, Time: time.Now()}
		}, "is at FFFF/0, beyond the server's WAL position"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.forgeCheckpoint(tc.d(e))
			p := startProc(t, nil, e.eosArgs()...)
			code, _, ok := p.wait(90 * time.Second)
			out := p.out.String()
			if !ok || code != 2 {
				t.Fatalf("relay exited %v with code %d, want exit 2 at start; last lines:\n%s", ok, code, lastLines(out, 5))
			}
			if !strings.Contains(out, tc.want) || !strings.Contains(out, "--checkpoint-topic") {
				t.Fatalf("relay output does not refuse the checkpoint with %q and the fix; last lines:\n%s", tc.want, lastLines(out, 5))
			}
		})
	}
	t.Run("legacy record", func(t *testing.T) {
		e := newEnv(t)
		e.forgeCheckpoint(checkpoint.Durable{Slot: e.name, LSN: 0x1000, Time: time.Now()})
		rc := e.consumeIsolated(true)
		p := startProc(t, nil, e.eosArgs()...)
		e.waitSlotStreamed(60 * time.Second)
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, payload) VALUES ('order', '1', '{}')`)
		sys := e.systemID()
		e.waitFor("a checkpoint naming the system", 60*time.Second, func() (bool, error) {
			for _, d := range rc.durables(t, e.name) {
				if d.SystemID == sys {
					return true, nil
				}
			}
			return false, nil
		})
		checkRunning(t, p, "relay")
		if !strings.Contains(p.out.String(), "does not name its PostgreSQL system") {
			t.Errorf("no warning about the checkpoint without a system identifier:\n%s", lastLines(p.out.String(), 5))
		}
	})
}
