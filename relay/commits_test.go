package relay

// commits_test.go: what exactly-once delivery remembers of its Kafka
// commits, and how failed Kafka calls are classed (fakes of
// session_test.go).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/checkpoint"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
)

// unconfirmedCommit is a commit error that names what the commit wrote
// (a *router.CommitUnconfirmed, whose own message needs the router's
// fields).
type unconfirmedCommit struct{ doubt *router.CommitUnconfirmed }

func (u unconfirmedCommit) Error() string { return "EndTxn: connection reset" }
func (u unconfirmedCommit) Unwrap() error { return u.doubt }

// TestCommitMemoryHearsOfEveryCommit: an exactly-once session tells the
// process's commit memory of each Kafka commit: one Kafka confirmed
// becomes the last sure checkpoint; after one whose outcome is unknown,
// the next start reads that commit back before trusting a newer
// checkpoint, and resumes after the last sure one when it did not land
// everywhere, or when there is nothing to read back (the commit failed
// before Kafka was asked).
func TestCommitMemoryHearsOfEveryCommit(t *testing.T) {
	for _, tc := range []struct {
		name     string
		err      error
		readBack bool
	}{
		{"commit cut off", unconfirmedCommit{&router.CommitUnconfirmed{}}, true},
		{"commit failed before it was asked", kerr.InvalidTxnState, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &fakeProducer{}
			h := startSessionWith(t, nil, p, &resumePoint{}, func(r *Relay, s *session) {
				// As prepareDelivery wires a session's delivery.
				eo := s.d.(*exactlyOnce)
				eo.committed, eo.unconfirmed = r.commits.committed, r.commits.unconfirmed
			})
			h.st.send(txnMsgs(2000, "e1")...)
			waitFor(t, "the first Kafka commit", func() bool { return len(p.checkpoints()) == 1 })
			p.mu.Lock()
			p.commitErr = fmt.Errorf("commit: %w", tc.err)
			p.mu.Unlock()
			h.st.send(txnMsgs(3000, "e2")...)
			if err := h.end(t); causeOf(err) != CauseKafka {
				t.Fatalf("a failed commit ended the session with cause %s, want kafka", causeOf(err))
			}
			// The session is over: its goroutine no longer touches the memory.
			mem := h.r.commits
			if !mem.unsure || mem.lastSure.ckpt.LSN != 2008 || (mem.doubt != nil) != tc.readBack {
				t.Fatalf("memory after the failed commit: unsure %v, last sure %s, doubt %v; want unsure, 2008, doubt %v", mem.unsure, mem.lastSure.ckpt.LSN, mem.doubt != nil, tc.readBack)
			}
			newer := resumePoint{found: true, ckpt: checkpoint.Durable{Slot: "walrelay", LSN: 3008}}
			read := 0
			got := mem.distrust(context.Background(), newer, func(context.Context, *router.CommitUnconfirmed) (bool, error) {
				read++
				return false, nil
			})
			if got.ckpt.LSN != 2008 || read != map[bool]int{true: 1, false: 0}[tc.readBack] {
				t.Fatalf("resumed after %s having read the commit back %d times; want 2008, read back %v", got.ckpt.LSN, read, tc.readBack)
			}

			mem.committed(checkpoint.Durable{Slot: "walrelay", LSN: 4008})
			if got := mem.distrust(context.Background(), resumePoint{found: true, ckpt: checkpoint.Durable{LSN: 4008}}, nil); mem.unsure || got.ckpt.LSN != 4008 {
				t.Fatalf("after a confirmed commit: unsure %v, resumed after %s; want the checkpoint found", mem.unsure, got.ckpt.LSN)
			}
		})
	}
}

// TestSnapshotFencedIsFatal: an initial snapshot runs before the slot
// exists, so no slot tells a standby apart: a snapshot whose transactional
// id another producer took stops the relay, naming the setting; any other
// failed Kafka transaction is retried (cause kafka).
func TestSnapshotFencedIsFatal(t *testing.T) {
	cfg := validConfig()
	cfg.ExactlyOnce = true
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		commitErr error
		fatal     bool
	}{
		{fmt.Errorf("EndTxn: %w", router.ErrFenced), true},
		{fmt.Errorf("EndTxn: %w", kerr.CoordinatorNotAvailable), false},
	} {
		p := &snapshotFake{fakeProducer: &fakeProducer{eos: true, commitErr: tc.commitErr}}
		ctx := context.Background()
		s := r.newExactlyOnceSnapshot(ctx, p, p, 5000, pglogrepl.IdentifySystemResult{SystemID: "42"})
		if err := s.Send(ctx, snapshotEvent("r1")); err != nil {
			t.Fatal(err)
		}
		err := s.finish(ctx)
		if !errors.Is(err, tc.commitErr) || isFatal(err) != tc.fatal {
			t.Fatalf("commit failing with %v: finish returned %v (fatal %v), want it, fatal %v", tc.commitErr, err, isFatal(err), tc.fatal)
		}
		if tc.fatal && !strings.Contains(err.Error(), "relay.Config.Router.TransactionalID") {
			t.Errorf("the refusal does not name the setting: %v", err)
		}
		if !tc.fatal && causeOf(err) != CauseKafka {
			t.Errorf("cause %s, want kafka", causeOf(err))
		}
	}
}

// TestKafkaCauseOfAProducerNotMade: a producer that cannot be made or
// started because Kafka's authorizer denies it is counted as a restart of
// cause kafka_authorization (the operator's ACL to grant); any other
// failure as kafka.
func TestKafkaCauseOfAProducerNotMade(t *testing.T) {
	for err, want := range map[error]RestartCause{
		fmt.Errorf("create topic: %w", kerr.TopicAuthorizationFailed):                                                         CauseKafkaAuthorization,
		&router.DeniedError{Operation: "CREATE", Resource: "topic", Name: "walrelay.dlq", Err: kerr.TopicAuthorizationFailed}: CauseKafkaAuthorization,
		fmt.Errorf("reach kafka brokers: %w", errors.New("connection refused")):                                               CauseKafka,
	} {
		if got := kafkaCause(err); got != want {
			t.Errorf("kafkaCause(%v) = %s, want %s", err, got, want)
		}
	}
}
