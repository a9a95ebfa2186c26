package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/outbox"
	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/slot"
)

// devCmd is `walrelay dev`: the relay on an embedded default.
type devCmd struct {
	Demo      int           `help:"Insert N sample events in several transactions, wait until all are published and confirmed, print them and exit (non-zero if any is missing)."`
	Timeout   time.Duration `default:"60s" help:"With --demo, how long to wait for every event to be published and confirmed."`
	PGPort    int           `name:"pg-port" help:"Port of the throwaway PostgreSQL; 0 picks a free one."`
	KafkaPort int           `help:"Port of the in-process broker; 0 picks a free one."`

	SourceFlags   `embed:""`
	RecordFlags   `embed:""`
	TuningFlags   `embed:""`
	HealthFlags   `embed:""`
	DeliveryFlags `embed:""`
}

func (c *devCmd) Run(ctx context.Context, lf *LogFlags) error {
	if lf.LogFormat == "json" && !isFlagSet("log-format") {
		lf.LogFormat = "console" // a person is watching
	}
	log, err := lf.logger()
	if err != nil {
		return err
	}
	defer log.Sync()
	out := os.Stdout

	pg, err := devcluster.StartPostgres(ctx, devcluster.PostgresOptions{Port: c.PGPort})
	if err != nil {
		return err
	}
	defer pg.Close()
	url, err := pg.CreateDatabase(ctx, "walrelay")
	if err != nil {
		return err
	}
	if err := createOutboxTables(ctx, url, c.Table); err != nil {
		return err
	}
	kafka, err := devcluster.StartKafka(devcluster.KafkaOptions{Port: c.KafkaPort})
	if err != nil {
		return err
	}
	defer kafka.Close()

	cfg, err := c.config(url, kafka.Addr(), log)
	if err != nil {
		return usageError(err)
	}
	pr := &printer{w: out, ids: make(map[string]bool)}
	cfg.Router.OnPublished = pr.print
	r, err := relay.New(cfg, log, metrics.NewUnregistered())
	if err != nil {
		return usageError(err)
	}

	fmt.Fprintf(out, "PostgreSQL: %s\n  psql %q\nKafka broker: %s\nOutbox table(s): %s\n\n",
		url, url, kafka.Addr(), strings.Join(c.Table, ", "))
	if c.Demo <= 0 {
		fmt.Fprintf(out, "Insert rows to see them published, e.g.\n  psql %q -c \"INSERT INTO %s (aggregate_type, aggregate_id, type, payload) VALUES ('order', 'order-1', 'OrderCreated', '{\\\"total\\\": 42}')\"\nCtrl-C stops.\n\n", url, c.Table[0])
		return r.Run(ctx)
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	demoErr := c.demo(runCtx, url, r, pr, log, done)
	cancel()
	runErr := <-done
	if demoErr != nil {
		return demoErr
	}
	if runErr != nil {
		return runErr
	}
	fmt.Fprintf(out, "\ndemo: %d of %d events published and confirmed\n", pr.count(), c.Demo)
	return nil
}

// config is the relay configuration of dev, against the throwaway
// PostgreSQL at url and the in-process broker at broker: the daemon's
// (relay.DefaultConfig with what the flags change), with nothing of its
// own.
func (c *devCmd) config(url, broker string, log *zap.Logger) (relay.Config, error) {
	return relayConfig(url, []string{broker}, log, c.SourceFlags, c.RecordFlags, c.TuningFlags, c.HealthFlags, c.DeliveryFlags)
}

// demo inserts c.Demo events the way an application would (insert and
// delete in the business transaction), waits for every one to be
// published and for the slot to confirm past them.
func (c *devCmd) demo(ctx context.Context, url string, r *relay.Relay, pr *printer, log *zap.Logger, relayDone <-chan error) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if err := devcluster.WaitFor(c.Timeout, 20*time.Millisecond, func() (bool, error) {
		select {
		case err := <-relayDone:
			return false, fmt.Errorf("relay stopped: %v", err)
		default:
		}
		return r.Streaming(), nil
	}); err != nil {
		return fmt.Errorf("relay did not start streaming: %w", err)
	}
	table := pgx.Identifier(strings.SplitN(qualify(c.Table[0]), ".", 2)).Sanitize()
	for i := 0; i < c.Demo; {
		n := min(1+i%4, c.Demo-i) // transactions of 1 to 4 events
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			for j := range n {
				k := i + j
				agg := []string{"order", "customer"}[k%2]
				var id string
				err := tx.QueryRow(ctx, "INSERT INTO "+table+" (aggregate_type, aggregate_id, type, payload) VALUES ($1, $2, $3, $4) RETURNING id::text",
					agg, fmt.Sprintf("%s-%d", agg, k%3), demoType(agg), fmt.Sprintf(`{"seq": %d}`, k)).Scan(&id)
				if err != nil {
					return err
				}
				// The insert is in the WAL already: the row can go at once.
				if _, err := tx.Exec(ctx, "DELETE FROM "+table+" WHERE id = $1", id); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("insert demo events: %w", err)
		}
		i += n
	}
	var target decoder.LSN
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&target); err != nil {
		return err
	}
	var confirmed decoder.LSN
	err = devcluster.WaitFor(c.Timeout, 50*time.Millisecond, func() (bool, error) {
		info, err := slot.ReadInfo(ctx, conn, c.Slot)
		if err != nil {
			return false, err
		}
		confirmed = info.ConfirmedLSN
		return pr.count() >= c.Demo && confirmed >= target, nil
	})
	if err != nil {
		return fmt.Errorf("demo: %d of %d events published, slot confirmed %s of %s: %w", pr.count(), c.Demo, confirmed, target, err)
	}
	log.Info("demo complete", zap.Int("events", pr.count()), zap.Stringer("confirmed_flush_lsn", confirmed))
	return nil
}

func demoType(agg string) string {
	if agg == "order" {
		return "OrderCreated"
	}
	return "CustomerUpdated"
}

// printer prints every record Kafka acknowledged. It runs on the
// producer's promise goroutine.
type printer struct {
	mu  sync.Mutex
	w   io.Writer
	ids map[string]bool
}

func (p *printer) print(r *kgo.Record) {
	var b strings.Builder
	fmt.Fprintf(&b, "topic=%s partition=%d offset=%d key=%s headers={", r.Topic, r.Partition, r.Offset, printable(r.Key))
	var id string
	for i, h := range r.Headers {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s=%s", h.Key, printable(h.Value))
		if h.Key == "id" {
			id = string(h.Value)
		}
	}
	fmt.Fprintf(&b, "} value=%s\n", printableValue(r.Value))
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ids[id] = true
	_, _ = io.WriteString(p.w, b.String())
}

func (p *printer) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.ids)
}

// printable shows text as is and binary as hex.
func printable(b []byte) string {
	switch {
	case b == nil:
		return "null"
	case utf8.Valid(b):
		return strconv.Quote(string(b))
	default:
		return "0x" + hex.EncodeToString(b)
	}
}

// printableValue shows a one-line UTF-8 value (JSON, usually) as is.
func printableValue(b []byte) string {
	if b != nil && utf8.Valid(b) && !bytes.ContainsFunc(b, unicode.IsControl) {
		return string(b)
	}
	return printable(b)
}

// outboxDDL is the outbox table walrelay expects by default; the outbox
// package holds its one definition.
func outboxDDL(table string) string {
	return outbox.Table{Name: qualify(table)}.DDL()
}

func qualify(table string) string {
	if strings.Contains(table, ".") {
		return table
	}
	return "public." + table
}

func createOutboxTables(ctx context.Context, url string, tables []string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	for _, t := range tables {
		if _, err := ensureOutboxTable(ctx, conn, t); err != nil {
			return err
		}
	}
	return nil
}

// ensureOutboxTable creates table (and its schema) with the default DDL
// unless it exists; it reports whether it created it.
func ensureOutboxTable(ctx context.Context, conn *pgx.Conn, table string) (bool, error) {
	schema, name, _ := strings.Cut(qualify(table), ".")
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{schema, name}.Sanitize()).Scan(&exists); err != nil {
		return false, err
	}
	if exists {
		return false, nil
	}
	if _, err := conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return false, fmt.Errorf("create schema %s: %w", schema, err)
	}
	if _, err := conn.Exec(ctx, outboxDDL(table)); err != nil {
		return false, fmt.Errorf("create outbox table %s: %w", table, err)
	}
	return true, nil
}

// isFlagSet reports whether the user chose a flag (or its environment
// variable) rather than taking its default.
func isFlagSet(name string) bool {
	env := "WALRELAY_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
	if _, ok := os.LookupEnv(env); ok {
		return true
	}
	for _, a := range os.Args[1:] {
		if a == "--"+name || strings.HasPrefix(a, "--"+name+"=") {
			return true
		}
	}
	return false
}
