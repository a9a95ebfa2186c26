package router

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// topicState is what the router knows about one destination topic.
type topicState int

const (
	topicUnknown  topicState = iota // not yet created or checked
	topicCreating                   // creation and the size-limit lookup running in the background
	topicReady                      // records may be produced
	topicRejected                   // Kafka refused it for good: dead-letter its events
)

// topic is the router's cache entry for one destination. It is touched only
// by the goroutine that calls Send, except published, a counter.
type topic struct {
	name      string
	state     topicState
	rejectErr error
	lastErr   error         // why the last preparation failed
	retryAt   time.Time     // no new attempt before this, after a failure
	ready     chan struct{} // closed when preparation finishes, while state is topicCreating
	result    *prepared     // preparation outcome, written before ready closes
	maxBytes  int           // the largest record the topic accepts
	published prometheus.Counter
	refused   atomic.Bool // Kafka refused a record of it for good (set on the promise goroutine)
}

// retryWait is a channel that delivers when the next attempt may start.
func (t *topic) retryWait() <-chan struct{} {
	ch := make(chan struct{})
	time.AfterFunc(time.Until(t.retryAt), func() { close(ch) })
	return ch
}
