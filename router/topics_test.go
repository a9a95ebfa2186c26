package router

import (
	"context"
	"fmt"
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/router/internal/topics"
)

// topicsExist reports which of names the broker has.
func (e *env) topicsExist(names ...string) map[string]bool {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	details, err := kadm.NewClient(e.r.client).ListTopics(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	got := map[string]bool{}
	for _, n := range names {
		d, ok := details[n]
		got[n] = ok && d.Err == nil
	}
	return got
}

// dlqByID reads the dead-letter topic by id header.
func (e *env) dlqByID() map[string]string {
	e.t.Helper()
	out := map[string]string{}
	for _, rec := range e.consume("walrelay.dlq") {
		id, _ := header(e.t, rec, "id")
		reason, _ := header(e.t, rec, deadletter.HeaderReason)
		out[string(id)] = string(reason)
	}
	return out
}

// The allowlist is anchored: events of topics it does not match are
// dead-lettered as topic_not_allowed and their topics never created;
// events of allowed topics go through.
func TestTopicAllowlist(t *testing.T) {
	e := newEnv(t, withDefaults(Config{TopicAllow: `outbox\.event\.(order|payment)`}))
	a := &testAcker{}
	e.mustSend(event("1", "order", "k", "p"), lsnOf(1), a)
	e.mustSend(event("2", "orderx", "k", "p"), lsnOf(2), a) // a suffix: anchored at the end
	e.mustSend(event("3", "payment", "k", "p"), lsnOf(3), a)
	e.mustSend(event("4", "x.order", "k", "p"), lsnOf(4), a) // anchored at the start too
	e.flush()
	if got := e.dlqByID(); got["2"] != string(deadletter.ReasonTopicNotAllowed) || got["4"] != string(deadletter.ReasonTopicNotAllowed) || len(got) != 2 {
		t.Fatalf("dead letters = %v; want ids 2 and 4 as %s", got, deadletter.ReasonTopicNotAllowed)
	}
	if got := e.topicsExist("outbox.event.order", "outbox.event.payment", "outbox.event.orderx", "outbox.event.x.order"); !got["outbox.event.order"] || !got["outbox.event.payment"] || got["outbox.event.orderx"] || got["outbox.event.x.order"] {
		t.Fatalf("topics = %v; want only the allowed ones created", got)
	}
	if a.adds.Load() != 4 || a.acks.Load() != 4 || e.fatals.Load() != 0 {
		t.Fatalf("adds/acks/fatals = %d/%d/%d; want 4/4/0", a.adds.Load(), a.acks.Load(), e.fatals.Load())
	}
	if _, err := New(withDefaults(Config{TopicAllow: "("}), nil, nil, e.m, nil); err == nil {
		t.Fatal("New accepted an invalid allowlist")
	}
}

// Past MaxTopics, events of new topics are dead-lettered as
// too_many_topics (their topics not created) while topics already used
// keep working; the count survives a new router sharing the topics.Set.
// Past MaxTopicSeries, topics count under the "other" label.
func TestMaxTopicsAndSeries(t *testing.T) {
	set := topics.NewSet()
	// Series: the dead-letter topic, t0, t1; the rest is "other".
	e := newEnv(t, withDefaults(Config{MaxTopics: 3, MaxTopicSeries: 3, Topics: set}))
	a := &testAcker{}
	for i := range 5 {
		e.mustSend(event(fmt.Sprintf("e%d", i), fmt.Sprintf("t%d", i), "k", "p"), lsnOf(i), a)
	}
	e.mustSend(event("again", "t0", "k", "p"), lsnOf(6), a)
	e.flush()
	if got := e.dlqByID(); got["e3"] != string(deadletter.ReasonTooManyTopics) || got["e4"] != string(deadletter.ReasonTooManyTopics) || len(got) != 2 {
		t.Fatalf("dead letters = %v; want e3 and e4 as %s", got, deadletter.ReasonTooManyTopics)
	}
	if got := e.topicsExist("outbox.event.t2", "outbox.event.t3"); !got["outbox.event.t2"] || got["outbox.event.t3"] {
		t.Fatalf("topics = %v; want t2 created, t3 not", got)
	}
	if got := e.publishedTo("outbox.event.t0"); got != 2 {
		t.Errorf("published{t0} = %v; want 2", got)
	}
	if got := e.publishedTo(topics.OtherLabel); got != 1 {
		t.Errorf("published{other} = %v; want 1 (t2)", got)
	}
	if got := e.publishedTo("outbox.event.t2"); got != 0 {
		t.Errorf("published{t2} = %v; want 0: past the series limit", got)
	}

	// A replacement router (same set) knows the three topics already used.
	r2, err := New(withDefaults(Config{MaxTopics: 3, MaxTopicSeries: 3, Topics: set, CreateTopics: true}), nil, e.r.log, e.m, func(error) {})
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if reason, _, _ := r2.route(event("n", "t9", "k", "p")); reason != deadletter.ReasonTooManyTopics {
		t.Errorf("new router: route to a fourth topic = %q; want %s", reason, deadletter.ReasonTooManyTopics)
	}
	if reason, _, _ := r2.route(event("n", "t1", "k", "p")); reason != "" {
		t.Errorf("new router: route to a used topic = %q; want accepted", reason)
	}
}

// A topic Kafka refuses for good is dead-lettered instead of retried
// forever or restarting the stream: one that does not exist and that the
// relay may not create, one a creation policy refuses, and a record the
// broker refuses by policy on the way (in flight: dead-lettered from the
// promise, with the aggregate type and id headers every dead letter
// carries). Events of other topics go on; nothing is fatal; every event is
// acked once; a later event of a refused topic goes straight to the dead
// letters, also under a new router sharing the topics.Set. (An
// authorization failure is not such a refusal: denied_test.go.)
func TestTopicRefusedForGood(t *testing.T) {
	set := topics.NewSet()
	e := newEnv(t, withDefaults(Config{Topics: set}))
	e.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.CreateTopics}, Topic: "outbox.event.secret", Err: kerr.TopicAuthorizationFailed, Count: -1})
	e.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.CreateTopics}, Topic: "outbox.event.policy", Err: kerr.PolicyViolation, Count: -1})
	e.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "outbox.event.locked", Err: kerr.PolicyViolation, Count: -1})
	a := &testAcker{}
	for i, agg := range []string{"secret", "order", "policy", "locked", "order"} {
		e.mustSend(event(fmt.Sprintf("e%d", i), agg, fmt.Sprintf("k%d", i), "p"), lsnOf(i), a)
	}
	e.flush()
	e.mustSend(event("late", "locked", "k9", "p"), lsnOf(9), a)
	e.flush()
	if e.fatals.Load() != 0 {
		t.Fatalf("fatal called: %v", e.fatalErr)
	}
	got := e.dlqByID()
	for _, id := range []string{"e0", "e2", "e3", "late"} {
		if got[id] != string(deadletter.ReasonTopicRejected) {
			t.Errorf("dead letter %s: reason %q; want %s (all: %v)", id, got[id], deadletter.ReasonTopicRejected, got)
		}
	}
	if len(got) != 4 {
		t.Errorf("dead letters = %v; want 4", got)
	}
	for _, rec := range e.consume("walrelay.dlq") {
		id, _ := header(t, rec, "id")
		aggType, okType := header(t, rec, deadletter.HeaderAggregateType)
		aggID, okID := header(t, rec, deadletter.HeaderAggregateID)
		if !okType || !okID || len(aggType) == 0 || string(aggID) != string(rec.Key) {
			t.Errorf("dead letter %s: %s %q (%v), %s %q (%v); want the aggregate type and id (the key %q)",
				id, deadletter.HeaderAggregateType, aggType, okType, deadletter.HeaderAggregateID, aggID, okID, rec.Key)
		}
	}
	if n := e.publishedTo("outbox.event.order"); n != 2 {
		t.Errorf("published{order} = %v; want 2", n)
	}
	if a.adds.Load() != 6 || a.acks.Load() != 6 {
		t.Errorf("adds/acks = %d/%d; want 6/6", a.adds.Load(), a.acks.Load())
	}
	if got := e.deadLettered(deadletter.ReasonTopicRejected); got != 4 {
		t.Errorf("dead-lettered{topic_rejected} = %v; want 4", got)
	}

	r2, err := New(withDefaults(Config{Topics: set}), nil, e.r.log, e.m, func(error) {})
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if _, tp, _ := r2.route(event("n", "locked", "k", "p")); tp == nil || tp.state != topicRejected {
		t.Errorf("new router: topic refused under the old one is not rejected: %+v", tp)
	}
}
