// Command orders is a small order service on both sides of walrelay: it
// writes orders and their events with the outbox package, walrelay
// publishes the events to Kafka, and a ledger consumer applies each event
// once with the inbox package.
//
//	go run ./examples/orders            # everything in one process, prints the ledger
//	go run ./examples/orders write   -pg-url URL [-orders N]
//	go run ./examples/orders consume -pg-url URL -brokers HOST:PORT [-topic T] [-group G]
//
// Without a subcommand it starts a throwaway PostgreSQL cluster and an
// in-process Kafka-protocol broker (the same local dev cluster as
// `walrelay dev`), an in-process relay, the writer and the consumer, and
// exits once the ledger holds every event (status 0 if it matches the
// orders exactly). write and consume are the two halves as separate
// processes, against any PostgreSQL and Kafka, next to a `walrelay run`.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/examples/orders/shop"
	"github.com/walrelay/walrelay/inbox"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/relay"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	var err error
	cmd := ""
	if len(os.Args) > 1 {
		cmd = os.Args[1]
	}
	switch cmd {
	case "", "demo", "-orders", "--orders", "-traces", "--traces":
		err = demo(ctx, os.Args[min(len(os.Args), 1+btoi(cmd == "demo")):])
	case "write":
		err = write(ctx, os.Args[2:])
	case "consume":
		err = consume(ctx, os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: use demo, write or consume", cmd)
	}
	stop() // not deferred: os.Exit skips deferred calls
	if err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func logger(level zap.AtomicLevel) *zap.Logger {
	cfg := zap.NewDevelopmentConfig()
	cfg.Level = level
	l, _ := cfg.Build()
	return l
}

// setup connects and creates the schema.
func setup(ctx context.Context, url string) (*pgxpool.Pool, error) {
	db, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, err
	}
	if _, err := db.Exec(ctx, shop.Schema()); err != nil {
		db.Close()
		return nil, fmt.Errorf("create the schema: %w", err)
	}
	return db, nil
}

// write places orders and moves each to paid and shipped: three
// transactions, three events per order.
func write(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("write", flag.ExitOnError)
	url := fs.String("pg-url", "", "PostgreSQL URL (required)")
	n := fs.Int("orders", 0, "orders to write (0: until stopped)")
	pause := fs.Duration("pause", 0, "pause between orders")
	_ = fs.Parse(args) // flag.ExitOnError: a bad flag exits
	if *url == "" {
		return errors.New("write: -pg-url is required")
	}
	// A service may start while its database fails over (no server
	// accepts writes for a moment): wait for it, as its writes do.
	var db *pgxpool.Pool
	if err := retrying(ctx, func() (err error) { db, err = setup(ctx, *url); return err }); err != nil || db == nil {
		return err // nil: stopped while waiting
	}
	defer db.Close()
	ct, err := startTracing(ctx, false, "shop")
	if err != nil {
		return err
	}
	defer ct.shutdown()
	svc := shop.NewService(db)
	svc.Tracer = ct.tracer()
	return writeOrders(ctx, svc, *n, *pause)
}

func writeOrders(ctx context.Context, s *shop.Service, n int, pause time.Duration) error {
	for i := 0; n == 0 || i < n; i++ {
		if pause > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(pause):
			}
		}
		var id int64
		err := retrying(ctx, func() (err error) {
			id, err = s.Place(ctx, fmt.Sprintf("customer-%d", i%7), int64(1000+i))
			return err
		})
		// Paid, then shipped. A commit whose reply was lost may have
		// advanced it already (Advance says so once it is shipped), or
		// not placed it at all (no such order: on to the next).
		for version := 1; err == nil && version < 3; {
			err = retrying(ctx, func() (err error) {
				version, err = s.Advance(ctx, id)
				switch {
				case errors.Is(err, shop.ErrFinal):
					version, err = 3, nil
				case errors.Is(err, pgx.ErrNoRows):
					version, err = 3, nil
				}
				return err
			})
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// retrying runs f until it succeeds or ctx ends, as a service does when a
// PostgreSQL restart or failover breaks its connections: the pool connects
// afresh (to the new primary, through a multi-host URL). A transaction
// whose commit reply was lost may have committed: the ledger compares with
// the orders table, so it stays right either way.
func retrying(ctx context.Context, f func() error) error {
	for {
		err := f()
		if err == nil || ctx.Err() != nil {
			return err
		}
		fmt.Fprintln(os.Stderr, "orders: retrying in 200ms:", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(200 * time.Millisecond):
		}
	}
}

type consumerFlags struct {
	url, brokers, topic, group, dlq *string
	maxAttempts                     *int
	sessionTimeout, handlerDelay    *time.Duration
	// The batch knobs (nil: the inbox defaults).
	maxBatchRecords, workers *int
	maxBatchTime             *time.Duration
	tp                       trace.TracerProvider // nil: the global provider's
}

func consume(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("consume", flag.ExitOnError)
	// The batch knobs' defaults are the inbox package's, from the one
	// place it sets them.
	d := inbox.Config{}.WithDefaults()
	f := consumerFlags{
		url:         fs.String("pg-url", "", "PostgreSQL URL (required)"),
		brokers:     fs.String("brokers", "", "Kafka seed brokers, comma-separated (required)"),
		topic:       fs.String("topic", "outbox.event.order", "topic of the order events"),
		group:       fs.String("group", "ledger", "consumer group (and inbox consumer name)"),
		dlq:         fs.String("dead-letter-topic", "ledger.dlq", "dead-letter topic"),
		maxAttempts: fs.Int("max-attempts", 5, "handler failures before a record is dead-lettered"),
		sessionTimeout: fs.Duration("session-timeout", 45*time.Second,
			"how long the group waits for a member that stopped heartbeating (a killed process), or for a member to rejoin a rebalance, before moving its partitions"),
		handlerDelay: fs.Duration("handler-delay", 0, "pause in every handler call, to watch a crash in the middle of a batch"),
		maxBatchRecords: fs.Int("max-batch-records", d.MaxBatchRecords,
			"records of one partition per transaction (1: one each): more spread a commit over more records when the consumer is behind; a handler error rolls its batch back and the records before it are applied again"),
		maxBatchTime: fs.Duration("max-batch-time", d.MaxBatchTime,
			"how long a batch's handlers may run before it commits what they handled: bounds how long an effect waits for the records after it, and a rebalance or a stop for the batch"),
		workers: fs.Int("workers", d.Workers,
			"partitions handled at once, each in a transaction on a connection of its own (keep within the pool's connections); a partition's records stay in order"),
	}
	_ = fs.Parse(args) // flag.ExitOnError: a bad flag exits
	if *f.url == "" || *f.brokers == "" {
		return errors.New("consume: -pg-url and -brokers are required")
	}
	db, err := setup(ctx, *f.url)
	if err != nil {
		return err
	}
	defer db.Close()
	// The brokers may be down when the consumer starts: wait for them.
	for {
		err := createTopics(ctx, strings.Split(*f.brokers, ","), *f.dlq)
		if err == nil {
			break
		}
		fmt.Fprintln(os.Stderr, "orders: retrying in 1s:", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
	ct, err := startTracing(ctx, false, "ledger")
	if err != nil {
		return err
	}
	defer ct.shutdown()
	f.tp = ct.consumerProvider()
	c, err := newConsumer(f, db, logger(zap.NewAtomicLevelAt(zap.InfoLevel)), nil)
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

func newConsumer(f consumerFlags, db *pgxpool.Pool, log *zap.Logger, reg prometheus.Registerer) (*inbox.Consumer, error) {
	handle := shop.ApplyToLedger
	if f.handlerDelay != nil && *f.handlerDelay > 0 {
		handle = func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(*f.handlerDelay):
			}
			return shop.ApplyToLedger(ctx, tx, m)
		}
	}
	opts := []kgo.Opt{kgo.SeedBrokers(strings.Split(*f.brokers, ",")...), kgo.FetchMaxWait(100 * time.Millisecond)}
	if f.sessionTimeout != nil {
		opts = append(opts, kgo.SessionTimeout(*f.sessionTimeout), kgo.RebalanceTimeout(*f.sessionTimeout))
	}
	cfg := inbox.Config{
		Group:           *f.group,
		Topics:          []string{*f.topic},
		KafkaOptions:    opts,
		DB:              db,
		Table:           shop.InboxTable,
		MaxAttempts:     *f.maxAttempts,
		DeadLetterTopic: *f.dlq,
		Logger:          log,
		Registerer:      reg,
		TracerProvider:  f.tp,
	}
	// Not given (the demo's): zero, the inbox defaults.
	if f.maxBatchRecords != nil {
		cfg.MaxBatchRecords = *f.maxBatchRecords
	}
	if f.workers != nil {
		cfg.Workers = *f.workers
	}
	if f.maxBatchTime != nil {
		cfg.MaxBatchTime = *f.maxBatchTime
	}
	return inbox.New(cfg, handle)
}

// createTopics creates topics that do not exist yet.
func createTopics(ctx context.Context, brokers []string, topics ...string) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer cl.Close()
	res, err := kadm.NewClient(cl).CreateTopics(ctx, 3, -1, nil, topics...)
	if err != nil {
		return fmt.Errorf("create topics %v: %w", topics, err)
	}
	for _, r := range res {
		if r.Err != nil && !strings.Contains(r.Err.Error(), "TOPIC_ALREADY_EXISTS") {
			return fmt.Errorf("create topic %s: %w", r.Topic, r.Err)
		}
	}
	return nil
}

// demo runs the whole chain in one process on the local dev cluster.
func demo(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("demo", flag.ExitOnError)
	n := fs.Int("orders", 5, "orders to write (three events each)")
	traces := fs.Bool("traces", false, "trace the chain to an OTLP receiver run in-process, and print each event's trace")
	_ = fs.Parse(args) // flag.ExitOnError: a bad flag exits
	log := logger(zap.NewAtomicLevelAt(zap.WarnLevel))
	ct, err := startTracing(ctx, *traces, "shop", "walrelay", "ledger")
	if err != nil {
		return err
	}
	defer ct.shutdown()

	pg, err := devcluster.StartPostgres(ctx, devcluster.PostgresOptions{})
	if err != nil {
		return err
	}
	defer pg.Close()
	url, err := pg.CreateDatabase(ctx, "shop")
	if err != nil {
		return err
	}
	k, err := devcluster.StartKafka(devcluster.KafkaOptions{})
	if err != nil {
		return err
	}
	defer k.Close()
	db, err := setup(ctx, url)
	if err != nil {
		return err
	}
	defer db.Close()
	fmt.Printf("PostgreSQL %s, Kafka %s\n", url, k.Addr())

	// The daemon's configuration: what `walrelay run` does given only
	// --pg-url and --brokers (the initial snapshot, the heartbeat, topic
	// creation with the broker's partition count, three here).
	cfg := relay.DefaultConfig()
	cfg.PGURL = url
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(k.Addr())}
	if ct.relay != nil {
		cfg.Router.Tracer = ct.relay.Producer()
	}
	r, err := relay.New(cfg, log, metrics.New(prometheus.NewRegistry()))
	if err != nil {
		return err
	}
	rctx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(rctx) }()
	defer func() {
		stopRelay()
		if err := <-relayDone; err != nil {
			log.Error("relay", zap.Error(err))
		}
	}()
	// The writer starts once the relay streams, so every event goes
	// through the stream (the initial snapshot finds the outbox empty).
	if err := devcluster.WaitFor(time.Minute, 20*time.Millisecond, func() (bool, error) { return r.Streaming(), nil }); err != nil {
		return fmt.Errorf("the relay did not start streaming: %w", err)
	}

	if err := createTopics(ctx, []string{k.Addr()}, "outbox.event.order", "ledger.dlq"); err != nil {
		return err
	}
	s := func(v string) *string { return &v }
	attempts := 5
	c, err := newConsumer(consumerFlags{url: s(url), brokers: s(k.Addr()), topic: s("outbox.event.order"), group: s("ledger"), dlq: s("ledger.dlq"), maxAttempts: &attempts, tp: ct.consumerProvider()}, db, log, nil)
	if err != nil {
		return err
	}
	cctx, stopConsumer := context.WithCancel(ctx)
	consumerDone := make(chan error, 1)
	go func() { consumerDone <- c.Run(cctx) }()
	defer func() {
		stopConsumer()
		if err := <-consumerDone; err != nil {
			log.Error("consumer", zap.Error(err))
		}
	}()

	svc := shop.NewService(db)
	svc.Tracer = ct.tracer()
	if err := writeOrders(ctx, svc, *n, 0); err != nil {
		return err
	}
	fmt.Printf("wrote %d orders, %d events; waiting for the ledger\n", *n, 3**n)
	err = devcluster.WaitFor(2*time.Minute, 50*time.Millisecond, func() (bool, error) {
		var rows int
		err := db.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&rows)
		return err == nil && rows >= 3**n, err
	})
	if err != nil {
		return fmt.Errorf("the ledger did not fill: %w", err)
	}
	rows, _ := db.Query(ctx, "SELECT order_id, version, event_type, amount_cents FROM ledger ORDER BY order_id, seq")
	fmt.Println("order  version  event         amount")
	for rows.Next() {
		var id, amount int64
		var v int
		var typ string
		if err := rows.Scan(&id, &v, &typ, &amount); err != nil {
			return err
		}
		fmt.Printf("%5d  %7d  %-12s  %6.2f\n", id, v, typ, float64(amount)/100)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	nrows, problems, err := shop.Check(ctx, db)
	if err != nil {
		return err
	}
	if len(problems) > 0 {
		return fmt.Errorf("the ledger does not match the orders: %s", strings.Join(problems, "; "))
	}
	fmt.Printf("ledger matches the orders: %d events applied once each, in order per order\n", nrows)
	return ct.print(os.Stdout, nrows)
}
