package router

// topics.go: bounding what writers can make the relay do with topics.
//
// The topic of an event comes from a column applications write, so
// without bounds a writer chooses how many topics the relay creates and
// how many metric series it exports, and a topic Kafka will not let the
// relay use (authorization, a creation policy) would stop the stream at
// its first event. Here: an allowlist (Config.TopicAllow), a cap on the
// event topics used (Config.MaxTopics), a cap on the per-topic series of
// walrelay_events_published_total (the rest count under "other"), and
// topics Kafka refuses for good dead-lettered instead of retried.
//
// What is learned is kept in a TopicSet that outlives a Router: the relay
// replaces its router after a Kafka failure, and the bounds must hold for
// the process, not per router.

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"sync"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
)

// DefaultMaxTopics is Config.MaxTopics' default. An outbox's topics follow
// the aggregate types of a domain model: tens, rarely hundreds. A thousand
// leaves room for that while stopping a runaway writer long before the
// topics, partitions and producer buffers it would create burden the
// cluster.
const DefaultMaxTopics = 1000

// DefaultMaxTopicSeries is Config.MaxTopicSeries' default: enough for
// every topic of a usual outbox, few enough for any Prometheus.
const DefaultMaxTopicSeries = 100

// OtherTopicLabel is the topic label of events published to topics past
// Config.MaxTopicSeries.
const OtherTopicLabel = "other"

// TopicSet is what a relay remembers about topics across routers: the
// event topics used (for MaxTopics), the topics with their own metric
// series, and the topics Kafka refused for good. It is safe for
// concurrent use; its size is bounded by MaxTopics and MaxTopicSeries.
type TopicSet struct {
	mu      sync.Mutex
	used    map[string]bool
	series  map[string]bool
	refused map[string]string // topic → why
}

// NewTopicSet returns an empty TopicSet.
func NewTopicSet() *TopicSet {
	return &TopicSet{used: map[string]bool{}, series: map[string]bool{}, refused: map[string]string{}}
}

// use records name as an event topic; false when that would exceed max
// (max < 0: no limit).
func (s *TopicSet) use(name string, max int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used[name] {
		return true
	}
	if max >= 0 && len(s.used) >= max {
		return false
	}
	s.used[name] = true
	return true
}

// label is the metric label of topic name: itself while fewer than max
// topics have their own series (max < 0: no limit), else "other".
func (s *TopicSet) label(name string, max int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.series[name] {
		return name
	}
	if max >= 0 && len(s.series) >= max {
		return OtherTopicLabel
	}
	s.series[name] = true
	return name
}

// refuse remembers that Kafka refused topic name for good.
func (s *TopicSet) refuse(name, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refused[name] = why
}

// refusal is why Kafka refused topic name for good, or "".
func (s *TopicSet) refusal(name string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refused[name]
}

// ParseTopicAllow compiles a topic allowlist (Config.TopicAllow), anchored
// at both ends so that "orders|payments" cannot match "orders-secret"; nil
// for "" (every topic allowed).
func ParseTopicAllow(expr string) (*regexp.Regexp, error) {
	if expr == "" {
		return nil, nil
	}
	re, err := regexp.Compile(`^(?:` + expr + `)$`)
	if err != nil {
		return nil, fmt.Errorf("topic allowlist %q: %w", expr, err)
	}
	return re, nil
}

// checkNewTopic says why events may not go to name, a topic not used yet.
func (r *Router) checkNewTopic(name string) (Reason, string) {
	if r.allow != nil && !r.allow.MatchString(name) {
		return ReasonTopicNotAllowed, fmt.Sprintf("topic %q does not match the topic allowlist %q", name, r.cfg.TopicAllow)
	}
	if !r.topics.use(name, r.cfg.MaxTopics) {
		return ReasonTooManyTopics, fmt.Sprintf("topic %q would be one topic more than the limit of %d event topics (--max-topics)", name, r.cfg.MaxTopics)
	}
	return "", ""
}

// refusedForGood reports an error by which Kafka refuses a topic to this
// relay for good: not authorized, or against the cluster's policy. Events
// of such a topic are dead-lettered.
func refusedForGood(err error) bool {
	return errors.Is(err, kerr.TopicAuthorizationFailed) || errors.Is(err, kerr.PolicyViolation)
}

// redirect dead-letters a record Kafka refused because of its topic, on
// the promise goroutine: the topic is remembered as refused (its later
// events are dead-lettered by Send), and the record goes to the dead-letter
// topic carrying the original's acker, so the event is acknowledged once
// the dead letter is. With exactly-once delivery the Kafka transaction
// cannot carry on after a failed record: the router fails instead, and
// the next session dead-letters the event before producing it.
func (r *Router) redirect(o *outRecord, err error) {
	t := o.topic
	why := err.Error()
	r.topics.refuse(t.name, why)
	t.refused.Store(true)
	r.log.Warn("Kafka refuses the topic for good; its events go to the dead-letter topic",
		zap.String("topic", t.name), zap.Error(err))
	if r.eos || r.cfg.OnInvalid == InvalidFail {
		r.fail(fmt.Errorf("produce to %s: %w", t.name, err))
		return
	}
	r.metrics.EventsDeadLettered.WithLabelValues(string(ReasonTopicRejected)).Inc()
	if r.cfg.OnInvalid == InvalidSkip {
		o.ack.Ack()
		return
	}
	d := &outRecord{topic: r.dlq, ack: o.ack}
	d.rec.Topic = r.dlq.name
	d.rec.Key = o.rec.Key
	d.rec.Timestamp = o.rec.Timestamp
	h := []kgo.RecordHeader{
		{Key: HeaderReason, Value: []byte(ReasonTopicRejected)},
		{Key: HeaderDetail, Value: truncate([]byte(why), 1024)},
		{Key: HeaderTable, Value: []byte(o.table.String())},
		{Key: HeaderLSN, Value: []byte(o.lsn.String())},
		{Key: HeaderTopic, Value: []byte(t.name)},
	}
	h = append(h, o.rec.Headers...)
	d.rec.Headers = h
	d.rec.Value = o.rec.Value
	d.size = recordSize(d.rec.Key, d.rec.Value, h)
	if d.size > r.dlq.maxBytes {
		d.rec.Value = nil
		d.rec.Headers = append(d.rec.Headers, kgo.RecordHeader{Key: HeaderPayloadOmit, Value: []byte(strconv.Itoa(len(o.rec.Value)))})
		d.size = recordSize(d.rec.Key, nil, d.rec.Headers)
	}
	r.gate.acquire(d.size)
	r.client.TryProduce(context.Background(), &d.rec, r.promise)
}
