package topics

// The topic of an event comes from a column applications write, so
// without bounds a writer chooses how many topics the relay creates and
// how many metric series it exports. Here: an allowlist (ParseAllow), a
// cap on the event topics used and a cap on the per-topic metric series
// (the rest count under OtherLabel), kept in a Set.
//
// What is learned is kept in a Set that outlives a producer: the relay
// replaces its router after a Kafka failure, and the bounds must hold for
// the process, not per router.

import (
	"fmt"
	"regexp"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultMaxTopics is the default bound on the event topics a relay uses
// (router.Config.MaxTopics). An outbox's topics follow the aggregate types
// of a domain model: tens, rarely hundreds. A thousand leaves room for
// that while stopping a runaway writer long before the topics, partitions
// and producer buffers it would create burden the cluster.
const DefaultMaxTopics = 1000

// DefaultMaxSeries is the default bound on the topics with their own
// metric series (router.Config.MaxTopicSeries): enough for every topic of
// a usual outbox, few enough for any Prometheus.
const DefaultMaxSeries = 100

// OtherLabel is the topic label of events published to topics past the
// series bound.
const OtherLabel = "other"

// Set is what a relay remembers about topics across producers: the event
// topics used (for the topic bound), the topics with their own metric
// series, the topics Kafka refused for good, and what Kafka's authorizer
// denies the relay now. It is safe for concurrent use; its size is bounded
// by the two bounds passed to Use and Label, and by the resources the
// relay is denied at once.
type Set struct {
	mu          sync.Mutex
	used        map[string]bool
	series      map[string]bool
	refused     map[string]string // topic → why
	produceTime map[string]bool
	denied      map[string]*denial // resource → the denial in force
	nDenied     atomic.Int32       // len(denied), read without the lock
}

// denial is an authorization failure in force, and when it was last
// logged at WARN.
type denial struct {
	why    string
	warned time.Time
}

// NewSet returns an empty Set.
func NewSet() *Set {
	return &Set{used: map[string]bool{}, series: map[string]bool{}, refused: map[string]string{}, produceTime: map[string]bool{},
		denied: map[string]*denial{}}
}

// DenialWarnEvery is how often a denial that lasts is logged at WARN
// again; in between its repeats are logged at DEBUG.
const DenialWarnEvery = 5 * time.Minute

// Deny records that Kafka's authorizer denies the relay an operation on
// resource (a topic, the transactional id), why, as of now: the relay is
// not ready while any denial is in force (Denied). It reports whether to
// warn: the denial is new, or was last warned of DenialWarnEvery ago.
func (s *Set) Deny(resource, why string, now time.Time) (warn bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.denied[resource]
	if d == nil {
		d = &denial{}
		s.denied[resource] = d
		s.nDenied.Store(int32(len(s.denied)))
	}
	d.why = why
	if d.warned.IsZero() || now.Sub(d.warned) >= DenialWarnEvery {
		d.warned = now
		return true
	}
	return false
}

// Allow forgets the denial on resource, once Kafka allowed the operation
// again; it reports whether one was in force.
func (s *Set) Allow(resource string) bool {
	if s.nDenied.Load() == 0 {
		return false // the common case, on every commit: no lock
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.denied[resource] == nil {
		return false
	}
	delete(s.denied, resource)
	s.nDenied.Store(int32(len(s.denied)))
	return true
}

// IsDenied reports whether a denial on resource is in force.
func (s *Set) IsDenied(resource string) bool {
	if s.nDenied.Load() == 0 {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.denied[resource] != nil
}

// Denied is why Kafka denies the relay an operation, for one of the
// denials in force (the first resource by name, so the answer is
// stable), or "" when none is.
func (s *Set) Denied() string {
	if s.nDenied.Load() == 0 {
		return ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	first := ""
	for r := range s.denied {
		if first == "" || r < first {
			first = r
		}
	}
	if first == "" {
		return ""
	}
	return s.denied[first].why
}

// Seed records names as event topics already in use, whatever the bound:
// topics that exist on the broker (made by this relay before a restart,
// or by an earlier process) count towards it, and stay usable even when
// there are more of them than the bound allows, so that a restart never
// turns an established aggregate type into dead letters. It returns how
// many event topics are counted now.
func (s *Set) Seed(names []string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range names {
		s.used[n] = true
	}
	return len(s.used)
}

// Use records name as an event topic; false when that would exceed max
// (max < 0: no limit). A topic used once stays usable.
func (s *Set) Use(name string, max int) bool {
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

// Label is the metric label of topic name: itself while fewer than max
// topics have their own series (max < 0: no limit), else OtherLabel.
func (s *Set) Label(name string, max int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.series[name] {
		return name
	}
	if max >= 0 && len(s.series) >= max {
		return OtherLabel
	}
	s.series[name] = true
	return name
}

// Refuse remembers that Kafka refused topic name for good, and why: later
// producers dead-letter its events without trying it again.
func (s *Set) Refuse(name, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refused[name] = why
}

// UseProduceTime remembers that Kafka refused a record of topic name for
// its timestamp (INVALID_TIMESTAMP): its records carry the time they are
// produced from then on, under later producers too.
func (s *Set) UseProduceTime(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.produceTime[name] = true
}

// ProduceTime reports whether topic name's records carry the produce
// time (UseProduceTime).
func (s *Set) ProduceTime(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.produceTime[name]
}

// Refusal is why Kafka refused topic name for good, or "".
func (s *Set) Refusal(name string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refused[name]
}

// ParseAllow compiles a topic allowlist (router.Config.TopicAllow),
// anchored at both ends so that "orders|payments" cannot match
// "orders-secret"; nil for "" (every topic allowed).
func ParseAllow(expr string) (*regexp.Regexp, error) {
	if expr == "" {
		return nil, nil
	}
	re, err := regexp.Compile(`^(?:` + expr + `)$`)
	if err != nil {
		return nil, fmt.Errorf("topic allowlist %q: %w", expr, err)
	}
	return re, nil
}
