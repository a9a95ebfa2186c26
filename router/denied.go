package router

// denied.go: what the router does when Kafka's authorizer denies the
// relay an operation (TOPIC_AUTHORIZATION_FAILED,
// TRANSACTIONAL_ID_AUTHORIZATION_FAILED, CLUSTER_AUTHORIZATION_FAILED).
// A denial is an ACL, which an operator can grant at any moment: it says
// nothing about the events, so none is dead-lettered or skipped for it.
// The router holds the event instead: a topic found denied before a record
// was produced to it (its preparation checks the operations the principal
// may do) keeps Send waiting, checked again with a growing pause; a record
// Kafka refuses is never acked and fails the router, whose caller restarts
// from its last confirmed position, where the next router finds the topic
// denied before producing and waits. Holding rather than re-producing
// refused records keeps the order of a partition: records sent after a
// refused one may already be in Kafka, and only a restart from the
// confirmed position sends everything again in order. Each denial is
// recorded in the topics.Set the relay's routers share, so the relay can
// report itself not ready until Kafka allows the operation again, and
// logged at WARN when new (and every topics.DenialWarnEvery while it
// lasts), naming the principal, the operation and the resource.

import (
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"
)

// DeniedError is Kafka's authorizer denying the relay's principal an
// operation it needs. The relay does not dead-letter or skip events for
// it: it confirms nothing past the event it could not deliver, reports
// itself not ready, and resumes by itself once the operation is allowed.
type DeniedError struct {
	// Principal is Config.Principal; empty when unknown.
	Principal string
	// Operation is the ACL operation denied: WRITE, DESCRIBE or
	// IDEMPOTENT_WRITE.
	Operation string
	// Resource is "topic", "transactional id" or "cluster"; Name the
	// topic or transactional id (empty for the cluster).
	Resource, Name string
	// Err is Kafka's answer.
	Err error
}

func (e *DeniedError) Error() string {
	who := e.Principal
	if who == "" {
		who = "the relay's principal"
	}
	what := fmt.Sprintf("%s %q", e.Resource, e.Name)
	if e.Resource == resourceCluster {
		what = "the cluster"
	}
	return fmt.Sprintf("Kafka denies %s %s on %s: grant it an ACL allowing %s on %s: %v", who, e.Operation, what, e.Operation, what, e.Err)
}

func (e *DeniedError) Unwrap() error { return e.Err }

// key is the resource's key in the topics.Set's denials.
func (e *DeniedError) key() string { return e.Resource + " " + e.Name }

const (
	resourceTopic   = "topic"
	resourceTxnID   = "transactional id"
	resourceCluster = "cluster"
)

// Denied returns what Kafka's authorizer denies the relay now, as the
// relay's routers found it (they share Config.Topics), or nil: the relay
// is not ready meanwhile.
func (r *Router) Denied() error {
	if why := r.topics.Denied(); why != "" {
		return errors.New(why)
	}
	return nil
}

// denial is err as a DeniedError when it is an authorization failure, of
// a record for topic or of a transactional call; nil otherwise.
func (r *Router) denial(err error, topic string) *DeniedError {
	var d *DeniedError
	if errors.As(err, &d) {
		return d
	}
	switch {
	case errors.Is(err, kerr.TransactionalIDAuthorizationFailed):
		return &DeniedError{Principal: r.cfg.Principal, Operation: "WRITE", Resource: resourceTxnID, Name: r.cfg.TransactionalID, Err: err}
	case errors.Is(err, kerr.TopicAuthorizationFailed):
		return &DeniedError{Principal: r.cfg.Principal, Operation: "WRITE", Resource: resourceTopic, Name: topic, Err: err}
	case errors.Is(err, kerr.ClusterAuthorizationFailed):
		// A produce needs no cluster permission since Kafka 2.8 (WRITE
		// on a topic implies idempotent writes); an older broker asks
		// for IDEMPOTENT_WRITE.
		return &DeniedError{Principal: r.cfg.Principal, Operation: "IDEMPOTENT_WRITE", Resource: resourceCluster, Err: err}
	}
	return nil
}

// deny records d in force (the relay is not ready until allowed), counts
// it and logs it: at WARN when new or every topics.DenialWarnEvery, else
// at DEBUG. It is safe for concurrent use (promises call it).
func (r *Router) deny(d *DeniedError) {
	r.metrics.KafkaDenied.WithLabelValues(d.Resource, d.Operation).Inc()
	msg := d.Error() + " (the relay waits, not ready, confirming nothing past the event it holds, and resumes by itself once granted)"
	log := r.log.Debug
	if r.topics.Deny(d.key(), msg, time.Now()) {
		log = r.log.Warn
		if r.cfg.Denials != nil {
			// The hold's WARN says it once; the details go at INFO.
			log = r.log.Info
		}
	}
	if r.cfg.Denials != nil {
		r.cfg.Denials.Hold("Denied", r.topics.Denied())
	}
	log(msg, zap.String("principal", d.Principal), zap.String("operation", d.Operation),
		zap.String("resource", d.Resource), zap.String("name", d.Name))
}

// granted forgets a denial on resource name once Kafka allowed what it
// denied (a topic prepared, a record of it acknowledged, a transactional
// call answered), and says so. It is safe for concurrent use.
func (r *Router) granted(resource, name string) {
	if r.topics.Allow(resource + " " + name) {
		if r.cfg.Denials != nil {
			if why := r.topics.Denied(); why != "" {
				r.cfg.Denials.Hold("Denied", why)
			} else {
				r.cfg.Denials.Clear()
			}
		}
		r.log.Info("Kafka allows the relay again what it denied: delivery resumes", zap.String("resource", resource), zap.String("name", name))
	}
}

// deniedRetryMax bounds the pause between two checks of a denied topic:
// delivery resumes within it once the operation is granted.
const deniedRetryMax = 10 * time.Second

// deniedRetry is the pause before the n-th check (n >= 1) of a denied
// topic: prepareRetryPause, doubling, at most deniedRetryMax.
func deniedRetry(n int) time.Duration {
	d := prepareRetryPause
	for i := 1; i < n && d < deniedRetryMax; i++ {
		d *= 2
	}
	return min(d, deniedRetryMax)
}

// topicDenied makes a DeniedError of topic t's preparation denial.
func (r *Router) topicDenied(t *topic, op string, err error) *DeniedError {
	return &DeniedError{Principal: r.cfg.Principal, Operation: op, Resource: resourceTopic, Name: t.name, Err: err}
}
