package relay

// guard_test.go: what the guard does when PostgreSQL cannot be reached or
// ends its connections (guard_pg_test.go has what it does with a server).

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// refusingPGURL is a PostgreSQL URL whose port refuses connections.
func refusingPGURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	return "postgres://walrelay:secret@" + closed + "/app?sslmode=disable&connect_timeout=5"
}

// observedRelay is a relay of cfg whose log the test reads.
func observedRelay(t *testing.T, cfg Config) (*Relay, *observer.ObservedLogs, *metrics.Metrics) {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	m := metrics.NewUnregistered()
	r, err := New(cfg, zap.New(core), m)
	if err != nil {
		t.Fatal(err)
	}
	return r, logs, m
}

// currentSession makes a session on a fake stream the one in progress.
func currentSession(r *Relay) (*session, *fakeStream) {
	st := newFakeStream()
	s := &session{r: r, stream: st, failed: make(chan error, 1)}
	r.live.current.Store(s)
	return s, st
}

// endedWith is the error the session in progress was ended with, nil when
// it was not ended (nor its stream interrupted).
func endedWith(t *testing.T, s *session, st *fakeStream) error {
	t.Helper()
	select {
	case err := <-s.failed:
		if len(st.intr) == 0 {
			t.Error("the session was ended without interrupting its stream")
		}
		return err
	default:
		return nil
	}
}

// TestWatchFailedEndsTheSessionOnlyWhenTheServerShutsDown: a shutting-down
// server's walsender waits for the relay to confirm its last WAL, which the
// watch cannot vouch for while connections are refused: a failed check
// that shows a shutdown (refused at connection, or ended with a server
// that no longer accepts connections) ends the stream so that the
// shutdown goes on. Any other failure is only logged, and the watch
// retries.
func TestWatchFailedEndsTheSessionOnlyWhenTheServerShutsDown(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		end  bool
		log  string
	}{
		{"refused at connection: shutting down", &pgconn.PgError{Code: "57P03", Message: "the database system is shutting down"}, true, "the server is shutting down"},
		{"connection ended, no server to reconnect to", &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}, true, "the server is shutting down"},
		{"another failure", errors.New("i/o timeout"), false, "publication watch: the check failed; nothing is confirmed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := validConfig()
			cfg.PGURL = refusingPGURL(t)
			r, logs, _ := observedRelay(t, cfg)
			s, st := currentSession(r)
			r.guard.watchFailed(context.Background(), tc.err, "the check failed")
			err := endedWith(t, s, st)
			if (err != nil) != tc.end {
				t.Fatalf("session ended with %v, want ended %v", err, tc.end)
			}
			if tc.end && (!errors.Is(err, tc.err) || !strings.Contains(err.Error(), "shutting down")) {
				t.Errorf("the session ended with %v, want the server's error, saying it shuts down", err)
			}
			if logs.FilterMessageSnippet(tc.log).Len() != 1 {
				t.Errorf("no line saying %q: %v", tc.log, logs.All())
			}
		})
	}
}

// TestPublicationWatchThatCannotConnectVouchesForNothing: a watch that
// cannot reach the server says so and vouches for nothing (so nothing past
// the last vouched position is confirmed), and keeps trying until the
// relay stops.
func TestPublicationWatchThatCannotConnectVouchesForNothing(t *testing.T) {
	cfg := validConfig()
	cfg.PGURL = refusingPGURL(t)
	r, logs, _ := observedRelay(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	var stopped error
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.guard.watchPublication(ctx, func(err error) { stopped = err })
	}()
	r.guard.clearance.Want(5000)
	waitFor(t, "the watch to say it cannot connect", func() bool {
		return logs.FilterMessageSnippet("publication watch: cannot connect; nothing is confirmed").Len() > 0
	})
	cancel()
	<-done
	if got := r.guard.clearance.Upto(); got != 0 {
		t.Errorf("vouched for %s without a check", got)
	}
	if stopped != nil {
		t.Errorf("a watch that cannot connect stopped the relay: %v", stopped)
	}
}

// TestRefusalStopsEvenWhenItCannotBeWrittenDown: a refusal that cannot be
// written into walrelay's record still stops this relay (it is counted,
// and nothing more is vouched for on the way out), and the log says a
// restart may not refuse.
func TestRefusalStopsEvenWhenItCannotBeWrittenDown(t *testing.T) {
	cfg := validConfig()
	cfg.PGURL = refusingPGURL(t)
	r, logs, m := observedRelay(t, cfg)
	r.guard.refuse(context.Background(), nil, &slot.GapError{What: "publication altered", Since: 100})
	if !r.guard.refused.Load() || testutil.ToFloat64(m.GapRefusals) != 1 {
		t.Fatalf("refused %v, walrelay_gap_refusals_total %v: want the refusal to stand and be counted", r.guard.refused.Load(), testutil.ToFloat64(m.GapRefusals))
	}
	if logs.FilterMessageSnippet("cannot write the refusal into walrelay's record; a restart may not refuse").FilterLevelExact(zapcore.ErrorLevel).Len() != 1 {
		t.Errorf("no error saying the refusal was not written: %v", logs.All())
	}
	// A stop after the refusal checks nothing more.
	logs.TakeAll()
	r.guard.vouchFinal(context.Background(), 200)
	if logs.Len() != 0 || r.guard.clearance.Upto() != 0 {
		t.Errorf("a refused relay's stop checked the publication: %v", logs.All())
	}
}

// TestVouchFinalChecksOnlyWhatIsNotVouchedFor: a stopping session asks
// the publication watch once more only for positions it has not vouched
// for yet; when the server cannot be reached it says that the last
// acknowledged events are confirmed at the next start.
func TestVouchFinalChecksOnlyWhatIsNotVouchedFor(t *testing.T) {
	cfg := validConfig()
	cfg.PGURL = refusingPGURL(t)
	r, logs, _ := observedRelay(t, cfg)
	r.guard.clearance.Vouch(500)
	r.guard.vouchFinal(context.Background(), 500)
	if logs.Len() != 0 {
		t.Fatalf("checked the publication for a position vouched for: %v", logs.All())
	}
	r.guard.vouchFinal(context.Background(), decoder.LSN(501))
	if logs.FilterMessageSnippet("cannot check the publication before stopping: the last acknowledged events are confirmed at the next start").Len() != 1 {
		t.Fatalf("no warning that the last events wait for the next start: %v", logs.All())
	}
}

// TestWarnResendNamesASlotThatIsNotASynchronizedCopy: after a promotion,
// a slot behind what the relay acknowledged that is not the copy slot
// synchronization keeps (synced = false on a failover slot) is named as
// the old primary's own slot, with what to do; the warning says what is
// sent again, which depends on the delivery.
func TestWarnResendNamesASlotThatIsNotASynchronizedCopy(t *testing.T) {
	no, yes := false, true
	for _, eos := range []bool{false, true} {
		cfg := validConfig()
		cfg.ExactlyOnce = eos
		r, logs, _ := observedRelay(t, cfg)
		info := slot.Info{ConfirmedLSN: 0x1000, Synced: &no, Failover: &yes}
		if r.guard.warnResend(info, 0x1000, "acked", true) || r.guard.warnResend(slot.Info{}, 0x1000, "acked", true) {
			t.Fatal("warned with the slot not behind, or its position unknown")
		}
		if !r.guard.warnResend(info, 0x3000, "what this process had acknowledged on the old timeline", true) {
			t.Fatal("no warning with the slot behind")
		}
		msg := logs.All()[0].Message
		for _, want := range []string{"8.0 KiB (8192 bytes) behind what this process had acknowledged", "this server was a standby until its promotion", "remove the old primary's slot"} {
			if !strings.Contains(msg, want) {
				t.Errorf("exactly-once %v: the warning does not say %q: %s", eos, want, msg)
			}
		}
		if want := map[bool]string{false: "duplicates in Kafka", true: "exactly-once skips"}[eos]; !strings.Contains(msg, want) {
			t.Errorf("exactly-once %v: the warning does not say %q: %s", eos, want, msg)
		}
	}
}

// TestSessionGapPassesOtherErrors: only a vanished publication becomes a
// refusal; any other end of a stream is returned as it is, to be retried.
func TestSessionGapPassesOtherErrors(t *testing.T) {
	r, _, m := observedRelay(t, validConfig())
	err := errors.New("connection reset")
	if got := r.guard.sessionGap(context.Background(), err); got != err || r.guard.refused.Load() || testutil.ToFloat64(m.GapRefusals) != 0 {
		t.Fatalf("sessionGap(%v) = %v (refused %v)", err, got, r.guard.refused.Load())
	}
}

// isGap reports whether err is a refusal (*slot.GapError).
func isGap(err error) bool {
	var g *slot.GapError
	return errors.As(err, &g)
}

// TestFencedErrorNamesTheSecondProducersID: with two producers, ids that
// differ collide ("orders" with two producers, "orders-1" on another
// relay); the refusal of either relay says so, or the operator, seeing two
// different ids, has nothing to go on.
func TestFencedErrorNamesTheSecondProducersID(t *testing.T) {
	for _, tc := range []struct {
		id        string
		producers int
		want      string
	}{
		{"orders", 2, `its second producer uses "orders-1"`},
		{"orders-1", 1, `"orders-1" is also the second producer's id of a relay with transactional id "orders"`},
		{"orders", 1, ""},
	} {
		cfg := validConfig()
		cfg.ExactlyOnce, cfg.Router.TransactionalID, cfg.Router.TxnProducers = true, tc.id, tc.producers
		r, _, _ := observedRelay(t, cfg)
		r.guard.slotHolder = func(context.Context, uint32) (bool, error) { return true, nil }
		err := r.guard.afterFence(fmt.Errorf("commit: %w", router.ErrFenced), 4242)
		if !isFatal(err) {
			t.Fatalf("%s, %d producers: %v, want fatal", tc.id, tc.producers, err)
		}
		if tc.want == "" && strings.Contains(err.Error(), "second producer") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s, %d producers: %v\nwant it to say %q", tc.id, tc.producers, err, tc.want)
		}
	}
}
