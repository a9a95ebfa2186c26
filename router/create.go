package router

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"
)

// prepareTimeout bounds one attempt at preparing a topic; a broker that
// does not answer in time is asked again on the next event for the topic.
const prepareTimeout = 30 * time.Second

// prepareRetryPause keeps a broker that fails quickly from being asked in
// a tight loop.
const prepareRetryPause = time.Second

// prepared is the outcome of preparing a topic.
type prepared struct {
	err      error
	maxBytes int // 0: unknown
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
	r.bg.Go(func() {
		defer close(t.ready)
		ctx, cancel := context.WithTimeout(ctx, prepareTimeout)
		defer cancel()
		defer context.AfterFunc(r.closing, cancel)()
		if r.cfg.CreateTopics {
			_, err := r.admin.CreateTopic(ctx, r.cfg.TopicPartitions, r.cfg.TopicReplicationFactor, nil, t.name)
			if notAllowed(err) {
				// Not allowed to create: fine if an administrator did;
				// if the topic is missing (or hidden from us), its events
				// can never be produced.
				if exists, lerr := r.topicExists(ctx, t.name); lerr != nil {
					res.err = lerr
					return
				} else if !exists {
					res.err = fmt.Errorf("topic does not exist and creating it was refused: %w", err)
					return
				}
				err = nil
			}
			if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
				res.err = err
				return
			}
		}
		res.maxBytes = r.topicLimit(ctx, t.name)
	})
}

// topicLimit reads the topic's max.message.bytes; 0 when it cannot (not
// authorized, topic missing, an old broker): the configured limit applies.
func (r *Router) topicLimit(ctx context.Context, name string) int {
	rcs, err := r.admin.DescribeTopicConfigs(ctx, name)
	if err != nil {
		r.log.Debug("cannot read topic config; using --max-record-bytes", zap.String("topic", name), zap.Error(err))
		return 0
	}
	for _, rc := range rcs {
		if rc.Err != nil {
			r.log.Debug("cannot read topic config; using --max-record-bytes", zap.String("topic", name), zap.Error(rc.Err))
			return 0
		}
		for _, c := range rc.Configs {
			if c.Key == "max.message.bytes" && c.Value != nil {
				n, _ := strconv.Atoi(*c.Value)
				return n
			}
		}
	}
	return 0
}

// rejects reports whether err means Kafka will never accept the topic
// from this relay (an invalid name, a creation policy, no authorization to
// create or use it), so its events belong on the dead-letter topic.
func rejects(err error) bool {
	return errors.Is(err, kerr.InvalidTopicException) || refusedForGood(err) || notAllowed(err)
}

// topicExists reports whether the broker lists topic name to this relay.
// A topic it may not describe is listed with an authorization error and
// counts as missing: the relay could not produce to it either.
func (r *Router) topicExists(ctx context.Context, name string) (bool, error) {
	details, err := r.admin.ListTopics(ctx, name)
	if err != nil {
		return false, err
	}
	d, ok := details[name]
	if ok && d.Err != nil && !errors.Is(d.Err, kerr.UnknownTopicOrPartition) && !notAllowed(d.Err) {
		return false, d.Err
	}
	return ok && d.Err == nil, nil
}

// notAllowed reports an authorization failure: the topic may exist
// already (created by an administrator), and producing will tell.
func notAllowed(err error) bool {
	return errors.Is(err, kerr.TopicAuthorizationFailed) || errors.Is(err, kerr.ClusterAuthorizationFailed)
}

// settle applies the outcome of a finished preparation.
func (r *Router) settle(t *topic) {
	res := t.result
	t.result = nil
	switch {
	case res.err == nil:
		t.state = topicReady
		if res.maxBytes > 0 {
			t.maxBytes = min(r.cfg.MaxRecordBytes, res.maxBytes)
			r.limits.Store(t.name, res.maxBytes)
		}
		r.log.Info("topic ready", zap.String("topic", t.name), zap.Int("max_record_bytes", t.maxBytes))
	case rejects(res.err):
		t.state, t.rejectErr = topicRejected, res.err
		r.log.Warn("Kafka rejects topic; its events go to the dead-letter topic", zap.String("topic", t.name), zap.Error(res.err))
	default:
		t.state, t.lastErr = topicUnknown, res.err
		t.retryAt = time.Now().Add(prepareRetryPause)
		r.log.Warn("preparing topic failed; will retry", zap.String("topic", t.name), zap.Error(res.err))
	}
}
