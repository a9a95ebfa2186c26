package router

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// topicState is what the router knows about one destination topic.
type topicState int

const (
	topicUnknown  topicState = iota // not yet created or checked, or found denied (deniedOp): checked again
	topicCreating                   // creation and the size-limit lookup running in the background
	topicReady                      // records may be produced
	topicRejected                   // Kafka refused it for good: dead-letter its events
)

// topic is the router's cache entry for one destination. It is touched only
// by the goroutine that calls Send, except published, a counter, and its
// atomic fields, which promises set and read too.
type topic struct {
	name      string
	state     topicState
	rejectErr error
	lastErr   error     // why the last preparation failed
	retryAt   time.Time // no new attempt before this, after a failure
	deniedOp  string    // the operation the last preparation found denied, "" if none
	denials   int       // preparations denied in a row, for the pause before the next
	// denied: a denial of this topic is in force in the topics.Set, to
	// be lifted once Kafka acknowledges one of its records (set and
	// read on the promise goroutine too).
	denied    atomic.Bool
	ready     chan struct{} // closed when preparation finishes, while state is topicCreating
	result    *prepared     // preparation outcome, written before ready closes
	maxBytes  int           // the largest record the topic accepts
	published prometheus.Counter
	refused   atomic.Bool // Kafka refused a record of it for good (set on the promise goroutine)
	// tsBefore and tsAfter bound how far a record's timestamp may lie
	// from the broker's clock (topics.Limits); 0: no bound known.
	tsBefore, tsAfter time.Duration
	// produceTime: Kafka refused a record's timestamp (the commit time):
	// every record carries the produce time (set on the promise
	// goroutine, and from the topic set when the entry is made).
	produceTime atomic.Bool
}

// retryWait is a channel that delivers when the next attempt may start.
func (t *topic) retryWait() <-chan struct{} {
	ch := make(chan struct{})
	time.AfterFunc(time.Until(t.retryAt), func() { close(ch) })
	return ch
}

// countExistingTopics counts the topics on the broker that the topic
// template makes (and the allowlist allows) as event topics in use: the
// bound on event topics (MaxTopics) is about what exists, not about what
// this process has produced to, so it holds across restarts, and a topic
// that exists stays usable whatever the bound. skip names the relay's
// other topics (dead-letter, checkpoint, heartbeat), which a template
// such as "{aggregate_type}" would also match.
func (r *Router) countExistingTopics(ctx context.Context, skip []string) error {
	if r.tmpl.Fixed() || r.cfg.MaxTopics < 0 {
		return nil
	}
	td, err := r.admin.ListTopics(ctx)
	if err != nil {
		return fmt.Errorf("list topics to count the event topics that exist (router.Config.MaxTopics): %w", err)
	}
	var names []string
	for name, d := range td {
		if d.IsInternal || d.Err != nil || slices.Contains(skip, name) || !r.tmpl.Produces(name) ||
			r.allow != nil && !r.allow.MatchString(name) {
			continue
		}
		names = append(names, name)
	}
	n := r.topics.Seed(names)
	if n >= r.cfg.MaxTopics {
		r.log.Warn("the event topics on the broker reach router.Config.MaxTopics: they stay in use, and events of further aggregate types are dead-lettered (too_many_topics); raise router.Config.MaxTopics, or delete topics no longer used",
			zap.Int("event_topics", n), zap.Int("max_topics", r.cfg.MaxTopics))
	} else if len(names) > 0 {
		r.log.Info("event topics that exist on the broker count towards router.Config.MaxTopics", zap.Int("event_topics", n), zap.Int("max_topics", r.cfg.MaxTopics))
	}
	return nil
}
