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

// chainFeedbackWait is how long checkChainFeedback waits for feedback to
// show on the primary before it refuses: more than the default
// wal_receiver_status_interval (10 s), at which a standby sends it.
const chainFeedbackWait = 15 * time.Second

// StandbyDecoding is the first server_version_num that decodes logically
// on a hot standby.
const StandbyDecoding = 160000

// checkStandby refuses a standby and primary pair walrelay cannot decode
// from: each check is one PostgreSQL would otherwise fail on late (a slot
// invalidated by rows_removed, a slot creation that never ends) or never
// (a primary URL of another cluster, whose writes the standby never
// replays). conn is the standby, pconn the primary.
//
// The standby may stream from another standby (cascading: P → S1 → S2,
// walrelay on S2, cfg.PrimaryURL naming P, the top of the chain, which
// has S2's system identifier and is what S2 replays). Its physical slot
// is then on S1, which walrelay does not reach; checkUpstream checks what
// P shows instead.
func checkStandby(ctx context.Context, conn, pconn *pgx.Conn, cfg SetupConfig, log *zap.Logger) error {
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
	return checkUpstream(ctx, conn, pconn, cfg.Slot, physSlot, standby, primary, log)
}

// checkUpstream checks that the standby's physical slot (physSlot, its
// primary_slot_name) holds the WAL and the xmin its logical slot needs.
//
// PostgreSQL does not say which server a standby streams from in a way
// walrelay can compare with cfg.PrimaryURL (pg_stat_wal_receiver's
// sender_host is the name the standby used), so the slot itself tells:
//   - the primary has a physical slot of that name: the standby streams
//     from the primary through it (a standby of a standby naming an
//     existing slot of the primary could not use it: the primary's
//     walsender ends a second connection to an active slot);
//   - the primary has none and the standby streams: its upstream holds
//     the slot, another standby (cascading), and checkChainFeedback looks
//     at what reaches the primary;
//   - the primary has none and the standby does not stream: a standby of
//     the primary whose slot is missing streams nothing (its wal receiver
//     fails on the slot) until the slot is made, and neither could the
//     relay's slot be created, which waits for WAL the standby replays;
//     refused, naming the slot to create (on the primary, or on the
//     standby it streams from when cascading).
func checkUpstream(ctx context.Context, conn, pconn *pgx.Conn, slotName, physSlot, standby, primary string, log *zap.Logger) error {
	receiver, err := steadyReceiver(ctx, conn)
	if err != nil {
		return err
	}
	var found, active bool
	err = pconn.QueryRow(ctx, `SELECT count(*) > 0, coalesce(bool_or(active), false)
		FROM pg_replication_slots WHERE slot_name = $1 AND slot_type = 'physical'`, physSlot).Scan(&found, &active)
	if err != nil {
		return fmt.Errorf("read the primary's replication slots: %w", err)
	}
	switch {
	case found && !active:
		// Not refused: a standby reconnecting (after its restart, or the
		// primary's) streams again shortly, and the slot holds the WAL and
		// xmin meanwhile.
		log.Warn("the standby does not stream from the primary now: its physical slot there is inactive; walrelay receives what the primary writes only once the standby streams again (check the standby's primary_conninfo and its log)",
			zap.String("standby", standby), zap.String("primary", primary), zap.String("physical_slot", physSlot), zap.String("wal_receiver", receiver))
	case found:
	case receiver == "streaming":
		return checkChainFeedback(ctx, conn, pconn, slotName, physSlot, standby, primary, log)
	default:
		return setupErrorf("primary_slot_name %q of the standby at %s names no physical slot on the primary at %s, and the standby does not stream (pg_stat_wal_receiver: %s): without the slot the primary keeps neither the WAL nor the xmin the standby's logical slot needs, and the standby streams nothing; create it on the primary (SELECT pg_create_physical_replication_slot('%s')), or, for a standby of a standby, on the standby it streams from", physSlot, standby, primary, receiver, physSlot)
	}
	return nil
}

// receiverSteady is how long the standby's wal receiver must show
// "streaming" (the same process throughout) for steadyReceiver to believe
// it.
const receiverSteady = 1500 * time.Millisecond

// steadyReceiver is the status of the standby's wal receiver
// (pg_stat_wal_receiver, "absent" without one), "streaming" only when the
// same receiver process shows it across receiverSteady. PostgreSQL marks
// a receiver streaming as it starts and shows it once connected, before
// it asks for its slot, so one failing on a missing slot (retried every
// wal_retrieve_retry_interval, 5 s by default) shows "streaming" for the
// moment each attempt lasts: a single look that fell in one took a
// standby of the primary whose slot is missing for a standby of a
// standby, and the relay's slot creation then waited for WAL that never
// came.
func steadyReceiver(ctx context.Context, conn *pgx.Conn) (string, error) {
	var firstPID int32
	var deadline time.Time
	for {
		var status string
		var pid int32
		err := conn.QueryRow(ctx, "SELECT coalesce(status, 'absent'), coalesce(pid, 0) FROM (SELECT 1) one LEFT JOIN pg_stat_wal_receiver ON true").Scan(&status, &pid)
		if err != nil {
			return "", fmt.Errorf("read the standby's wal receiver (pg_stat_wal_receiver): %w", err)
		}
		switch {
		case status != "streaming":
			return status, nil
		case pid != firstPID: // the first look, or a receiver restarted since
			firstPID, deadline = pid, time.Now().Add(receiverSteady)
		case time.Now().After(deadline):
			return status, nil
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// checkChainFeedback: the standby streams from another standby (S1),
// which holds its physical slot; walrelay reaches neither S1 nor its
// settings. What S2's hot_standby_feedback asks for reaches the primary
// only through S1, and only if S1 runs with hot_standby_feedback = on:
// S1 passes its downstream's xmin and catalog_xmin on, into its own
// physical slot on the primary (or its walsender's xmin without one).
// With S1's feedback off the primary's slot for S1 has no xmin at all, and
// the primary vacuums catalog rows S2's logical slot needs: PostgreSQL
// invalidates it (rows_removed).
//
// What the primary must show: when the relay's slot exists on S2 already
// (a restart), something on the primary holding its catalog_xmin (a
// physical slot's xmin or catalog_xmin, or a walsender's xmin, as old or
// older); before the slot exists, any standby's feedback at all (a
// physical slot or a walsender with an xmin), which another standby of the
// primary with feedback on satisfies too: a check of what is visible, not
// a proof. Either is waited for up to chainFeedbackWait.
func checkChainFeedback(ctx context.Context, conn, pconn *pgx.Conn, slotName, physSlot, standby, primary string, log *zap.Logger) error {
	var catalogXmin *string
	err := conn.QueryRow(ctx, "SELECT (SELECT catalog_xmin::text FROM pg_replication_slots WHERE slot_name = $1)", slotName).Scan(&catalogXmin)
	if err != nil {
		return fmt.Errorf("look up replication slot %q: %w", slotName, err)
	}
	var slotsHolding, sendersHolding int
	deadline := time.Now().Add(chainFeedbackWait)
	for {
		// $1 NULL (no slot yet): any xmin counts.
		err := pconn.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical'
				AND (CASE WHEN $1::text IS NULL THEN xmin IS NOT NULL OR catalog_xmin IS NOT NULL
					ELSE age(xmin) >= age($1::text::xid) OR age(catalog_xmin) >= age($1::text::xid) END)),
			(SELECT count(*) FROM pg_stat_replication WHERE backend_xmin IS NOT NULL
				AND ($1::text IS NULL OR age(backend_xmin) >= age($1::text::xid)))`, catalogXmin).Scan(&slotsHolding, &sendersHolding)
		if err != nil {
			return fmt.Errorf("read the primary's replication slots and standbys: %w", err)
		}
		if slotsHolding > 0 || sendersHolding > 0 || time.Now().After(deadline) {
			break
		}
		// An intermediate standby that just connected sends its first
		// feedback within its wal_receiver_status_interval (10 s by
		// default): a valid chain is not refused for being new.
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	if slotsHolding == 0 && sendersHolding == 0 {
		seen := "no physical slot there had an xmin, nor any standby's walsender"
		if catalogXmin != nil {
			seen = fmt.Sprintf("no physical slot there, nor any standby's walsender, held the slot's catalog_xmin %s", *catalogXmin)
		}
		return setupErrorf("the standby at %s streams from another standby (cascading: its primary_slot_name %q is no slot of the primary at %s), and its hot_standby_feedback does not reach the primary (for %v %s): the primary vacuums catalog rows the slot needs and PostgreSQL invalidates it (rows_removed); set hot_standby_feedback = on on the intermediate standby (ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf()), with a physical slot for it on the primary (its primary_slot_name)", standby, physSlot, primary, chainFeedbackWait, seen)
	}
	fields := []zap.Field{zap.String("standby", standby), zap.String("primary", primary), zap.String("physical_slot", physSlot),
		zap.Int("physical_slots_holding", slotsHolding), zap.Int("walsenders_holding", sendersHolding)}
	if catalogXmin != nil {
		fields = append(fields, zap.Stringp("catalog_xmin", catalogXmin))
	}
	log.Info("the standby streams from another standby (cascading): its physical slot is there; the primary shows hot_standby_feedback arriving", fields...)
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
