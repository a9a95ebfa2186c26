package router

import (
	"context"
	"errors"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"
)

// createTimeout bounds one attempt at creating a topic; a broker that does
// not answer in time is asked again on the next event for the topic.
const createTimeout = 30 * time.Second

// createRetryPause keeps a broker that fails creation quickly from being
// asked in a tight loop.
const createRetryPause = time.Second

// startCreate creates t in the background; t.ready closes when the attempt
// is over and settle must then be called on the sending goroutine.
func (r *Router) startCreate(ctx context.Context, t *topic) {
	t.state = topicCreating
	t.ready = make(chan struct{})
	var result error
	t.result = &result
	go func() {
		defer close(t.ready)
		ctx, cancel := context.WithTimeout(ctx, createTimeout)
		defer cancel()
		_, err := r.admin.CreateTopic(ctx, r.cfg.TopicPartitions, r.cfg.TopicReplicationFactor, nil, t.name)
		if errors.Is(err, kerr.TopicAlreadyExists) {
			err = nil
		}
		result = err
		if err != nil && !rejects(err) && !errors.Is(err, kerr.TopicAuthorizationFailed) && !errors.Is(err, kerr.ClusterAuthorizationFailed) {
			select {
			case <-time.After(createRetryPause):
			case <-ctx.Done():
			}
		}
	}()
}

// rejects reports whether err means Kafka will never accept the topic's
// name, so its events belong on the dead-letter topic.
func rejects(err error) bool { return errors.Is(err, kerr.InvalidTopicException) }

// settle applies the outcome of a finished creation.
func (r *Router) settle(t *topic) {
	err := *t.result
	t.result = nil
	switch {
	case err == nil:
		t.state = topicReady
		r.log.Info("topic ready", zap.String("topic", t.name))
	case rejects(err):
		t.state, t.rejectErr = topicRejected, err
		r.log.Warn("Kafka rejects topic; its events go to the dead-letter topic", zap.String("topic", t.name), zap.Error(err))
	case errors.Is(err, kerr.TopicAuthorizationFailed), errors.Is(err, kerr.ClusterAuthorizationFailed):
		// Not allowed to create topics: it may exist already (created by
		// an administrator), and producing will tell.
		t.state = topicReady
		r.log.Warn("not authorized to create topic; producing to it as if it exists", zap.String("topic", t.name), zap.Error(err))
	default:
		t.state = topicUnknown
		r.log.Warn("creating topic failed; will retry", zap.String("topic", t.name), zap.Error(err))
	}
}
