// Command inboxconsumer is the consumer walrelay-bench's inbox scenario
// measures: an inbox.Consumer whose handler does one UPDATE (an account's
// counter, the record's key naming the account), as a process of its own,
// so that its CPU time is its own, until SIGTERM.
//
//	inboxconsumer -pg-url URL -brokers HOST:PORT -topic T -group G [-set Field=value ...]
//
// The bench builds it from the working tree and, to compare with another
// build of the inbox package (--inbox-compare-ref), from that git ref's
// tree: it names inbox.Config's tunables by -set, and sets them by name, so
// that it compiles against builds that predate them (a field the build
// lacks is refused).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/inbox"
)

// sets is the repeatable -set flag.
type sets []string

func (s *sets) String() string     { return strings.Join(*s, ",") }
func (s *sets) Set(v string) error { *s = append(*s, v); return nil }

func main() {
	url := flag.String("pg-url", "", "PostgreSQL URL of the inbox and accounts tables (required)")
	brokers := flag.String("brokers", "", "Kafka seed brokers, comma-separated (required)")
	topic := flag.String("topic", "", "topic to consume (required)")
	group := flag.String("group", "", "consumer group (required)")
	var set sets
	flag.Var(&set, "set", "an inbox.Config field, Name=value (int or duration; repeatable)")
	flag.Parse()
	if err := run(*url, *brokers, *topic, *group, set); err != nil {
		fmt.Fprintln(os.Stderr, "inboxconsumer:", err)
		os.Exit(1)
	}
}

func run(url, brokers, topic, group string, set []string) error {
	if url == "" || brokers == "" || topic == "" || group == "" {
		return fmt.Errorf("-pg-url, -brokers, -topic and -group are required")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	db, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer db.Close()
	cfg := inbox.Config{
		Group:        group,
		Topics:       []string{topic},
		KafkaOptions: []kgo.Opt{kgo.SeedBrokers(strings.Split(brokers, ",")...), kgo.FetchMaxWait(100 * time.Millisecond)},
		DB:           db,
	}
	for _, s := range set {
		if err := setField(&cfg, s); err != nil {
			return err
		}
	}
	c, err := inbox.New(cfg, func(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
		_, err := tx.Exec(ctx, "UPDATE bench_accounts SET n = n + 1 WHERE id = $1", string(m.Record.Key))
		return err
	})
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// setField sets the inbox.Config field of "Name=value".
func setField(cfg *inbox.Config, s string) error {
	name, value, ok := strings.Cut(s, "=")
	if !ok {
		return fmt.Errorf("-set %q: want Name=value", s)
	}
	f := reflect.ValueOf(cfg).Elem().FieldByName(name)
	if !f.IsValid() {
		return fmt.Errorf("-set %s: this build's inbox.Config has no field %s", s, name)
	}
	switch {
	case f.Type() == reflect.TypeOf(time.Duration(0)):
		d, err := time.ParseDuration(value)
		if err != nil {
			return fmt.Errorf("-set %s: %w", s, err)
		}
		f.SetInt(int64(d))
	case f.Kind() == reflect.Int:
		n, err := strconv.Atoi(value)
		if err != nil {
			return fmt.Errorf("-set %s: %w", s, err)
		}
		f.SetInt(int64(n))
	default:
		return fmt.Errorf("-set %s: field %s is a %s, not an int or a duration", s, name, f.Type())
	}
	return nil
}
