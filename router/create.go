package router

import (
	"context"
	"errors"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/router/internal/topics"
)

// prepareTimeout bounds one attempt at preparing a topic; a broker that
// does not answer in time is asked again on the next event for the topic.
const prepareTimeout = 30 * time.Second

// prepareRetryPause keeps a broker that fails quickly from being asked in
// a tight loop.
const prepareRetryPause = time.Second

// prepared is the outcome of preparing a topic.
type prepared struct {
	err    error
	limits topics.Limits
}

// startPrepare readies t in the background: creates it when topic creation
// is on, then reads its max.message.bytes so that records it would refuse
// are dead-lettered instead of failing in the producer. t.ready closes when
// the attempt is over; settle must then run on the sending goroutine. The
// attempt ends with ctx, or when the router closes: Close waits for it, so
// no admin request outlives the producer it belongs to.
func (r *Router) startPrepare(ctx context.Context, t *topic) {
	t.state = topicCreating
	t.ready = make(chan struct{})
	res := &prepared{}
	t.result = res
	r.preparing.Add(1)
	r.bg.Go(func() {
		defer close(t.ready)
		defer r.preparing.Add(-1)
		ctx, cancel := context.WithTimeout(ctx, prepareTimeout)
		defer cancel()
		defer context.AfterFunc(r.closing, cancel)()
		res.limits, res.err = r.prep.Prepare(ctx, t.name)
		if kafkaAnswered(res.err) {
			r.gate.answered.Add(1)
		}
	})
}

// kafkaAnswered reports whether err, a request's outcome, is an answer
// of Kafka's (success, or an error code it sent), not a timeout or a
// connection that failed.
func kafkaAnswered(err error) bool {
	var code *kerr.Error
	return err == nil || errors.As(err, &code)
}

// settle applies the outcome of a finished preparation. A denial is left
// to the caller to report (await, Start): only a topic an event waits
// for makes the relay not ready.
func (r *Router) settle(t *topic) {
	res := t.result
	t.result = nil
	var denial *topics.Denial
	t.deniedOp = ""
	switch {
	case res.err == nil:
		t.state, t.denials = topicReady, 0
		if t.denied.Load() && t.denied.CompareAndSwap(true, false) {
			r.granted(resourceTopic, t.name)
		}
		if n := res.limits.MaxBytes; n > 0 {
			t.maxBytes = min(r.cfg.MaxRecordBytes, n)
			r.limits.Store(t.name, n)
		}
		t.tsBefore, t.tsAfter = res.limits.TimestampBefore, res.limits.TimestampAfter
		r.log.Info("topic ready", zap.String("topic", t.name), zap.Int("max_record_bytes", t.maxBytes))
		if t.tsBefore > 0 || t.tsAfter > 0 {
			r.log.Info("the topic refuses record timestamps far from the broker's clock: records whose commit time lies outside the bounds carry the produce time instead, with the commit time in header "+HeaderCommitTime,
				zap.String("topic", t.name), zap.Duration("timestamp_before_max", t.tsBefore), zap.Duration("timestamp_after_max", t.tsAfter))
		}
	case topics.Rejects(res.err):
		t.state, t.rejectErr = topicRejected, res.err
		r.log.Warn("Kafka rejects topic; its events go to the dead-letter topic", zap.String("topic", t.name), zap.Error(res.err))
	case errors.As(res.err, &denial):
		// An ACL, which may change at any moment: wait and look again,
		// never dead-letter (denied.go).
		t.denials++
		t.state, t.lastErr, t.deniedOp = topicUnknown, denial.Err, denial.Op
		t.retryAt = time.Now().Add(deniedRetry(t.denials))
	default:
		t.state, t.lastErr = topicUnknown, res.err
		t.retryAt = time.Now().Add(prepareRetryPause)
		r.log.Warn("preparing topic failed; will retry", zap.String("topic", t.name), zap.Error(res.err))
	}
}
