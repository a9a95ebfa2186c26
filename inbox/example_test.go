package inbox_test

import (
	"context"
	"fmt"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/inbox"
)

// A consumer whose handler's database effects happen once per message.
func ExampleNew() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	db, err := pgxpool.New(ctx, "postgres://app@localhost/shipping")
	if err != nil {
		panic(err)
	}
	if _, err := db.Exec(ctx, inbox.DDL("inbox")); err != nil {
		panic(err)
	}
	c, err := inbox.New(inbox.Config{
		Group:        "shipping",
		Topics:       []string{"outbox.event.order"},
		KafkaOptions: []kgo.Opt{kgo.SeedBrokers("localhost:9092")},
		DB:           db,
		Registerer:   prometheus.DefaultRegisterer,
	}, func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		_, err := tx.Exec(ctx, "INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)", string(m.Record.Key), m.ID)
		return err
	})
	if err != nil {
		panic(err)
	}
	// Returns after SIGTERM, with the offsets of everything handled committed.
	if err := c.Run(ctx); err != nil {
		panic(err)
	}
}

// An effect outside the database: the other system deduplicates by a key
// that every copy and retry of the message shares.
func ExampleIdempotencyKey() {
	a := inbox.IdempotencyKey("shipping", "0193a1c2-7d1e-7a30-8f00-0d2c4e6f8a10", "label")
	b := inbox.IdempotencyKey("shipping", "0193a1c2-7d1e-7a30-8f00-0d2c4e6f8a10", "label")
	c := inbox.IdempotencyKey("shipping", "0193a1c2-7d1e-7a30-8f00-0d2c4e6f8a10", "email")
	fmt.Println(a, a == b, a == c)
	// Output: f3f32b0a426b32f36cc5ef3aece7f2ad true false
}

func ExampleDDL() {
	fmt.Println(inbox.DDL("inbox"))
	// Output:
	// CREATE TABLE IF NOT EXISTS "inbox" (
	//     consumer     text        NOT NULL,
	//     message_id   text        NOT NULL,
	//     outcome      text        NOT NULL DEFAULT 'processed',
	//     processed_at timestamptz NOT NULL DEFAULT now(),
	//     PRIMARY KEY (consumer, message_id)
	// );
	// CREATE INDEX IF NOT EXISTS "inbox_processed_at" ON "inbox" (consumer, processed_at);
	// CREATE TABLE IF NOT EXISTS "inbox_attempts" (
	//     consumer   text        NOT NULL,
	//     message_id text        NOT NULL,
	//     attempts   int         NOT NULL,
	//     last_error text        NOT NULL,
	//     updated_at timestamptz NOT NULL DEFAULT now(),
	//     PRIMARY KEY (consumer, message_id)
	// );
	// CREATE TABLE IF NOT EXISTS "inbox_offsets" (
	//     consumer_group text        NOT NULL,
	//     topic          text        NOT NULL,
	//     partition      int         NOT NULL,
	//     next_offset    bigint      NOT NULL,
	//     updated_at     timestamptz NOT NULL DEFAULT now(),
	//     PRIMARY KEY (consumer_group, topic, partition)
	// );
}
