package relay

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
)

// fakeProgress is a router as the Kafka watch reads it.
type fakeProgress struct {
	answered  uint64
	inflight  int64
	preparing int64
}

func (f *fakeProgress) Answered() uint64 { return f.answered }
func (f *fakeProgress) Inflight() int64  { return f.inflight }
func (f *fakeProgress) Preparing() int64 { return f.preparing }

func newKafkaWatch() (*kafkaWatch, *holds.Board) {
	b := holds.New(zap.NewNop(), metrics.NewUnregistered())
	return &kafkaWatch{cond: b.Condition(holds.Kafka)}, b
}

func TestKafkaWatchHoldsWhileNothingIsAnswered(t *testing.T) {
	w, b := newKafkaWatch()
	rt := &fakeProgress{inflight: 5000}
	t0 := time.Now()
	w.look(rt, t0)
	w.look(rt, t0.Add(kafkaSilentAfter-time.Millisecond))
	if err := b.Err(); err != nil {
		t.Fatalf("held before kafkaSilentAfter without an answer: %v", err)
	}
	w.look(rt, t0.Add(kafkaSilentAfter))
	hs := b.Holds()
	if len(hs) != 1 || hs[0].Reason != "NotAcknowledging" || !strings.Contains(hs[0].Message, "5000 events in flight") {
		t.Fatalf("holds %+v: want kafka NotAcknowledging naming the events in flight", hs)
	}
	// One answer ends it.
	rt.answered++
	w.look(rt, t0.Add(kafkaSilentAfter+time.Second))
	if err := b.Err(); err != nil {
		t.Fatalf("still held after Kafka answered: %v", err)
	}
	// A slow but answering broker never holds.
	for i := 1; i <= 30; i++ {
		rt.answered++
		w.look(rt, t0.Add(time.Duration(i)*time.Second))
	}
	if err := b.Err(); err != nil {
		t.Fatalf("held while Kafka answered every second: %v", err)
	}
}

// TestKafkaWatchHoldsWhileATopicIsPrepared: the first event for a topic
// waits on the topic's preparation with no record in flight; a broker
// that does not answer it holds delivery as one that does not acknowledge.
func TestKafkaWatchHoldsWhileATopicIsPrepared(t *testing.T) {
	w, b := newKafkaWatch()
	rt := &fakeProgress{preparing: 1}
	t0 := time.Now()
	w.look(rt, t0)
	w.look(rt, t0.Add(kafkaSilentAfter))
	hs := b.Holds()
	if len(hs) != 1 || hs[0].Reason != "NotAcknowledging" || !strings.Contains(hs[0].Message, "topic's metadata") {
		t.Fatalf("holds %+v: want kafka NotAcknowledging naming the topic's preparation", hs)
	}
	rt.answered++
	w.look(rt, t0.Add(kafkaSilentAfter+time.Second))
	if err := b.Err(); err != nil {
		t.Fatalf("still held after Kafka answered: %v", err)
	}
}

func TestKafkaWatchFailureHeldUntilAnswerOrIdle(t *testing.T) {
	w, b := newKafkaWatch()
	w.failed(fmt.Errorf("%w: dial tcp 127.0.0.1:9: connection refused", errKafkaUnreachable))
	if hs := b.Holds(); len(hs) != 1 || hs[0].Reason != "Unreachable" {
		t.Fatalf("holds %+v: want kafka Unreachable", hs)
	}
	w.failed(fmt.Errorf("SASL authentication: %w", kerr.SaslAuthenticationFailed))
	if hs := b.Holds(); len(hs) != 1 || hs[0].Reason != "AuthenticationFailed" {
		t.Fatalf("holds %+v: want kafka AuthenticationFailed", hs)
	}
	w.failed(&router.DeniedError{Operation: "WRITE", Resource: "topic", Name: "t", Err: kerr.TopicAuthorizationFailed})
	if hs := b.Holds(); len(hs) != 1 || hs[0].Reason != "AuthenticationFailed" {
		t.Fatalf("holds %+v: a denial is the authorizer's, not the kafka condition's", hs)
	}
	// The next session starts: a moment with nothing in flight does not
	// end the hold (the events are about to be sent again) ...
	rt := &fakeProgress{}
	t0 := time.Now()
	w.look(rt, t0)
	rt.inflight = 10
	w.look(rt, t0.Add(time.Second))
	if b.Err() == nil {
		t.Fatal("a restart's first look, with nothing in flight yet, ended the hold")
	}
	// ... nothing waiting on Kafka for kafkaSilentAfter does.
	rt.inflight = 0
	w.look(rt, t0.Add(2*time.Second))
	w.look(rt, t0.Add(2*time.Second+kafkaSilentAfter))
	if err := b.Err(); err != nil {
		t.Fatalf("still held with nothing waiting on Kafka for %s: %v", kafkaSilentAfter, err)
	}
}

func TestPGHoldReasons(t *testing.T) {
	connect := &pgconn.ConnectError{}
	for _, c := range []struct {
		cause RestartCause
		err   error
		want  string
	}{
		{CauseConnection, fmt.Errorf("replication connection: %w", connect), "Unreachable"},
		{CauseSetup, fmt.Errorf("setup: %w", connect), "Unreachable"},
		{CauseSilent, errServerSilent, "NotAnswering"},
		{CausePostgres, &pgconn.PgError{Code: "57P01"}, "Error"},
		{CauseConnection, errors.New("replication stream: unexpected EOF"), "ConnectionLost"},
		{CauseSetup, errors.New("slot creation waits"), "SetupFailed"},
		{CauseKafka, errors.New("produce"), ""},
		{CauseSlotBusy, errSlotBusy, ""},
		{CauseDecode, errors.New("malformed"), ""},
	} {
		if got := pgHoldReason(c.cause, c.err); got != c.want {
			t.Errorf("pgHoldReason(%s, %v) = %q, want %q", c.cause, c.err, got, c.want)
		}
	}
}
