package relay

// slotpoll_test.go: what the slot poller concludes from what it reads
// (slotpoll_pg_test.go has it reading a real server).

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap/zapcore"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/test/testkit"
)

// TestRelayStateSaysWhatTheRelayWaitsFor: the state the slot watch names
// its connection after (what status --explain shows) tells a relay that
// has not streamed yet, a standby, one without a Kafka producer, one
// restarting, one streaming, one whose events Kafka has not acknowledged
// since the last poll, and one at its in-flight limit.
func TestRelayStateSaysWhatTheRelayWaitsFor(t *testing.T) {
	c := testkit.Kfake(t)
	cfg := validConfig()
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(c.ListenAddrs()...)}
	cfg.Router.MaxInflightEvents = 2
	r, _, _ := observedRelay(t, cfg)
	p, w := r.poller(), &slotWatch{}
	state := func(active bool, want string) {
		t.Helper()
		if got := p.relayState(slot.Info{Active: active}, w); got != want {
			t.Fatalf("state %q, want %q", got, want)
		}
	}
	state(false, doctor.RelayStarting)
	state(true, doctor.RelayStandby)
	r.sup.streamed.Store(true)
	state(false, doctor.RelayConnectingKafka)
	r.live.streaming.Store(true)
	state(true, doctor.RelayStreaming) // streaming, before a producer is in use

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rt, err := startRouter(ctx, r.cfg, r.log, r.metrics, func(error) {})
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	r.live.useRouter(rt)
	r.live.streaming.Store(false)
	state(false, doctor.RelayRestarting)
	r.live.streaming.Store(true)
	state(true, doctor.RelayStreaming)

	// Kafka stops acknowledging: an event in flight, none acked since the
	// last poll.
	hold := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	var acks checkpoint.Counter
	send := func(id string) {
		t.Helper()
		for {
			ch, err := rt.Send(&decoder.Event{ID: []byte(id), AggregateType: []byte("order"), AggregateID: []byte("a1")}, 100, &acks)
			if err != nil {
				t.Fatal(err)
			}
			if ch == nil {
				return
			}
			select {
			case <-ch:
			case <-ctx.Done():
				t.Fatal("no room for an event")
			}
		}
	}
	send("e1")
	state(true, doctor.RelayWaitingForKafka)
	send("e2")
	state(true, doctor.RelayBackpressure)
	hold.Remove()
	waitFor(t, "Kafka to acknowledge both events", func() bool { return acks.Pending() == 0 })
	state(true, doctor.RelayStreaming)
}

// TestWarnOutage: the slot poller warns, once each, when
// idle_replication_slot_timeout, or max_slot_wal_keep_size at the WAL rate
// it measured, would invalidate the slot during a relay outage of
// PlannedOutage, naming the setting to change; not when the slot would
// outlast it, the rate is unknown, or no outage is planned for.
func TestWarnOutage(t *testing.T) {
	gib := int64(1 << 30)
	poll := func(w *slotWatch, s int, mib int64) (slot.Info, float64, bool) {
		info := slot.Info{Now: time.Unix(int64(s), 0), CurrentLSN: decoder.LSN(mib << 20), SafeWALSize: &gib}
		rate, known := w.rate(info)
		return info, rate, known
	}
	idle := doctor.Settings{IdleSlotTimeout: "1h", IdleSlotTimeoutDur: time.Hour, MaxSlotWALKeepSize: "1GB"}
	for _, tc := range []struct {
		name     string
		plan     time.Duration
		settings doctor.Settings
		mibPerS  int64
		polls    int
		want     []string
	}{
		{"both would invalidate the slot within the planned outage", 24 * time.Hour, idle, 1, 3,
			[]string{"idle_replication_slot_timeout = 1h", "max_slot_wal_keep_size = 1GB: at the server's WAL rate (1.0 MiB (1048576 bytes)/s over the last 10s) the slot survives about 17m4s"}},
		{"the rate is not known yet", 24 * time.Hour, doctor.Settings{MaxSlotWALKeepSize: "1GB"}, 1, 1, nil},
		{"no WAL written", 24 * time.Hour, doctor.Settings{MaxSlotWALKeepSize: "1GB"}, 0, 3, nil},
		{"the slot outlasts the outage", 10 * time.Minute, idle, 1, 3, nil},
		{"no outage planned for", 0, idle, 1, 3, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := validConfig()
			cfg.PlannedOutage = tc.plan
			r, logs, _ := observedRelay(t, cfg)
			p, w := r.poller(), &slotWatch{}
			for i := range tc.polls {
				info, rate, known := poll(w, 10*i, tc.mibPerS*10*int64(i))
				p.warnOutage(w, tc.settings, info, rate, known)
			}
			got := logs.FilterLevelExact(zapcore.WarnLevel).All()
			if len(got) != len(tc.want) {
				t.Fatalf("%d warnings, want %d: %v", len(got), len(tc.want), got)
			}
			for i, want := range tc.want {
				if !strings.Contains(got[i].Message, want) {
					t.Errorf("warning %d does not say %q: %s", i, want, got[i].Message)
				}
			}
		})
	}
}
