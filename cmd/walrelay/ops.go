package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/slot"
)

// statusCmd is `walrelay status`: the slot at a glance, for people, cron
// and probes.
type statusCmd struct {
	PGURL       string `name:"pg-url" required:"" help:"Source database URL."`
	Slot        string `default:"walrelay" help:"Logical replication slot."`
	JSON        bool   `name:"json" help:"Print JSON instead of text."`
	MaxLagBytes int64  `default:"1073741824" help:"Exit 1 when the slot's confirmed lag (current LSN − confirmed_flush_lsn) exceeds this; 0 disables."`
}

// slotStatus is what status prints.
type slotStatus struct {
	Slot              string   `json:"slot"`
	Plugin            string   `json:"plugin"`
	Database          string   `json:"database"`
	Active            bool     `json:"active"`
	ActivePID         *int32   `json:"active_pid"`
	RestartLSN        string   `json:"restart_lsn"`
	ConfirmedFlushLSN string   `json:"confirmed_flush_lsn"`
	CurrentLSN        string   `json:"current_lsn"`
	RetainedWALBytes  int64    `json:"retained_wal_bytes"`
	ConfirmedLagBytes int64    `json:"confirmed_lag_bytes"`
	WALStatus         string   `json:"wal_status"`
	SafeWALSize       *int64   `json:"safe_wal_size"`
	Healthy           bool     `json:"healthy"`
	Problems          []string `json:"problems"`
}

func (c *statusCmd) Run(ctx context.Context) error {
	conn, err := slot.Connect(ctx, c.PGURL)
	if err != nil {
		return &exitError{code: 2, err: err}
	}
	defer conn.Close(context.Background())
	info, err := slot.ReadInfo(ctx, conn, c.Slot)
	if err != nil {
		return &exitError{code: 2, err: err}
	}
	st := slotStatus{
		Slot: info.Name, Plugin: info.Plugin, Database: info.Database, Active: info.Active, ActivePID: info.ActivePID,
		RestartLSN: info.RestartLSN.String(), ConfirmedFlushLSN: info.ConfirmedLSN.String(), CurrentLSN: info.CurrentLSN.String(),
		RetainedWALBytes: info.RetainedWALBytes, ConfirmedLagBytes: info.LagBytes, WALStatus: info.WALStatus,
		SafeWALSize: info.SafeWALSize, Problems: []string{},
	}
	if info.WALStatus == "lost" {
		st.Problems = append(st.Problems, "slot is invalidated (wal_status = lost): events written while it lacked WAL are gone from it")
	}
	if c.MaxLagBytes > 0 && info.LagBytes > c.MaxLagBytes {
		st.Problems = append(st.Problems, fmt.Sprintf("confirmed lag %s exceeds --max-lag-bytes %s", bytesText(info.LagBytes), bytesText(c.MaxLagBytes)))
	}
	st.Healthy = len(st.Problems) == 0
	if c.JSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(st); err != nil {
			return err
		}
	} else {
		printStatus(os.Stdout, st)
	}
	if !st.Healthy {
		return &exitError{code: 1, err: errors.New(strings.Join(st.Problems, "; "))}
	}
	return nil
}

func printStatus(w io.Writer, st slotStatus) {
	active := "no"
	if st.Active {
		active = "yes"
		if st.ActivePID != nil {
			active = fmt.Sprintf("yes (pid %d)", *st.ActivePID)
		}
	}
	safe := "unlimited"
	switch {
	case st.WALStatus == "lost":
		safe = "none (the slot is lost)"
	case st.SafeWALSize != nil:
		safe = bytesText(*st.SafeWALSize)
	}
	restart := st.RestartLSN
	if restart == "0/0" {
		restart = "none (its WAL was removed)"
	}
	health := "ok"
	if !st.Healthy {
		health = "UNHEALTHY: " + strings.Join(st.Problems, "; ")
	}
	for _, row := range [][2]string{
		{"slot", st.Slot}, {"plugin", st.Plugin}, {"database", st.Database}, {"active", active},
		{"restart_lsn", restart}, {"confirmed_flush_lsn", st.ConfirmedFlushLSN}, {"current_lsn", st.CurrentLSN},
		{"retained_wal", bytesText(st.RetainedWALBytes)}, {"confirmed_lag", bytesText(st.ConfirmedLagBytes)},
		{"wal_status", st.WALStatus}, {"safe_wal_size", safe}, {"health", health},
	} {
		fmt.Fprintf(w, "%-20s %s\n", row[0], row[1])
	}
}

// bytesText prints a byte count for people, with the exact figure.
func bytesText(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	f, i := float64(n), 0
	for f >= 1024 && i < len(units)-1 {
		f /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s (%d bytes)", f, units[i], n)
}

// setupCmd is `walrelay setup`: print the outbox DDL, check the database,
// create the publication and slot.
type setupCmd struct {
	PGURL       string   `name:"pg-url" required:"" help:"Source database URL."`
	Publication string   `default:"walrelay_outbox" help:"Publication to create."`
	Slot        string   `default:"walrelay" help:"Logical replication slot to create (pgoutput)."`
	Table       []string `default:"public.outbox" help:"Outbox table, schema.table; repeatable."`
	CreateTable bool     `help:"Create missing outbox tables with the printed DDL."`
	ColumnFlags `embed:""`
}

func (c *setupCmd) Run(ctx context.Context, lf *LogFlags) error {
	log, err := lf.logger()
	if err != nil {
		return err
	}
	tabs, err := parseTables(c.Table)
	if err != nil {
		return err
	}
	m, err := c.mapping()
	if err != nil {
		return err
	}
	for _, t := range c.Table {
		fmt.Printf("-- outbox table walrelay expects (write pattern: insert and delete in the business transaction)\n%s\n\n", outboxDDL(t))
	}
	if c.CreateTable {
		conn, err := slot.Connect(ctx, c.PGURL)
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		for _, t := range c.Table {
			created, err := ensureOutboxTable(ctx, conn, t)
			if err != nil {
				return err
			}
			if created {
				fmt.Printf("created table %s\n", qualify(t))
			}
		}
	}
	cols := []string{m.ID, m.AggregateType, m.AggregateID, m.Payload}
	if m.Type != "" {
		cols = append(cols, m.Type)
	}
	for _, h := range m.Headers {
		cols = append(cols, h.Column)
	}
	err = slot.Prepare(ctx, slot.SetupConfig{
		URL: c.PGURL, Slot: c.Slot, Publication: c.Publication, Tables: tabs, Columns: cols,
		CreatePublication: true, CreateSlot: true,
	}, log)
	if err != nil {
		if slot.IsSetupError(err) {
			return &exitError{code: 2, err: err}
		}
		return err
	}
	fmt.Printf("ready: publication %q publishes inserts of %s; slot %q (pgoutput) exists\n", c.Publication, strings.Join(c.Table, ", "), c.Slot)
	return nil
}

// dropCmd is `walrelay drop`: remove the slot (and the publication).
type dropCmd struct {
	PGURL           string `name:"pg-url" required:"" help:"Source database URL."`
	Slot            string `default:"walrelay" help:"Logical replication slot to drop."`
	Publication     string `default:"walrelay_outbox" help:"Publication dropped with --drop-publication."`
	DropPublication bool   `help:"Also drop the publication."`
}

func (c *dropCmd) Run(ctx context.Context, lf *LogFlags) error {
	log, err := lf.logger()
	if err != nil {
		return err
	}
	conn, err := slot.Connect(ctx, c.PGURL)
	if err != nil {
		if slot.IsSetupError(err) {
			return &exitError{code: 2, err: err}
		}
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", c.Slot)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "55006":
		return fmt.Errorf("slot %q is in use (%s): stop the relay streaming from it first", c.Slot, pgErr.Message)
	case errors.As(err, &pgErr) && pgErr.Code == "42704":
		fmt.Printf("slot %q does not exist\n", c.Slot)
	case err != nil:
		return fmt.Errorf("drop slot %q: %w", c.Slot, err)
	default:
		fmt.Printf("dropped slot %q: PostgreSQL no longer keeps WAL for it; events written from now on are not captured until a new slot exists\n", c.Slot)
		log.Info("dropped replication slot", zap.String("slot", c.Slot))
	}
	if c.DropPublication {
		if _, err := conn.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{c.Publication}.Sanitize()); err != nil {
			return fmt.Errorf("drop publication %q: %w", c.Publication, err)
		}
		fmt.Printf("dropped publication %q\n", c.Publication)
	}
	return nil
}
