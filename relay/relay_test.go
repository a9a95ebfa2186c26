package relay

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/confirm"
	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// validConfig is what an embedder starts from.
func validConfig() Config { return DefaultConfig() }

func TestNewValidates(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(*Config)
		err    string // "" means valid
	}{
		{"defaults", func(*Config) {}, ""},
		{"exactly-once with defaults", func(c *Config) { c.ExactlyOnce = true }, ""},
		{"exactly-once, commit interval half the timeout", func(c *Config) {
			c.ExactlyOnce, c.TxnMaxInterval, c.Router.TransactionTimeout = true, time.Second, 2*time.Second
		}, ""},
		{"exactly-once, commit interval over half the timeout", func(c *Config) {
			c.ExactlyOnce, c.TxnMaxInterval, c.Router.TransactionTimeout = true, 1500*time.Millisecond, 2*time.Second
		}, "relay.Config.Router.TransactionTimeout"},
		{"exactly-once, commit interval over half the default timeout", func(c *Config) {
			c.ExactlyOnce, c.TxnMaxInterval = true, 31*time.Second
		}, "relay.Config.TxnMaxInterval"},
		{"at-least-once ignores the transaction settings", func(c *Config) {
			c.TxnMaxInterval, c.Router.TransactionTimeout = time.Minute, time.Second
		}, ""},
		{"bad slot name", func(c *Config) { c.Slot = "Bad-Slot" }, "slot"},
		{"no publication", func(c *Config) { c.Publication = "" }, "publication"},
		{"no table", func(c *Config) { c.Tables = nil }, "table"},
		{"message cap not above the record limit", func(c *Config) {
			c.Read.MaxMessageBytes, c.Router.MaxRecordBytes = 1<<20, 1<<20
		}, "relay.Config.Read.MaxMessageBytes"},
		{"message cap above a raised record limit", func(c *Config) {
			c.Read.MaxMessageBytes, c.Router.MaxRecordBytes = 8<<20, 4<<20
		}, ""},
		{"record limit above the default message cap", func(c *Config) { c.Router.MaxRecordBytes = 100 << 20 }, "relay.Config.Read.MaxMessageBytes"},
		{"bad topic allowlist", func(c *Config) { c.Router.TopicAllow = "(" }, "allowlist"},
		{"status interval under the confirm delay", func(c *Config) {
			c.StatusInterval, c.ConfirmDelay = time.Second, 2*time.Second
		}, "confirm delay"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := validConfig()
			tc.change(&cfg)
			r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("New: %v", err)
			case tc.err != "" && err == nil:
				t.Fatalf("New accepted it; want an error mentioning %q", tc.err)
			case tc.err != "" && !strings.Contains(err.Error(), tc.err):
				t.Fatalf("error %q does not mention %q", err, tc.err)
			}
			if err == nil && r.cfg.Router.TransactionTimeout <= 0 {
				t.Errorf("transaction timeout %s: commits would be bounded by a zero timeout", r.cfg.Router.TransactionTimeout)
			}
		})
	}
}

func TestErrorClassification(t *testing.T) {
	certErr := fmt.Errorf("connect: %w", x509.UnknownAuthorityError{})
	for _, tc := range []struct {
		name  string
		err   error
		cause RestartCause
		fatal bool
		conf  bool // kafkaConfigError
	}{
		{"slot busy", fmt.Errorf("%w: in use", errSlotBusy), "slot_busy", false, false},
		{"silent connection", errServerSilent, "silent", false, false},
		{"malformed stream", fmt.Errorf("x: %w", decoder.ErrMalformed), "decode", false, false},
		{"server error", fmt.Errorf("x: %w", &pgconn.PgError{Code: "57P01"}), "postgres", false, false},
		{"refused record", &produceError{errors.New("refused")}, "kafka", false, false},
		{"failed Kafka transaction", &kafkaTxnFailure{kerr.InvalidTxnState}, "kafka", false, false},
		{"fatal", &fatalError{errors.New("stop")}, "connection", true, false},
		{"untrusted certificate", &router.ConfigError{Err: certErr}, "connection", true, true},
		{"wrong SASL password", &router.ConfigError{Err: kerr.SaslAuthenticationFailed}, "connection", true, true},
		{"transactional id not authorized", kerr.TransactionalIDAuthorizationFailed, "kafka_authorization", false, false},
		{"topic not authorized", &produceError{&router.DeniedError{Operation: "WRITE", Resource: "topic", Name: "t", Err: kerr.TopicAuthorizationFailed}}, "kafka_authorization", false, false},
		{"failed Kafka transaction, not authorized", &kafkaTxnFailure{fmt.Errorf("commit: %w", kerr.TransactionalIDAuthorizationFailed)}, "kafka_authorization", false, false},
		{"plain I/O", errors.New("connection reset"), "connection", false, false},
		{"unsupported stream", fmt.Errorf("x: %w", decoder.ErrUnsupported), "connection", true, false},
		{"setup refusal", &slot.SetupError{Msg: "wal_level"}, "connection", true, false},
		{"invalidated slot", doctor.InvalidatedError(slot.Info{Name: "s", WALStatus: "lost"}, doctor.Settings{}, 0), "connection", true, false},
		{"invalid event with on-invalid=fail", fmt.Errorf("send: %w", &deadletter.InvalidEventError{}), "connection", true, false},
		{"fatal inside a joined error", errors.Join(errors.New("a"), &fatalError{errors.New("b")}), "connection", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := causeOf(tc.err); got != tc.cause {
				t.Errorf("causeOf = %q, want %q", got, tc.cause)
			}
			if got := isFatal(tc.err); got != tc.fatal {
				t.Errorf("isFatal = %v, want %v", got, tc.fatal)
			}
			if got := kafkaConfigError(tc.err); got != tc.conf {
				t.Errorf("kafkaConfigError = %v, want %v", got, tc.conf)
			}
		})
	}
}

func TestStartupConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		auth bool
	}{
		{"wrong password", fmt.Errorf("connect: %w", &pgconn.PgError{Code: "28P01"}), true},
		{"no pg_hba entry", fmt.Errorf("connect: %w", &pgconn.PgError{Code: "28000"}), true},
		{"server shutting down", fmt.Errorf("connect: %w", &pgconn.PgError{Code: "57P03"}), false},
		{"broker down", errors.New("dial tcp 127.0.0.1:9092: connect: connection refused"), false},
	} {
		if got := pgAuthError(tc.err); got != tc.auth {
			t.Errorf("%s: pgAuthError = %v, want %v", tc.name, got, tc.auth)
		}
	}
}

func TestKafkaTxnError(t *testing.T) {
	// Fenced is left to the session's end (afterFence), which knows
	// whether the relay still holds the slot.
	err := kafkaTxnError(fmt.Errorf("commit: %w", router.ErrFenced))
	if isFatal(err) || !errors.Is(err, router.ErrFenced) || causeOf(err) != "fenced" {
		t.Errorf("fenced: %v (fatal %v, cause %s)", err, isFatal(err), causeOf(err))
	}
	err = kafkaTxnError(fmt.Errorf("commit: %w", router.ErrTxnTimedOut))
	if isFatal(err) || causeOf(err) != "kafka" {
		t.Errorf("timed out: %v (fatal %v, cause %s): must be retried", err, isFatal(err), causeOf(err))
	}
	if kafkaTxnError(nil) != nil {
		t.Error("kafkaTxnError(nil) is not nil")
	}
}

// TestRetryWaitEndsAtTheStartupDeadline checks that the backoff sleep before
// the first stream never runs past --startup-timeout, and that the attempt
// after it gives up: a 10s timeout must mean about 10s, not 16.
func TestRetryWaitEndsAtTheStartupDeadline(t *testing.T) {
	cfg := validConfig()
	cfg.StartupTimeout = 10 * time.Second
	cfg.BackoffMin, cfg.BackoffMax = 8*time.Second, 30*time.Second
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	clock := time.Unix(1_000_000, 0)
	r.sup.now = func() time.Time { return clock }
	var waits []time.Duration
	r.sup.sleep = func(_ context.Context, d time.Duration) bool {
		waits = append(waits, d)
		clock = clock.Add(d)
		return true
	}
	r.sup.begin = clock
	clock = clock.Add(7 * time.Second) // the attempts so far took 7s
	if err := r.sup.retry(context.Background(), "setup", errors.New("connection refused")); err != nil {
		t.Fatal("retry gave up before the startup timeout")
	}
	if len(waits) != 1 || waits[0] > 3*time.Second {
		t.Fatalf("waited %v with 3s of the startup timeout left; want at most 3s", waits)
	}
	if got := clock.Sub(r.sup.begin); got > cfg.StartupTimeout {
		t.Fatalf("the next attempt starts %s after the start, past --startup-timeout %s", got, cfg.StartupTimeout)
	}
	clock = clock.Add(time.Millisecond) // the last attempt failed too
	giveUp := r.sup.retry(context.Background(), "setup", errors.New("connection refused"))
	if giveUp == nil {
		t.Fatal("retry went on past the startup timeout")
	}
	if !isFatal(giveUp) || len(waits) != 1 {
		t.Fatalf("giveUp %v, waits %v: want a give-up without another wait", giveUp, waits)
	}
	// Its own type: walrelay run exits 4 on it, a code a restart may fix.
	var timeout *StartupTimeoutError
	if !errors.As(giveUp, &timeout) || timeout.Timeout != cfg.StartupTimeout || timeout.Err.Error() != "connection refused" {
		t.Fatalf("giveUp %#v, want a *StartupTimeoutError of %s wrapping the last error", giveUp, cfg.StartupTimeout)
	}
	// Creating the slot, waiting for transactions, gives up at the same
	// deadline, and warns at the slot poll's pace meanwhile.
	if s := r.setupConfig(); !s.CreateDeadline.Equal(r.sup.begin.Add(cfg.StartupTimeout)) || s.CreateWarnInterval != cfg.SlotPollInterval {
		t.Fatalf("setup config: CreateDeadline %s (want %s), CreateWarnInterval %s (want %s)",
			s.CreateDeadline, r.sup.begin.Add(cfg.StartupTimeout), s.CreateWarnInterval, cfg.SlotPollInterval)
	}

	// Once streaming, and for a standby waiting on a busy slot, the
	// startup deadline does not apply: the full backoff is kept.
	r.sup.streamed.Store(true)
	if d := r.setupConfig().CreateDeadline; !d.IsZero() {
		t.Fatalf("after streaming: slot creation deadline %s, want none", d)
	}
	r.sup.backoff.Reset()
	waits = nil
	if r.sup.retry(context.Background(), "connection", errors.New("reset")) != nil || waits[0] < 4*time.Second {
		t.Fatalf("after streaming: waits %v; want the uncapped backoff (at least 4s from 8s with jitter 0.5)", waits)
	}
}

// TestBackoffGrowsWhenSessionsFailAtOnce: sessions that fail right after
// their start, confirming nothing, wait longer each time up to BackoffMax;
// one that made progress starts the wait over.
func TestBackoffGrowsWhenSessionsFailAtOnce(t *testing.T) {
	cfg := validConfig()
	cfg.BackoffMin, cfg.BackoffMax = 100*time.Millisecond, 3*time.Second
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	clock := time.Unix(1_000_000, 0)
	r.sup.now = func() time.Time { return clock }
	var waits []time.Duration
	r.sup.sleep = func(_ context.Context, d time.Duration) bool {
		waits = append(waits, d)
		clock = clock.Add(d)
		return true
	}
	r.sup.streamed.Store(true)
	for i := 0; i < 12; i++ {
		began := clock
		clock = clock.Add(10 * time.Millisecond) // streamed, then failed at once
		r.sup.sessionEnded(began, start)
		if err := r.sup.retry(context.Background(), "postgres", errors.New("publication does not exist")); err != nil {
			t.Fatal(err)
		}
	}
	if last := waits[len(waits)-1]; last < cfg.BackoffMax/2 {
		t.Fatalf("after %d sessions failing at once the wait is %s (waits %v), want it grown towards --backoff-max %s", len(waits), last, waits, cfg.BackoffMax)
	}
	// Progress resets it.
	confirm.New(confirm.Config{Start: start, Every: time.Second, Clearance: r.guard.clearance, Progress: r.progress}).Sent(clock, start+100)
	r.sup.sessionEnded(clock, start)
	waits = nil
	if err := r.sup.retry(context.Background(), "postgres", errors.New("reset")); err != nil {
		t.Fatal(err)
	}
	if waits[0] > 2*cfg.BackoffMin {
		t.Fatalf("after a session that confirmed progress the wait is %s, want about --backoff-min %s", waits[0], cfg.BackoffMin)
	}
}

// TestReadyMetricFollowsReady checks walrelay_ready is read from Ready at
// scrape time: no code path has to remember to update it.
func TestReadyMetricFollowsReady(t *testing.T) {
	m := metrics.NewUnregistered()
	r, err := New(validConfig(), zap.NewNop(), m)
	if err != nil {
		t.Fatal(err)
	}
	if v := gaugeValue(t, m.Ready); v != 0 {
		t.Fatalf("walrelay_ready = %v before streaming, want 0", v)
	}
	r.live.streaming.Store(true)
	if v := gaugeValue(t, m.Ready); v != 1 {
		t.Fatalf("walrelay_ready = %v while streaming without lag, want 1", v)
	}
	r.live.lag.Store(int64(2 * r.cfg.ReadyMaxLag))
	if v := gaugeValue(t, m.Ready); v != 0 {
		t.Fatalf("walrelay_ready = %v with lag over --ready-max-lag, want 0", v)
	}
}

func gaugeValue(t *testing.T, g prometheus.Metric) float64 {
	t.Helper()
	var out dto.Metric
	if err := g.Write(&out); err != nil {
		t.Fatal(err)
	}
	return out.GetGauge().GetValue()
}

// TestDistrustAfterAnUnconfirmedCommit: after a Kafka commit whose outcome
// was not confirmed, a newer checkpoint found at the next start is skipped
// by only when the commit, read back, landed on every partition; otherwise
// (not landed, not readable, or nothing to read back) the session resumes
// after the last one Kafka confirmed (duplicates at worst). A checkpoint
// the doubtful commit did not write, and any checkpoint once nothing is in
// doubt, is taken as found.
func TestDistrustAfterAnUnconfirmedCommit(t *testing.T) {
	r, m := newExactlyOnceRelay(t)
	ctx := context.Background()
	asked := 0
	answer := func(ok bool, err error) func(context.Context, *router.CommitUnconfirmed) (bool, error) {
		return func(context.Context, *router.CommitUnconfirmed) (bool, error) {
			asked++
			return ok, err
		}
	}
	never := func(context.Context, *router.CommitUnconfirmed) (bool, error) {
		t.Fatal("read back a commit while nothing was in doubt")
		return false, nil
	}
	sure := resumePoint{found: true, ckpt: checkpoint.Durable{Slot: "walrelay", LSN: 100}}
	if got := r.commits.distrust(ctx, sure, never); got.ckpt.LSN != 100 {
		t.Fatalf("nothing in doubt: resumed after %s, want the checkpoint found", got.ckpt.LSN)
	}
	newer := resumePoint{found: true, ckpt: checkpoint.Durable{Slot: "walrelay", LSN: 200}}
	doubt := &router.CommitUnconfirmed{}
	for _, c := range []struct {
		name  string
		doubt *router.CommitUnconfirmed
		read  func(context.Context, *router.CommitUnconfirmed) (bool, error)
	}{
		{"aborted on a partition", doubt, answer(false, nil)},
		{"not readable", doubt, answer(false, errors.New("no broker"))},
		{"nothing to read back (the commit never asked)", nil, never},
	} {
		r.commits.unsure, r.commits.doubt = true, c.doubt
		if got := r.commits.distrust(ctx, newer, c.read); got.ckpt.LSN != 100 {
			t.Fatalf("%s: resumed after %s, want the last confirmed 0/64", c.name, got.ckpt.LSN)
		}
		if got := r.commits.distrust(ctx, sure, never); got.ckpt.LSN != 100 {
			t.Fatalf("%s, the doubtful commit did not write the checkpoint: resumed after %s, want 0/64", c.name, got.ckpt.LSN)
		}
	}
	if v := testutil.ToFloat64(m.UnconfirmedCommits); v != 3 {
		t.Fatalf("walrelay_kafka_unconfirmed_commits_total = %v after three resends, want 3", v)
	}
	r.commits.unsure, r.commits.doubt = true, doubt
	if got := r.commits.distrust(ctx, newer, answer(true, nil)); got.ckpt.LSN != 200 {
		t.Fatalf("landed everywhere: resumed after %s, want the checkpoint found", got.ckpt.LSN)
	}
	if r.commits.unsure || r.commits.lastSure.ckpt.LSN != 200 || asked != 3 {
		t.Fatalf("after a commit read back as landed: unsure %v, last sure %s, read back %d times; want sure of 0/C8, read back 3 times", r.commits.unsure, r.commits.lastSure.ckpt.LSN, asked)
	}
	if got := r.commits.distrust(ctx, newer, never); got.ckpt.LSN != 200 {
		t.Fatalf("doubt cleared: resumed after %s, want the checkpoint found", got.ckpt.LSN)
	}
}

// abortHanging asks the router to abort what Kafka left open of a commit
// in doubt, only then, and counts the partitions; a refusal of READ is a
// warning, not a stop (the resend after the last sure checkpoint still
// holds), other failures are tried again within hangingWait, then warned
// of; only the relay stopping ends the session.
func TestAbortHangingOnlyInDoubt(t *testing.T) {
	r, m := newExactlyOnceRelay(t)
	ctx := context.Background()
	never := func(context.Context, *router.CommitUnconfirmed) ([]string, error) {
		t.Fatal("looked for hanging transactions with no commit in doubt")
		return nil, nil
	}
	if err := r.commits.abortHanging(ctx, never); err != nil {
		t.Fatal(err)
	}
	r.commits.unsure = true // the commit never asked: nothing it wrote is known
	if err := r.commits.abortHanging(ctx, never); err != nil {
		t.Fatal(err)
	}
	r.commits.doubt = &router.CommitUnconfirmed{}
	if err := r.commits.abortHanging(ctx, func(context.Context, *router.CommitUnconfirmed) ([]string, error) {
		return []string{"outbox.event.order/1", "walrelay.checkpoints/0"}, nil
	}); err != nil {
		t.Fatal(err)
	}
	if v := testutil.ToFloat64(m.HangingAborted); v != 2 {
		t.Fatalf("walrelay_kafka_hanging_transactions_aborted_total = %v after two partitions, want 2", v)
	}
	denied := fmt.Errorf("find hanging Kafka transactions on outbox.event.order/1: %w", kerr.TopicAuthorizationFailed)
	if err := r.commits.abortHanging(ctx, func(context.Context, *router.CommitUnconfirmed) ([]string, error) { return nil, denied }); err != nil {
		t.Fatalf("READ denied: %v, want a warning only", err)
	}
	// A passing failure is tried again; one that lasts (a broker without
	// DescribeProducers) is given up on with a warning, never a stop.
	r.commits.hangingWait = 2500 * time.Millisecond
	tries := 0
	if err := r.commits.abortHanging(ctx, func(context.Context, *router.CommitUnconfirmed) ([]string, error) {
		if tries++; tries < 2 {
			return nil, errors.New("no leader yet")
		}
		return []string{"outbox.event.order/2"}, nil
	}); err != nil || tries != 2 || testutil.ToFloat64(m.HangingAborted) != 3 {
		t.Fatalf("a failure then success: %v after %d tries, %v aborted; want nil after 2, 3", err, tries, testutil.ToFloat64(m.HangingAborted))
	}
	tries = 0
	if err := r.commits.abortHanging(ctx, func(context.Context, *router.CommitUnconfirmed) ([]string, error) {
		tries++
		return nil, errors.New("broker is too old")
	}); err != nil || tries < 2 {
		t.Fatalf("a lasting failure: %v after %d tries; want nil (a warning) after trying again", err, tries)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := r.commits.abortHanging(cancelled, func(context.Context, *router.CommitUnconfirmed) ([]string, error) {
		return nil, errors.New("stopping")
	}); !errors.Is(err, context.Canceled) {
		t.Fatalf("relay stopping: %v, want the session to end", err)
	}
}

// newExactlyOnceRelay is a Relay in exactly-once mode that is never run,
// for the tests of what it remembers of its commits.
func newExactlyOnceRelay(t *testing.T) (*Relay, *metrics.Metrics) {
	t.Helper()
	cfg := validConfig()
	cfg.ExactlyOnce = true
	m := metrics.NewUnregistered()
	r, err := New(cfg, zap.NewNop(), m)
	if err != nil {
		t.Fatal(err)
	}
	return r, m
}
