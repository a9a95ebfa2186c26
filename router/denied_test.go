package router

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/router/internal/topics"
)

const (
	relayPrincipal = "User:relay"
	scramMechanism = "SCRAM-SHA-256"
)

// newACLEnv is an env on a kfake cluster with ACLs, as Kafka with an
// authorizer and allow.everyone.if.no.acl.found=false: the router produces
// as the SCRAM user "relay", which may describe, create and read the
// configuration of every topic and write to the topics writable names
// only; the test's own clients are the super user "admin".
func newACLEnv(t *testing.T, cfg Config, writable ...string) *env {
	t.Helper()
	return newACLEnvWith(t, cfg, nil, writable...)
}

// newACLEnvWith is newACLEnv with extra ACLs for the relay.
func newACLEnvWith(t *testing.T, cfg Config, extra []kfake.ACL, writable ...string) *env {
	t.Helper()
	all := func(op kmsg.ACLOperation) kfake.ACL {
		return kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: "*", Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: op, Allow: true}
	}
	acls := append([]kfake.ACL{all(kmsg.ACLOperationDescribe), all(kmsg.ACLOperationCreate), all(kmsg.ACLOperationDescribeConfigs)}, extra...)
	for _, topic := range writable {
		acls = append(acls, kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: topic, Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationWrite, Allow: true})
	}
	cfg.Principal = relayPrincipal
	return newEnvAs(t, cfg,
		[]kgo.Opt{kgo.SASL(scram.Auth{User: "relay", Pass: "relay-pass"}.AsSha256Mechanism())},
		[]kgo.Opt{kgo.SASL(scram.Auth{User: "admin", Pass: "admin-pass"}.AsSha256Mechanism())},
		kfake.EnableACLs(), kfake.Superuser(scramMechanism, "admin", "admin-pass"), kfake.User(scramMechanism, "relay", "relay-pass", acls...))
}

// setWrite grants (or revokes) the relay WRITE on topic.
func (e *env) setWrite(topic string, allow bool) {
	e.t.Helper()
	cl := e.helper()
	defer cl.Close()
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	b := kadm.NewACLs().Allow(relayPrincipal).AllowHosts().Topics(topic).Operations(kadm.OpWrite)
	var err error
	if allow {
		var res kadm.CreateACLsResults
		if res, err = adm.CreateACLs(ctx, b); err == nil {
			for _, r := range res {
				err = errors.Join(err, r.Err)
			}
		}
	} else {
		var res kadm.DeleteACLsResults
		if res, err = adm.DeleteACLs(ctx, b); err == nil {
			for _, r := range res {
				err = errors.Join(err, r.Err)
			}
		}
	}
	if err != nil {
		e.t.Fatalf("set WRITE on %s to %v: %v", topic, allow, err)
	}
}

// held checks that Send holds ev (a channel to wait on, nothing taken)
// until the router reports a denial, which it returns.
func (e *env) held(r *Router, send func() (<-chan struct{}, error)) error {
	e.t.Helper()
	deadline := time.Now().Add(patience)
	for {
		wait, err := send()
		if err != nil {
			e.t.Fatalf("Send: %v", err)
		}
		if wait == nil {
			e.t.Fatal("Send took the event while the relay may not write it")
		}
		if err := r.Denied(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("no denial reported after %v", patience)
		}
		<-wait
	}
}

func (e *env) denials(resource, op string) float64 {
	return counterValue(e.t, e.m.KafkaDenied.WithLabelValues(resource, op))
}

// A topic the relay may describe but not write to holds its event: Send
// keeps returning a channel, nothing is produced, acked or dead-lettered,
// and the router reports the denial (naming the principal, WRITE and the
// topic) and counts it. Once WRITE is granted the same event goes through
// with no new router, and the denial is lifted.
func TestTopicDeniedHoldsTheEvent(t *testing.T) {
	e := newACLEnv(t, withDefaults(Config{}), "walrelay.dlq")
	a := &testAcker{}
	ev := event("1", "order", "k", "p")
	err := e.held(e.r, func() (<-chan struct{}, error) { return e.r.Send(ev, lsnOf(1), a) })
	for _, want := range []string{relayPrincipal, "WRITE", `"outbox.event.order"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("denial %q does not name %s", err, want)
		}
	}
	if n := e.denials(resourceTopic, "WRITE"); n < 1 {
		t.Errorf("walrelay_kafka_authorization_denied_total{topic,WRITE} = %v, want at least 1", n)
	}
	if a.adds.Load() != 0 || e.fatals.Load() != 0 || e.endOffsets("walrelay.dlq")["walrelay.dlq"] != 0 {
		t.Fatalf("while denied: adds %d, fatals %d, dead letters %v; want none", a.adds.Load(), e.fatals.Load(), e.endOffsets("walrelay.dlq"))
	}

	e.setWrite("outbox.event.order", true)
	e.mustSend(ev, lsnOf(1), a)
	e.flush()
	if a.acks.Load() != 1 || e.publishedTo("outbox.event.order") != 1 {
		t.Fatalf("after the grant: acks %d, published %v; want the event delivered", a.acks.Load(), e.publishedTo("outbox.event.order"))
	}
	if err := e.r.Denied(); err != nil {
		t.Errorf("Denied() = %v after the grant, want nil", err)
	}
	if n := e.deadLettered(deadletter.ReasonTopicRejected); n != 0 {
		t.Errorf("dead-lettered{topic_rejected} = %v, want 0", n)
	}
}

// WRITE revoked on a topic the router already produces to: the record
// Kafka refuses is not dead-lettered and never acked, and the router fails
// with a DeniedError (its caller restarts from the confirmed position).
// The replacement router, sharing the topics.Set, is not ready from the
// start, finds the denial before producing and holds the event; it is
// delivered once WRITE is granted again.
func TestTopicDeniedAfterUse(t *testing.T) {
	set := topics.NewSet()
	e := newACLEnv(t, withDefaults(Config{Topics: set}), "walrelay.dlq", "outbox.event.order")
	a := &testAcker{}
	e.mustSend(event("1", "order", "k", "p"), lsnOf(1), a)
	e.flush()

	e.setWrite("outbox.event.order", false)
	ev := event("2", "order", "k", "p")
	e.mustSend(ev, lsnOf(2), a)
	e.flush()
	var d *DeniedError
	e.mu.Lock()
	fatal := e.fatalErr
	e.mu.Unlock()
	if !errors.As(fatal, &d) || d.Operation != "WRITE" || d.Resource != resourceTopic || d.Name != "outbox.event.order" || d.Principal != relayPrincipal {
		t.Fatalf("fatal error %v (%T), want a DeniedError of WRITE on topic outbox.event.order by %s", fatal, fatal, relayPrincipal)
	}
	if a.adds.Load() != 2 || a.acks.Load() != 1 {
		t.Fatalf("adds/acks = %d/%d, want 2/1: the refused record is never acked", a.adds.Load(), a.acks.Load())
	}
	if n := e.endOffsets("walrelay.dlq")["walrelay.dlq"]; n != 0 || e.deadLettered(deadletter.ReasonTopicRejected) != 0 {
		t.Fatalf("%d dead letters, want none", n)
	}
	if e.r.Denied() == nil {
		t.Fatal("Denied() = nil after the refusal")
	}

	// The caller's replacement router.
	r2, err := New(withDefaults(Config{Topics: set, CreateTopics: true, Principal: relayPrincipal}), e.routerOpts(), zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)), e.m, func(err error) { t.Errorf("fatal: %v", err) })
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := r2.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if r2.Denied() == nil {
		t.Fatal("a new router sharing the set reports no denial before the topic is checked again")
	}
	a2 := &testAcker{}
	_ = e.held(r2, func() (<-chan struct{}, error) { return r2.Send(ev, lsnOf(2), a2) }) // the denial it returns is the one checked above
	if a2.adds.Load() != 0 {
		t.Fatal("the new router produced to the denied topic")
	}
	e.setWrite("outbox.event.order", true)
	deadline := time.Now().Add(patience)
	for {
		wait, err := r2.Send(ev, lsnOf(2), a2)
		if err != nil {
			t.Fatal(err)
		}
		if wait == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the event still held after the grant")
		}
		<-wait
	}
	if err := r2.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if a2.acks.Load() != 1 || r2.Denied() != nil {
		t.Fatalf("after the grant: acks %d, Denied() %v; want 1 and nil", a2.acks.Load(), r2.Denied())
	}
}

// The dead-letter topic the relay may not write to does not keep it from
// starting nor from delivering valid events: an invalid event waits (not
// dropped, not acked) until WRITE is granted, and is dead-lettered then.
func TestDeadLetterTopicDenied(t *testing.T) {
	e := newACLEnv(t, withDefaults(Config{}), "outbox.event.order")
	a := &testAcker{}
	e.mustSend(event("1", "order", "k", "p"), lsnOf(1), a)
	e.flush()
	if a.acks.Load() != 1 || e.r.Denied() != nil {
		t.Fatalf("valid event: acks %d, Denied() %v; want 1 and nil", a.acks.Load(), e.r.Denied())
	}
	bad := event("2", "order", "k", "p")
	bad.AggregateID = nil
	err := e.held(e.r, func() (<-chan struct{}, error) { return e.r.Send(bad, lsnOf(2), a) })
	if !strings.Contains(err.Error(), `"walrelay.dlq"`) {
		t.Errorf("denial %q does not name the dead-letter topic", err)
	}
	if a.adds.Load() != 1 || e.deadLettered(deadletter.ReasonNoAggregateID) != 0 {
		t.Fatalf("while denied: adds %d, dead-lettered %v; want the invalid event held", a.adds.Load(), e.deadLettered(deadletter.ReasonNoAggregateID))
	}
	e.setWrite("walrelay.dlq", true)
	e.mustSend(bad, lsnOf(2), a)
	e.flush()
	if got := e.dlqByID(); got["2"] != string(deadletter.ReasonNoAggregateID) || a.acks.Load() != 2 || e.r.Denied() != nil {
		t.Fatalf("after the grant: dead letters %v, acks %d, Denied() %v; want id 2 as %s, 2 acks, nil", got, a.acks.Load(), e.r.Denied(), deadletter.ReasonNoAggregateID)
	}
}

// A topic the relay may neither describe nor create looks missing to it
// (Kafka hides whether it exists), but it is an ACL, not a missing topic:
// its event is held, not dead-lettered as topic_rejected, and the denial
// names DESCRIBE.
func TestTopicHiddenHoldsTheEvent(t *testing.T) {
	deny := func(op kmsg.ACLOperation) kfake.ACL {
		return kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: "outbox.event.hidden", Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: op}
	}
	e := newACLEnvWith(t, withDefaults(Config{}), []kfake.ACL{deny(kmsg.ACLOperationDescribe), deny(kmsg.ACLOperationCreate)}, "walrelay.dlq", "outbox.event.hidden")
	a := &testAcker{}
	ev := event("1", "hidden", "k", "p")
	err := e.held(e.r, func() (<-chan struct{}, error) { return e.r.Send(ev, lsnOf(1), a) })
	if !strings.Contains(err.Error(), "DESCRIBE") || !strings.Contains(err.Error(), `"outbox.event.hidden"`) {
		t.Errorf("denial %q does not name DESCRIBE on the topic", err)
	}
	if n := e.denials(resourceTopic, "DESCRIBE"); n < 1 {
		t.Errorf("walrelay_kafka_authorization_denied_total{topic,DESCRIBE} = %v, want at least 1", n)
	}
	if a.adds.Load() != 0 || e.deadLettered(deadletter.ReasonTopicRejected) != 0 {
		t.Fatalf("adds %d, dead-lettered %v; want the event held", a.adds.Load(), e.deadLettered(deadletter.ReasonTopicRejected))
	}
}
