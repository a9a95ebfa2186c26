package source

// standby.go: decoding on a hot standby (PostgreSQL 16+). The slot, the
// replication connection and the reads of the catalog stay on the standby
// (source.SetupConfig.URL); whatever writes goes to its primary
// (source.SetupConfig.PrimaryURL): the publication, walrelay's record and
// pg_log_standby_snapshot(), which a slot being created on a standby waits
// for (slotwait.go). A standby cannot write WAL, and the standby replays
// what the primary wrote, so every write still reaches the slot's decoding.

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/slot"
)

// standbySnapshotInterval is how often creating a slot on a standby asks
// the primary to log its running transactions.
const standbySnapshotInterval = time.Second

// StandbyDecoding is the first server_version_num that decodes logically
// on a hot standby.
const StandbyDecoding = 160000

// checkStandby refuses a standby and primary pair walrelay cannot decode
// from: each check is one PostgreSQL would otherwise fail on late (a slot
// invalidated by rows_removed, a slot creation that never ends) or never
// (a primary URL of another cluster, whose writes the standby never
// replays). conn is the standby, pconn the primary.
func checkStandby(ctx context.Context, conn, pconn *pgx.Conn, cfg SetupConfig) error {
	standby, primary := slot.Redact(cfg.URL), slot.Redact(cfg.PrimaryURL)
	var feedback, physSlot, system string
	err := conn.QueryRow(ctx, `SELECT current_setting('hot_standby_feedback'), current_setting('primary_slot_name'),
		(SELECT system_identifier::text FROM pg_control_system())`).Scan(&feedback, &physSlot, &system)
	if err != nil {
		return fmt.Errorf("read the standby's settings: %w", err)
	}
	var pRecovery bool
	var pWalLevel, pSystem string
	err = pconn.QueryRow(ctx, `SELECT pg_is_in_recovery(), current_setting('wal_level'),
		(SELECT system_identifier::text FROM pg_control_system())`).Scan(&pRecovery, &pWalLevel, &pSystem)
	if err != nil {
		return fmt.Errorf("read the primary's settings: %w", err)
	}
	switch {
	case pSystem != system:
		return setupErrorf("source.SetupConfig.PrimaryURL (%s) is PostgreSQL system %s and the standby at %s is system %s: they are not primary and standby of one cluster, and the standby never replays what walrelay writes on it; name the standby's own primary in source.SetupConfig.PrimaryURL", primary, pSystem, standby, system)
	case pRecovery:
		return setupErrorf("source.SetupConfig.PrimaryURL (%s) is a hot standby too (pg_is_in_recovery() is true): walrelay writes its heartbeat, publication and record there; name the primary that accepts writes (for a standby of a standby, the primary at the top of the chain)", primary)
	case pWalLevel != "logical":
		return setupErrorf("wal_level is %q on the primary at %s: a standby decodes only WAL the primary wrote with wal_level = logical; set wal_level = logical on the primary (ALTER SYSTEM SET wal_level = logical) and restart it", pWalLevel, primary)
	case feedback != "on":
		return setupErrorf("hot_standby_feedback is %s on the standby at %s: without it the primary vacuums catalog rows the slot still needs and PostgreSQL invalidates the slot (rows_removed); set hot_standby_feedback = on on the standby (ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf())", feedback, standby)
	case physSlot == "":
		return setupErrorf("primary_slot_name is empty on the standby at %s: without a physical slot the primary keeps neither the WAL nor, between connections, the catalog rows (hot_standby_feedback's xmin) the standby's logical slot needs; create one on the primary (SELECT pg_create_physical_replication_slot('walrelay_standby')) and set primary_slot_name = 'walrelay_standby' on the standby (then SELECT pg_reload_conf())", standby)
	}
	return nil
}

// nudgeStandbySnapshot asks the primary to log its running transactions
// (pg_log_standby_snapshot, PostgreSQL 16+) at once and then every
// interval until ctx ends: a slot being created on a standby waits to
// replay such a record, which a quiet primary otherwise writes only at its
// next checkpoint or every 15 s of bgwriter activity, and the creation may
// need more than one (one to start from, one after the transactions then
// running ended). Failures are logged and retried: the creation's own
// watch says what it waits for.
func nudgeStandbySnapshot(ctx context.Context, url string, interval time.Duration, log *zap.Logger) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	t := time.NewTicker(interval)
	defer t.Stop()
	warned := false
	for {
		if conn == nil {
			conn, _ = slot.Connect(ctx, url)
		}
		if conn != nil {
			if _, err := conn.Exec(ctx, "SELECT pg_log_standby_snapshot()"); err != nil && ctx.Err() == nil {
				if !warned {
					log.Warn("cannot ask the primary to log its running transactions (pg_log_standby_snapshot()); creating the slot on the standby waits for the primary's next checkpoint", zap.Error(err))
					warned = true
				}
				conn.Close(context.Background())
				conn = nil
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
