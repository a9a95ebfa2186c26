package bench

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
)

// setup is one measurement's infrastructure: a fresh database with an
// outbox and a publication, its slots, a broker and the relay. Every
// scenario builds it the same way, so that the numbers of one scenario
// compare with another's.
type setup struct {
	b      *bencher
	url    string
	conn   *pgx.Conn
	broker *broker
	relay  *relay
	// slotConn, when set, is a connection to the server holding the slots
	// (a hot standby of url's), whose slots close drops too.
	slotConn *pgx.Conn
}

// newSetup creates a fresh database and a pgoutput slot per name, and
// connects to it. close undoes it all.
func (b *bencher) newSetup(ctx context.Context, slots ...string) (*setup, error) {
	url, err := b.database(ctx)
	if err != nil {
		return nil, err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	s := &setup{b: b, url: url, conn: conn}
	for _, name := range slots {
		if err := createSlot(ctx, conn, name); err != nil {
			s.close()
			return nil, err
		}
	}
	return s, nil
}

// close stops the relay and the broker, drops the slots and disconnects.
func (s *setup) close() {
	if s.relay != nil {
		s.relay.stop()
	}
	if s.broker != nil {
		s.broker.stop()
	}
	if s.slotConn != nil {
		s.b.dropSlots(s.slotConn)
		s.slotConn.Close(context.Background())
	}
	s.b.dropSlots(s.conn)
	s.conn.Close(context.Background())
}

// dropSlots drops the slots of conn's database. Slot names are the
// cluster's: the next measurement creates "relay" again. A walsender
// outlives its client by a moment, and an active slot cannot be dropped,
// so wait for it to go.
func (b *bencher) dropSlots(conn *pgx.Conn) {
	drop := "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database()"
	for deadline := time.Now().Add(30 * time.Second); ; {
		_, err := conn.Exec(context.Background(), drop)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55006" || time.Now().After(deadline) {
			if err != nil {
				b.logf("drop slots: %v", err)
			}
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// oneBroker is the broker of a scenario that runs on one: the in-process
// kfake in mode (discard or store), one Apache Kafka node (apache), or the
// external brokers if named.
func (b *bencher) oneBroker(mode string) *broker {
	if len(b.cfg.KafkaBrokers) > 0 {
		return &broker{name: "external", addrs: b.cfg.KafkaBrokers}
	}
	return &broker{name: mode}
}

// sharedBroker starts the one broker of a scenario whose runs share it
// (kfake storing records, or Apache Kafka with --broker apache) and
// readies its transactions; the caller stops it.
func (b *bencher) sharedBroker() (*broker, error) {
	mode := "store"
	if has(b.cfg.Brokers, "apache") {
		mode = "apache"
	}
	k := b.oneBroker(mode)
	if err := k.start(); err != nil {
		return nil, err
	}
	if err := b.warmTransactions(k); err != nil {
		k.stop()
		return nil, err
	}
	return k, nil
}

// startBroker starts k (a no-op for external brokers); close stops it.
func (s *setup) startBroker(k *broker) error {
	if err := k.start(); err != nil {
		return err
	}
	s.broker = k
	return s.b.warmTransactions(k)
}

// warmTransactions readies the broker's transaction coordinator and the
// relay's checkpoint topic before anything is timed, through the relay's
// own router: a Router with a transactional id creates the checkpoint
// topic, takes its id and reads a checkpoint (a probe transaction). A fresh
// Apache Kafka creates __transaction_state (50 partitions) on the first
// transactional id it sees and answers COORDINATOR_LOAD_IN_PROGRESS
// meanwhile: that cost 2 s of a 2.6 s exactly-once drain of 100,000 events
// (the relay's own drain took 0.6 s). The first transaction on a topic
// just created waits for the broker to learn of it (the probe's produce
// took 107 ms, its markers over 250 ms): an exactly-once start then reads
// the stream ahead for 0.26-0.44 s, 4-20 MiB, where a restart on a cluster
// in service does not. A cluster in service has paid both long before; the
// first start on a new cluster is measured apart (--cold-checkpoints). A
// broker that discards records has no checkpoint to read: only its
// coordinator is readied.
func (b *bencher) warmTransactions(k *broker) error {
	addrs := k.addrs
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if b.cfg.ColdCheckpoints || k.name == "discard" {
		cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.TransactionalID("walrelay-bench-warmup"))
		if err != nil {
			return err
		}
		defer cl.Close()
		if _, _, err := cl.ProducerID(ctx); err != nil {
			return fmt.Errorf("warm up the broker's transaction coordinator: %w", err)
		}
		return nil
	}
	rcfg := router.DefaultConfig()
	rcfg.TransactionalID = "walrelay-bench-warmup"
	rt, err := router.New(rcfg,
		[]kgo.Opt{kgo.SeedBrokers(addrs...)}, zap.NewNop(), metrics.NewUnregistered(), func(error) {})
	if err != nil {
		return err
	}
	defer rt.Close()
	if err := rt.Start(ctx); err != nil {
		return fmt.Errorf("warm up the checkpoint topic: %w", err)
	}
	if err := rt.Txn().Init(ctx); err != nil {
		return fmt.Errorf("warm up the broker's transaction coordinator: %w", err)
	}
	if _, _, err := rt.Txn().ReadCheckpoint(ctx, []byte("walrelay-bench-warmup")); err != nil {
		return fmt.Errorf("warm up the checkpoint topic: %w", err)
	}
	return nil
}

// startRelay starts walrelay run on the slot named "relay" against the
// setup's broker and waits until a walsender streams the slot; it returns
// that walsender's pid. close stops the relay.
func (s *setup) startRelay(ctx context.Context, delivery string, extra ...string) (int, error) {
	rl, err := s.b.startRelay(s.url, "relay", s.broker.addrs, delivery, extra...)
	if err != nil {
		return 0, err
	}
	s.relay = rl
	pid, err := walsenderPID(ctx, s.conn, "relay", 60*time.Second)
	if err != nil {
		return 0, fmt.Errorf("%w\n%s", err, rl.out)
	}
	return pid, nil
}

// waitRelayConfirmed waits until the relay's slot is confirmed at end, or
// the relay exits.
func (s *setup) waitRelayConfirmed(ctx context.Context, end decoder.LSN) error {
	return waitConfirmed(ctx, s.conn, "relay", end, 30*time.Minute, func() error {
		if s.relay.cmd.ProcessState != nil {
			return errors.New("relay exited: " + s.relay.out.String())
		}
		return nil
	})
}
