package relay

// supervisor.go: when the relay tries again, and when it gives up. The
// supervisor owns the backoff between attempts, the clock of
// StartupTimeout and whether the relay has streamed since Run began: Run's
// loop asks it after every failed attempt (retry), and tells it how each
// session went (sessionEnded), so that a fault met right after every start
// backs off rather than hammering the servers.

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/confirm"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/metrics"
)

// supervisor decides the relay's retries.
type supervisor struct {
	cfg      Config
	log      *zap.Logger
	metrics  *metrics.Metrics
	progress *confirm.Progress
	backoff  *backoff.ExponentialBackOff
	// waiting is the cause of the retry in progress (a RestartCause), for
	// readiness to say what a relay that does not stream waits for.
	waiting atomic.Value
	// pg is the postgresql condition (package holds): held from a
	// failure of PostgreSQL's until a stream starts.
	pg *holds.Condition
	// begin is when Run started, or when a snapshot last showed both
	// servers answering: StartupTimeout counts from it.
	begin time.Time
	// streamed is set once a stream started: from then on the relay
	// retries forever.
	streamed atomic.Bool
	// now and sleep are retry's clock and wait (sleep returns false when
	// ctx ended first); unit tests replace them to check the waits.
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) bool
}

func newSupervisor(cfg Config, log *zap.Logger, m *metrics.Metrics, progress *confirm.Progress) *supervisor {
	return &supervisor{
		cfg: cfg, log: log, metrics: m, progress: progress,
		backoff: &backoff.ExponentialBackOff{
			InitialInterval:     cfg.BackoffMin,
			RandomizationFactor: 0.5,
			Multiplier:          2,
			MaxInterval:         cfg.BackoffMax,
		},
		now:   time.Now,
		sleep: sleepCtx,
		pg:    cfg.Holds.Condition(holds.PostgreSQL),
	}
}

// started restarts the clock of StartupTimeout: at Run's start, and when
// an initial snapshot showed both servers answering.
func (v *supervisor) started() { v.begin = v.now() }

// retry logs err, counts it and sleeps a backoff (before the first stream
// at most until StartupTimeout runs out). It returns nil when the caller
// should try again, else why to stop instead: ctx's error when ctx ended,
// or a fatal error when the relay never streamed within StartupTimeout and
// err is not a standby's wait for a busy slot.
func (v *supervisor) retry(ctx context.Context, cause RestartCause, err error) error {
	if cause != CauseSlotBusy && !v.streamed.Load() && v.cfg.StartupTimeout > 0 && v.now().Sub(v.begin) > v.cfg.StartupTimeout {
		return &StartupTimeoutError{Timeout: v.cfg.StartupTimeout, Err: err}
	}
	wait := min(v.backoff.NextBackOff(), v.cfg.BackoffMax)
	if cause != CauseSlotBusy && !v.streamed.Load() && v.cfg.StartupTimeout > 0 {
		// End the sleep at the deadline: one last attempt then, and the
		// next failure gives up on time instead of a backoff late.
		wait = max(min(wait, v.begin.Add(v.cfg.StartupTimeout).Sub(v.now())), 0)
	}
	v.metrics.StreamRestarts.WithLabelValues(string(cause)).Inc()
	v.waiting.Store(cause)
	if reason := pgHoldReason(cause, err); reason != "" {
		v.pg.Hold(reason, err.Error())
	}
	switch cause {
	case CauseSlotBusy:
		v.log.Info("waiting as a standby: another client streams from the slot", zap.String("slot", v.cfg.Slot),
			zap.Error(err), zap.Duration("retry_in", wait))
	case CauseKafkaAuthorization:
		// The router warned, naming the principal, the operation and the
		// resource (once, then every few minutes): a restart per
		// backoff while the ACL is missing is no news.
		v.log.Info("relay restarting from the last confirmed position: Kafka denies it an operation", zap.Error(err),
			zap.Duration("backoff", wait), zap.Stringer("confirmed_lsn", v.progress.Confirmed()))
	default:
		v.log.Warn("relay restarting from the last confirmed position", zap.String("cause", string(cause)), zap.Error(err),
			zap.Duration("backoff", wait), zap.Stringer("confirmed_lsn", v.progress.Confirmed()))
	}
	if !v.sleep(ctx, wait) {
		return ctx.Err()
	}
	return nil
}

// notStreaming is why a relay that does not stream is not ready, as far
// as the supervisor knows (the holds, which readiness reads first, name
// a dependency at fault).
func (v *supervisor) notStreaming() string {
	if c, _ := v.waiting.Load().(RestartCause); c == CauseSlotBusy {
		return "not streaming: waiting as a standby, as another client streams from slot " + v.cfg.Slot
	}
	return "not streaming: connecting, waiting for the slot or backing off"
}

// startupDeadline is when the relay gives up if it has not streamed by
// then; zero when it never does. A creation of the slot that still waits
// for transactions at that time is cancelled (source.SetupConfig.CreateDeadline):
// left waiting, it would hold the start past StartupTimeout without a
// retry ever seeing it.
func (v *supervisor) startupDeadline() time.Time {
	if v.cfg.StartupTimeout <= 0 || v.streamed.Load() {
		return time.Time{}
	}
	return v.begin.Add(v.cfg.StartupTimeout)
}

// sessionEnded resets the backoff after a session that lasted BackoffMax
// or confirmed past its start: only such a session shows the fault before
// it was passing. One that fails at once again must not reset it, or a
// fault met right after every start retries at the shortest wait forever.
func (v *supervisor) sessionEnded(began time.Time, start decoder.LSN) {
	if v.now().Sub(began) >= v.cfg.BackoffMax || v.progress.Confirmed() > start {
		v.backoff.Reset()
	}
}

// sleepCtx waits d; false when ctx ends first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
