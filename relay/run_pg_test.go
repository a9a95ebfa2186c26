package relay

// run_pg_test.go runs whole relays (Run) against the package's real
// PostgreSQL (pg_test.go) and a kfake broker: what they publish, confirm,
// name and refuse.

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/slot"
)

// Row ids in primary-key order: the initial snapshot reads in that order.
const (
	id1 = "00000000-0000-0000-0000-000000000001"
	id2 = "00000000-0000-0000-0000-000000000002"
	id3 = "00000000-0000-0000-0000-000000000003"
	id4 = "00000000-0000-0000-0000-000000000004"
)

const eventTopic = "outbox.event.order"

// running is a relay whose Run goes on in the background.
type running struct {
	r    *Relay
	m    *metrics.Metrics
	logs *observer.ObservedLogs
	stop context.CancelFunc
	done chan error
}

// runRelay starts Run of a relay of cfg; the test's end stops it.
func runRelay(t *testing.T, cfg Config) *running {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	m := metrics.NewUnregistered()
	r, err := New(cfg, zap.New(core), m)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	rr := &running{r: r, m: m, logs: logs, stop: cancel, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-rr.done //nolint:errcheck // only waits: the tests that care read the error with result
	})
	return rr
}

// result waits for Run to return and returns its error.
func (rr *running) result(t *testing.T) error {
	t.Helper()
	select {
	case err := <-rr.done:
		rr.done <- err // for the cleanup
		return err
	case <-time.After(pgPatience):
		t.Fatal("Run did not return")
		return nil
	}
}

// logged reports whether a line containing msg was logged.
func (rr *running) logged(msg string) bool {
	return rr.logs.FilterMessageSnippet(msg).Len() > 0
}

// TestRunSnapshotsThenStreamsAndConfirmsWhatKafkaHas: a relay creating the
// slot first publishes the rows already in the outbox (the initial
// snapshot, in primary-key order), then streams new ones; it confirms the
// slot past an insert once Kafka has it, moves walrelay's record forward,
// sends heartbeat records saying it streams, names its connections after
// what it does (pg_stat_activity, for status --explain), says at startup
// what a failover would do, and a cancelled Run stops cleanly.
func TestRunSnapshotsThenStreamsAndConfirmsWhatKafkaHas(t *testing.T) {
	e := newPGEnv(t)
	e.insert(id1, id2)
	cfg, seeds := e.config()
	cfg.HeartbeatInterval, cfg.HeartbeatTopic = 100*time.Millisecond, "walrelay.heartbeat"
	rr := runRelay(t, cfg)
	e.waitFor("the relay streaming", rr.r.Streaming)
	if err := rr.r.Ready(); err != nil {
		t.Errorf("streaming without lag, Ready says %v", err)
	}
	after := e.insert(id3)

	recs := consume(t, seeds, eventTopic, func(r []*kgo.Record) bool { return len(r) >= 3 })
	if got := ids(recs); !slices.Equal(got, []string{id1, id2, id3}) {
		t.Fatalf("published %v, want the snapshot's rows then the streamed one: %v", got, []string{id1, id2, id3})
	}
	if n := testutil.ToFloat64(rr.m.SnapshotRows); n != 2 {
		t.Errorf("walrelay_snapshot_rows_total = %v, want 2", n)
	}
	e.waitFor("the slot confirmed past the insert", func() bool { return e.slotConfirmed() >= after })
	e.waitFor("walrelay's record moved past the insert", func() bool { return e.record().ConfirmedLSN >= after })
	if c := rr.r.Confirmed(); c < after {
		t.Errorf("Confirmed() = %s once the slot is confirmed past %s", c, after)
	}

	beats := consume(t, seeds, cfg.HeartbeatTopic, func(r []*kgo.Record) bool {
		return slices.ContainsFunc(r, func(rec *kgo.Record) bool {
			var s heartbeat.Status
			return json.Unmarshal(rec.Value, &s) == nil && s.Streaming && s.Slot == cfg.Slot
		})
	})
	if len(beats) == 0 {
		t.Fatal("no heartbeat record")
	}
	e.waitFor("the slot watch and the heartbeat connections named", func() bool {
		names := e.appNames()
		return slices.Contains(names, doctor.AppNameAsShown(doctor.RelayAppName(cfg.Slot, doctor.RelayStreaming))) && slices.Contains(names, doctor.AppNameAsShown(doctor.HeartbeatAppName(cfg.Slot)))
	})
	if !rr.logged("failover: ") {
		t.Error("no startup line saying what a failover would do")
	}

	rr.stop()
	if err := rr.result(t); err != nil {
		t.Fatalf("a cancelled Run returned %v, want nil", err)
	}
	if rr.r.Streaming() {
		t.Error("streaming after Run returned")
	}
}

// TestRunExactlyOnce: with exactly-once delivery the initial snapshot and
// the stream are published in Kafka transactions, each closed by a
// checkpoint record of the slot, so a read_committed consumer reads each
// row once; the process remembers the newest checkpoint Kafka confirmed
// committing (what a later doubtful commit is judged against).
func TestRunExactlyOnce(t *testing.T) {
	e := newPGEnv(t)
	e.insert(id1, id2)
	cfg, seeds := e.config()
	cfg.ExactlyOnce = true
	rr := runRelay(t, cfg)
	e.waitFor("the relay streaming", rr.r.Streaming)
	after := e.insert(id3)
	recs := consume(t, seeds, eventTopic, func(r []*kgo.Record) bool { return len(r) >= 3 }, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if got := ids(recs); !slices.Equal(got, []string{id1, id2, id3}) {
		t.Fatalf("read_committed read %v, want %v", got, []string{id1, id2, id3})
	}
	// The snapshot's Kafka transaction, then the streamed row's: only
	// transactions with events make one.
	var newest checkpoint.Durable
	consume(t, seeds, cfg.Router.CheckpointTopic, func(r []*kgo.Record) bool {
		n := 0
		for _, rec := range r {
			if d, err := checkpoint.UnmarshalDurable(rec.Value); err == nil && string(rec.Key) == cfg.Slot {
				newest, n = d, n+1
			}
		}
		return n >= 2
	}, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	e.waitFor("the slot confirmed past the insert", func() bool { return e.slotConfirmed() >= after })
	rr.stop()
	if err := rr.result(t); err != nil {
		t.Fatalf("a cancelled Run returned %v, want nil", err)
	}
	// Run returned: the session goroutine that owns the memory is done.
	if sure := rr.r.commits.lastSure; !sure.found || sure.ckpt.LSN != newest.LSN || sure.ckpt.Slot != cfg.Slot {
		t.Fatalf("the process's last sure checkpoint is %+v, want the newest committed, at %s", sure, newest.LSN)
	}
	if n := testutil.ToFloat64(rr.m.KafkaTransactions); n < 2 {
		t.Errorf("walrelay_kafka_transactions_total = %v, want the snapshot's and the stream's", n)
	}
}

// TestExactlyOnceCheckpointAheadOfTheStreamsOpening is the race of two
// relays on one slot: the one taking over ran IDENTIFY_SYSTEM while the
// other still streamed, and that one committed a checkpoint of WAL written
// after (here: a row inserted after the answer). The checkpoint is ahead of
// the answer but not of the server: it is accepted, read against the
// server's position again. One ahead of the server too is still refused.
func TestExactlyOnceCheckpointAheadOfTheStreamsOpening(t *testing.T) {
	e := newPGEnv(t)
	cfg := e.pgConfig()
	cfg.ExactlyOnce = true
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	opened, err := slot.IdentifySystem(e.ctx, e.url)
	if err != nil {
		t.Fatal(err)
	}
	e.insert(id1) // its commit is flushed: the server's position passes opened's
	d := checkpoint.Durable{Slot: cfg.Slot, SystemID: opened.SystemID, Timeline: opened.Timeline, LSN: opened.XLogPos + 1}
	if err := r.verifyCheckpoint(e.ctx, resumePoint{found: true, ckpt: d}, opened); err != nil {
		t.Fatalf("a checkpoint of WAL written after the stream's IDENTIFY_SYSTEM was refused: %v", err)
	}
	d.LSN = opened.XLogPos + 1<<40
	if err := r.verifyCheckpoint(e.ctx, resumePoint{found: true, ckpt: d}, opened); !isFatal(err) {
		t.Fatalf("a checkpoint ahead of the server gave %v, want refused", err)
	}
}

// TestStandbyTakesOverWhenTheActiveRelayStops: a second relay on a slot
// another streams from waits as a standby (a restart of cause slot_busy,
// its connection named so), confirming and publishing nothing, and takes
// over once the active one stops.
func TestStandbyTakesOverWhenTheActiveRelayStops(t *testing.T) {
	e := newPGEnv(t)
	cfg, seeds := e.config()
	active := runRelay(t, cfg)
	e.waitFor("the first relay streaming", active.r.Streaming)
	standby := runRelay(t, cfg)
	e.waitFor("the second relay waiting as a standby", func() bool {
		return testutil.ToFloat64(standby.m.StreamRestarts.WithLabelValues(string(CauseSlotBusy))) > 0 &&
			slices.Contains(e.appNames(), doctor.AppNameAsShown(doctor.RelayAppName(cfg.Slot, doctor.RelayStandby)))
	})
	if standby.r.Streaming() || standby.r.Ready() == nil {
		t.Fatal("the standby says it streams, or is ready")
	}
	if !standby.logged("waiting as a standby") || standby.logs.FilterMessageSnippet("relay restarting").Len() != 0 {
		t.Errorf("the standby's wait is not an informational line of its own: %v", standby.logs.All())
	}

	active.stop()
	if err := active.result(t); err != nil {
		t.Fatal(err)
	}
	e.waitFor("the standby streaming", standby.r.Streaming)
	after := e.insert(id1)
	recs := consume(t, seeds, eventTopic, func(r []*kgo.Record) bool { return len(r) >= 1 })
	if got := ids(recs); !slices.Equal(got, []string{id1}) {
		t.Fatalf("published %v, want %v", got, []string{id1})
	}
	e.waitFor("the slot confirmed past the insert", func() bool { return e.slotConfirmed() >= after })
}

// TestRunStopsWhenThePublicationNoLongerPublishesTheOutbox: an outbox
// table taken out of the publication while the relay streams would have
// its inserts skipped without a word: Run returns the refusal (fatal,
// naming the table) before the slot is confirmed past them, and the next
// start refuses too.
func TestRunStopsWhenThePublicationNoLongerPublishesTheOutbox(t *testing.T) {
	e := newPGEnv(t)
	cfg, _ := e.config()
	rr := runRelay(t, cfg)
	e.waitFor("the relay streaming", rr.r.Streaming)
	e.exec("ALTER PUBLICATION " + cfg.Publication + " DROP TABLE outbox")
	skipped := e.insert(id1)
	err := rr.result(t)
	if !isGap(err) || !isFatal(err) || !strings.Contains(err.Error(), "outbox") {
		t.Fatalf("Run returned %v, want a refusal naming the outbox table", err)
	}
	if c := e.slotConfirmed(); c >= skipped {
		t.Errorf("the slot was confirmed to %s, past the skipped insert at %s", c, skipped)
	}
	again := runRelay(t, cfg)
	if err := again.result(t); !isGap(err) {
		t.Fatalf("the next start returned %v, want the refusal", err)
	}
}

// TestRunRefusesAtOnceWhatRetryingCannotFix: credentials PostgreSQL
// refuses and an initial snapshot query it rejects stop Run at once with
// one line naming the fix, rather than retrying until the startup timeout.
func TestRunRefusesAtOnceWhatRetryingCannotFix(t *testing.T) {
	e := newPGEnv(t)
	for _, tc := range []struct {
		name   string
		change func(*Config)
		says   string
	}{
		{"a role that does not exist", func(c *Config) { c.PGURL = strings.Replace(c.PGURL, "postgres@", "nobody@", 1) }, "relay.Config.PGURL"},
		{"a snapshot condition PostgreSQL rejects", func(c *Config) { c.SnapshotWhere = "no_such_column > 0" }, "snapshot condition"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, _ := e.config()
			cfg.StartupTimeout = 10 * time.Minute
			tc.change(&cfg)
			err := runRelay(t, cfg).result(t)
			var timeout *StartupTimeoutError
			if !isFatal(err) || errors.As(err, &timeout) || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("Run returned %v, want a refusal naming %q, not a give-up", err, tc.says)
			}
		})
	}
}

// TestPublishSnapshotPublishesTheCurrentRows: `walrelay snapshot`
// publishes the rows meeting the snapshot condition once, at least once
// and outside any slot (it creates none, and takes no transactional id even
// when the relay is exactly-once), and says how many it sent.
func TestPublishSnapshotPublishesTheCurrentRows(t *testing.T) {
	e := newPGEnv(t)
	e.insert(id1, id2, id3)
	cfg, seeds := e.config()
	cfg.ExactlyOnce = true
	cfg.SnapshotWhere = "id <> '" + id2 + "'"
	n, err := PublishSnapshot(e.ctx, cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil || n != 2 {
		t.Fatalf("PublishSnapshot: %d rows, %v; want 2", n, err)
	}
	recs := consume(t, seeds, eventTopic, func(r []*kgo.Record) bool { return len(r) >= 2 })
	if got := ids(recs); !slices.Equal(got, []string{id1, id3}) {
		t.Fatalf("published %v, want %v", got, []string{id1, id3})
	}
	if c := e.slotConfirmed(); c != 0 {
		t.Errorf("a slot exists after the snapshot (confirmed at %s)", c)
	}
}

// TestStreamDrainedOnARealStream: slot.Stream.Drained, which lets an
// exactly-once session commit without waiting for the stream to stay
// silent, on a real walsender: drained once everything sent was read, not
// drained once the next transaction's bytes arrived.
func TestStreamDrainedOnARealStream(t *testing.T) {
	e := newPGEnv(t)
	e.exec(`CREATE PUBLICATION ` + e.name + ` FOR TABLE outbox`)
	e.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, e.name)
	st, err := slot.Start(e.ctx, e.url, 0, slot.StreamOptions{Slot: e.name, Publication: e.name, Read: DefaultConfig().Read})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close(context.Background())
	deadline := time.Now().Add(pgPatience)
	// readUntilDrained reads what arrives until the stream says it is
	// drained.
	readUntilDrained := func() {
		for !st.Drained() {
			if time.Now().After(deadline) {
				t.Fatal("the stream never said it was drained")
			}
			if _, err := st.Receive(time.Now().Add(50 * time.Millisecond)); err != nil && !errors.Is(err, slot.ErrTimeout) {
				t.Fatal(err)
			}
		}
	}
	readUntilDrained()
	e.insert(id1)
	for st.Drained() {
		if time.Now().After(deadline) {
			t.Fatal("the stream said it was drained while a committed transaction was on its way")
		}
		time.Sleep(time.Millisecond)
	}
	// The walsender may send the transaction's messages apart (the
	// stream is drained in between, which a session asks only between
	// transactions): read up to its Commit, then until drained again.
	for {
		m, err := st.Receive(deadline)
		if err != nil {
			t.Fatal(err)
		}
		if m.Kind == slot.XLogData && len(m.Data) > 0 && m.Data[0] == 'C' {
			break
		}
	}
	readUntilDrained()
}
