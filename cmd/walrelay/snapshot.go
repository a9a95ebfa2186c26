package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/snapshot"
)

// snapshotCmd is `walrelay snapshot`: publish a table's current rows once,
// as the relay would publish them, e.g. for a table added to the
// publication after it already held rows.
type snapshotCmd struct {
	PGURL   string   `name:"pg-url" required:"" help:"Source database URL."`
	Brokers []string `required:"" help:"Kafka bootstrap brokers, host:port, comma-separated."`
	Table   []string `required:"" help:"Outbox table whose rows to publish, schema.table; repeat the flag (or separate with commas) for several."`
	Where   string   `placeholder:"SQL" help:"SQL condition the rows must meet (e.g. 'sent_at IS NULL'); empty for every row."`
	Order   string   `placeholder:"SQL" help:"SQL ORDER BY list (e.g. 'created_at, id'); empty for the table's primary key."`

	KafkaFlags  `embed:""`
	PGAuthFlags `embed:""`
	RecordFlags `embed:""`
}

// Validate refuses an empty --pg-url, with which pgx would dial a local
// Unix socket as the OS user.
func (c *snapshotCmd) Validate() error {
	if strings.TrimSpace(c.PGURL) == "" {
		return errors.New("--pg-url is empty: give the source database URL (postgres://user@host:5432/db?sslmode=verify-full) or set WALRELAY_PG_URL")
	}
	return nil
}

func (c *snapshotCmd) Run(ctx context.Context, lf *LogFlags) error {
	log, err := lf.logger()
	if err != nil {
		return err
	}
	defer log.Sync()
	if err := c.PGAuthFlags.install(ctx, log); err != nil {
		return err
	}
	warnPGTLS(log, c.PGURL)
	// Up to PublishSnapshot only the configuration is checked: its errors
	// are malformed flags.
	cfg, err := relayConfig(c.PGURL, c.Brokers, log, c.RecordFlags)
	if err != nil {
		return usageError(err)
	}
	if cfg.Tables, err = parseTables(c.Table); err != nil {
		return usageError(err)
	}
	kopts, err := c.KafkaFlags.options(ctx, log, nil)
	if err != nil {
		return usageError(err)
	}
	cfg.KafkaOptions = append(cfg.KafkaOptions, kopts...)
	cfg.Router.Principal = c.KafkaFlags.principal()
	cfg.SnapshotWhere, cfg.SnapshotOrder = c.Where, c.Order
	n, err := relay.PublishSnapshot(ctx, cfg, log, metrics.NewUnregistered())
	if err != nil {
		if errors.Is(err, snapshot.ErrQuery) || slot.IsSetupError(err) {
			return &exitError{code: exitFailed, err: err}
		}
		return &exitError{code: exitFailed, err: fmt.Errorf("snapshot of %s failed after %d rows were sent (run it again: consumers dedupe by the id header): %w", strings.Join(c.Table, ", "), n, err)}
	}
	fmt.Printf("published %d rows of %s; a row may also arrive through the stream (consumers dedupe by the id header)\n", n, strings.Join(c.Table, ", "))
	return nil
}
