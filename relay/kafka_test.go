package relay

// kafka_test.go runs the relay's Kafka side against kfake, the in-process
// broker, with a PostgreSQL nobody listens on: what the relay does before
// and around a stream.

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/test/fakenet"
	"github.com/walrelay/walrelay/test/testkit"
)

// kafkaConfig is a valid relay configuration producing to a fresh kfake
// cluster, with a PostgreSQL URL that refuses connections.
func kafkaConfig(t *testing.T) Config {
	t.Helper()
	c := testkit.Kfake(t)
	cfg := validConfig()
	cfg.PGURL = refusingPGURL(t)
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(c.ListenAddrs()...)}
	cfg.Router.CreateTopics = true
	cfg.BackoffMin, cfg.BackoffMax = 20*time.Millisecond, 50*time.Millisecond
	cfg.StartupTimeout = 500 * time.Millisecond
	return cfg
}

func TestRunGivesUpOnAnUnreachableDatabaseAtTheStartupTimeout(t *testing.T) {
	for _, eos := range []bool{false, true} {
		cfg := kafkaConfig(t)
		cfg.ExactlyOnce = eos
		cfg.HeartbeatInterval, cfg.HeartbeatTopic = time.Second, "walrelay.heartbeat"
		r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = r.Run(ctx)
		cancel()
		if !isFatal(err) || !strings.Contains(err.Error(), "relay.Config.StartupTimeout") {
			t.Fatalf("exactly-once %v: Run returned %v, want a give-up naming relay.Config.StartupTimeout", eos, err)
		}
		if r.Streaming() || r.Ready() == nil {
			t.Fatalf("exactly-once %v: streaming or ready without a stream", eos)
		}
	}
}

func TestRunStopsCleanlyWhenCancelledWhileRetrying(t *testing.T) {
	cfg := kafkaConfig(t)
	cfg.StartupTimeout = -1 // retry forever
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := r.Run(ctx); err != nil {
		t.Fatalf("Run stopped by its context returned %v, want nil", err)
	}
}

func TestNewRouterRefusesWhatIsNotKafka(t *testing.T) {
	// A peer that answers every connection with PostgreSQL-like bytes.
	peer := fakenet.Listen(t, func(c net.Conn) {
		_, _ = c.Write([]byte("E\x00\x00\x00\x10SFATAL\x00\x00\x00\x00\x00\x00\x00\x00"))
		c.Close()
	})
	cfg := kafkaConfig(t)
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(peer)}
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := r.newRouter(ctx); err == nil {
		t.Fatal("newRouter accepted a peer that is not a Kafka broker")
	}
}

func TestReadCheckpointThroughKafka(t *testing.T) {
	cfg := kafkaConfig(t)
	cfg.ExactlyOnce = true
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rt, err := r.newRouter(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	// The order of a session: the transactional id once the slot is held,
	// then the checkpoint.
	if err := r.initTransactions(ctx, rt); err != nil {
		t.Fatal(err)
	}
	resume, err := r.readCheckpoint(ctx, rt.Txn())
	if err != nil || resume.found {
		t.Fatalf("first read: %+v, %v; want no checkpoint", resume, err)
	}
	// The delivery of an exactly-once session: the checkpoint is read
	// once the stream is open and before it is read, and the delivery made
	// after.
	open, _, err := r.prepareDelivery(ctx, rt, newFakeStream(), start, r.cfg.StatusInterval)
	if err != nil {
		t.Fatal(err)
	}
	s := r.newSession(ctx, newFakeStream(), nil, start, r.cfg.StatusInterval)
	d, err := open(slotSystem("1", 1<<40), s)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := d.(*exactlyOnce); !ok {
		t.Fatalf("exactly-once session got a %T", d)
	}
}

func TestPrepareDeliveryAtLeastOnce(t *testing.T) {
	r, err := New(validConfig(), zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	open, _, err := r.prepareDelivery(context.Background(), nil, newFakeStream(), start, r.cfg.StatusInterval)
	if err != nil {
		t.Fatal(err)
	}
	d, err := open(slotSystem("1", 1), r.newSession(context.Background(), newFakeStream(), nil, start, r.cfg.StatusInterval))
	if _, ok := d.(*atLeastOnce); !ok || err != nil {
		t.Fatalf("at-least-once session got a %T (%v)", d, err)
	}
}

func TestPublishSnapshotNeedsTheDatabase(t *testing.T) {
	cfg := kafkaConfig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n, err := PublishSnapshot(ctx, cfg, zap.NewNop(), metrics.NewUnregistered())
	if err == nil || n != 0 {
		t.Fatalf("PublishSnapshot with no database: %d rows, %v; want an error", n, err)
	}
}

func TestWatchSlotEndsWithItsContext(t *testing.T) {
	cfg := kafkaConfig(t)
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.poller().watchSlot(ctx, cancel)
	}()
	cancel(errors.New("test over"))
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("watchSlot did not end with its context")
	}
}

// Kafka denying WRITE on the transactional id is refused at once (exit 2
// naming it) by a relay that never streamed: a configuration to fix. One
// that streamed had the permission, so an operator took it away: it
// waits (a restart of cause kafka_authorization, not fatal) until an ACL
// gives it back.
func TestInitTransactionsDeniedIsFatalOnlyBeforeTheFirstStream(t *testing.T) {
	topicOp := func(op kmsg.ACLOperation) kfake.ACL {
		return kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: "*", Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: op, Allow: true}
	}
	c := testkit.Kfake(t, kfake.EnableACLs(), kfake.Superuser("SCRAM-SHA-256", "admin", "admin-pass"),
		kfake.User("SCRAM-SHA-256", "relay", "relay-pass", topicOp(kmsg.ACLOperationCreate), topicOp(kmsg.ACLOperationWrite), topicOp(kmsg.ACLOperationRead)))
	cfg := validConfig()
	cfg.ExactlyOnce = true
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(c.ListenAddrs()...), kgo.SASL(scram.Auth{User: "relay", Pass: "relay-pass"}.AsSha256Mechanism())}
	cfg.Router.CreateTopics = true
	cfg.Router.Principal = "User:relay"
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, streamed := range []bool{false, true} {
		r.sup.streamed.Store(streamed)
		rt, err := r.newRouter(ctx)
		if err != nil {
			t.Fatal(err)
		}
		err = r.initTransactions(ctx, rt)
		rt.Close()
		var d *router.DeniedError
		if !errors.As(err, &d) || d.Resource != "transactional id" || d.Name != "walrelay-walrelay" || d.Operation != "WRITE" || !strings.Contains(err.Error(), "User:relay") {
			t.Fatalf("streamed before %v: %v, want a DeniedError of WRITE on the transactional id naming User:relay", streamed, err)
		}
		if isFatal(err) == streamed {
			t.Errorf("streamed before %v: fatal %v", streamed, isFatal(err))
		}
		if got := causeOf(err); !streamed && got != CauseKafkaAuthorization {
			t.Errorf("causeOf = %s, want %s", got, CauseKafkaAuthorization)
		}
	}
}
