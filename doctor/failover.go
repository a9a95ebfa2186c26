package doctor

// failover.go: whether a failover of the primary keeps the slot.
//
// Before PostgreSQL 17 a logical slot lives on the primary only: after a
// failover the new primary has none, and walrelay's record (package
// source) makes it refuse to go on there. From 17 a failover slot is copied to
// standbys that run with sync_replication_slots = on, and
// synchronized_standby_slots on the primary holds logical decoding back
// until the standbys named there have the WAL: without it a standby may be
// behind what walrelay already published, and after its promotion Kafka
// holds events of transactions the new primary never had.
//
// The primary cannot see a standby's copy. A standby that has a slot of
// the same name of its own (synced = false: an old primary that rejoined
// as a standby with its data directory keeps its slot) is never
// synchronized: PostgreSQL's slot sync refuses to touch it, and a promotion
// of that standby resumes from its stale position, sending every event
// since again. So protection is claimed only for copies walrelay read on
// the standbys themselves (their URLs given to it), synchronized and
// current; from the primary alone it says what it checked and what not.
//
// Tools keep copies too, on any version: Patroni, for a slot named under
// slots: in its dynamic configuration, copies the slot's state file from
// the primary to each replica and moves the copy forward with
// pg_replication_slot_advance to the position the primary's slot had at
// its last loop. Such a copy (a logical slot of the same name, plugin and
// database, on a standby that does not run slot synchronization) keeps
// the slot through a failover, resuming from the copy's position: the
// events between it and the primary's are sent again. walrelay reads how
// far it lags and says so; it cannot tell a copy a tool moves from one
// nothing moves but by that lag, so it claims no protection for it
// (Protected), only that a failover keeps the slot.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/slot"
)

// Failover is what a failover of the slot's server would do to the slot.
type Failover struct {
	// Name is the slot's name.
	Name string
	// Supported: the server has failover slots (PostgreSQL 17+).
	Supported bool
	// Slot: the slot is a failover slot.
	Slot bool
	// StandbySlots are the physical slots synchronized_standby_slots
	// names; Missing those of them that do not exist or no standby
	// streams from.
	StandbySlots, Missing []string
	// Standbys is the number of physical standbys streaming from the
	// server now; Archivers the WAL streams of clients that replay
	// nothing (pg_receivewal, pg_basebackup's): no failover can go to
	// them.
	Standbys, Archivers int
	// Checked: walrelay was given standbys' URLs and read their copies;
	// Copies are the copies of those that are standbys now (a URL of a
	// server that accepts writes is no standby's and is left out).
	Checked bool
	Copies  []Copy
	// Local is the server's own copy when the server itself is a standby
	// (status run against one); nil on a primary.
	Local *Copy
	// DecodedHere says the slot is the standby's own, decoded on it
	// (PostgreSQL 16+, relay.Config.PrimaryURL): not a copy of the
	// primary's. Set for a standby's slot that is not synced and a
	// walsender streams from (only decoding on the standby does that), or
	// by a relay that decodes there.
	DecodedHere bool
}

// Copy is a standby's copy of the slot, as read on the standby.
type Copy struct {
	// Standby names the server (user@host:port/database, no secrets).
	Standby string
	// Err: the standby could not be read; nothing below is known.
	Err error
	// Version is the standby's server_version_num.
	Version int
	// PrimarySlot is the standby's primary_slot_name, its physical slot
	// on the primary; SyncSlots its sync_replication_slots.
	PrimarySlot string
	SyncSlots   bool
	// Mismatch, when not empty, says how the standby's slot of the name
	// differs from the primary's ("a physical slot", "of plugin
	// test_decoding", "of database other"): no copy of it at all.
	Mismatch string
	// Exists: the standby has a slot of the name; Synced that slot sync
	// made it (synced = true), Temporary that sync has not persisted it
	// yet (it would not survive a promotion); Invalidation why PostgreSQL
	// invalidated it, if it did.
	Exists, Synced, Temporary bool
	Invalidation              string
	ConfirmedLSN              decoder.LSN
	// PrimaryConfirmed is the primary's confirmed position of the slot,
	// read after the copy (0 when unknown: status on the standby).
	PrimaryConfirmed decoder.LSN
}

// Current reports whether the copy is one slot sync keeps up to date: a
// promotion of the standby resumes no earlier than sync left it, and never
// past what the primary confirmed.
func (c Copy) Current() bool {
	return c.Err == nil && c.Exists && c.Synced && !c.Temporary && c.Invalidation == "" && c.SyncSlots &&
		(c.PrimaryConfirmed == 0 || c.ConfirmedLSN <= c.PrimaryConfirmed)
}

// Kept reports whether the copy is a slot of the name that slot
// synchronization did not make, on a standby that does not run it (before
// PostgreSQL 17 there is none): a copy some tool keeps, such as Patroni's
// permanent slots, or a slot an old primary kept when it rejoined, which
// nothing moves. Either way a failover to the standby keeps the slot and
// resumes from the copy's position.
func (c Copy) Kept() bool {
	return c.Err == nil && c.Exists && c.Mismatch == "" && !c.Synced && !c.SyncSlots
}

// beforeFailoverSlots reports whether the standby runs a PostgreSQL
// before 17, which keeps no copy of a logical slot on its own.
func (c Copy) beforeFailoverSlots() bool { return c.Version != 0 && c.Version < slot.FailoverSlots }

// Problem says, with the fix, why the copy does not protect the slot; ""
// when it does, or when it is a valid kept copy (Kept; Note says what a
// failover to it costs).
func (c Copy) Problem(slot string) string {
	text, fix := c.problem(slot)
	if text == "" {
		return ""
	}
	return text + "; " + fix
}

// problem is Problem's what and fix apart.
func (c Copy) problem(slot string) (text, fix string) {
	// Standby is empty for the server status reads (status on a standby).
	who, there := "standby "+c.Standby, "that standby"
	if c.Standby == "" {
		who, there = "this standby", "this standby"
	}
	// A standby may drop a slot of its own, not one slot synchronization
	// made: that one goes with the server stopped.
	drop := fmt.Sprintf("drop it: SELECT pg_drop_replication_slot('%s') on %s, and slot synchronization makes a synchronized copy", slot, there)
	remove := fmt.Sprintf("a standby cannot drop a synchronized slot: stop %s, remove the directory pg_replslot/%s from its data directory, and start it again; slot synchronization makes a new copy", there, slot)
	switch {
	case c.Err != nil:
		return fmt.Sprintf("%s could not be read, so its copy of the slot is not verified: %v", who, c.Err),
			"make it reachable with that URL, or take it off the list of standby URLs (relay.Config.StandbyURLs)"
	case !c.Exists && c.beforeFailoverSlots():
		return fmt.Sprintf("%s has no copy of the slot: PostgreSQL before 17 keeps none on a standby, so a failover to it loses the slot", who),
			fmt.Sprintf("have a tool keep a copy on %s (Patroni does for a slot named under slots: in its dynamic configuration), or move to PostgreSQL 17 and its failover slots", there)
	case !c.Exists && !c.SyncSlots:
		return fmt.Sprintf("%s has no copy of the slot and sync_replication_slots is off there: a failover to it loses the slot", who),
			fmt.Sprintf("set sync_replication_slots = on (with hot_standby_feedback = on, primary_slot_name and dbname= in primary_conninfo) on %s, or have a tool keep a copy there (Patroni's slots:)", there)
	case !c.Exists:
		return fmt.Sprintf("%s has no copy of the slot yet: a failover to it now loses the slot", who),
			fmt.Sprintf("the log of %s says why slot synchronization has not made one (it needs hot_standby_feedback = on, primary_slot_name and dbname= in primary_conninfo)", there)
	case c.Mismatch != "":
		return fmt.Sprintf("%s has a slot %q that is %s, no copy of walrelay's: a failover to it cannot stream from it", who, slot, c.Mismatch),
			fmt.Sprintf("drop it on %s (SELECT pg_drop_replication_slot('%s')), or give walrelay's slot another name", there, slot)
	case !c.Synced && c.SyncSlots:
		return fmt.Sprintf("%s has a slot %q of its own (synced = false, confirmed at %s%s), not a synchronized copy: slot synchronization refuses to update it (the log of %s: \"same name slot already exists on the standby\"), and a failover to it resumes from that stale position, sending every event since again (an old primary that rejoined as a standby keeps its slot so)",
			who, slot, c.ConfirmedLSN, c.distance(), there), drop
	case c.Invalidation != "":
		return fmt.Sprintf("the copy of the slot on %s was invalidated (%s): a failover to it cannot stream from it", who, c.Invalidation),
			fmt.Sprintf("see the log of %s; hot_standby_feedback = on and primary_slot_name keep a copy valid", there)
	case c.Temporary:
		return fmt.Sprintf("the copy of the slot on %s is not persisted yet (temporary = true): a failover to it now loses the slot", who),
			"wait: slot synchronization persists it once the standby has replayed up to the slot's position"
	case c.Kept() && c.PrimaryConfirmed != 0 && c.ConfirmedLSN > c.PrimaryConfirmed:
		// A tool copies positions the primary had; a copy past the
		// primary's is a slot the standby kept from when it was primary
		// itself, and a tool that only moves copies forward leaves it.
		return fmt.Sprintf("%s has a slot %q that slot synchronization did not make, confirmed at %s, %s past the primary's %s (a slot it kept from its own time as primary, which a tool that moves copies forward does not move back): a failover to it skips the events between, which are lost unless the relay had sent them before that switchover",
				who, slot, c.ConfirmedLSN, BytesText(int64(c.ConfirmedLSN-c.PrimaryConfirmed)), c.PrimaryConfirmed),
			fmt.Sprintf("if it stays ahead, drop it on %s (SELECT pg_drop_replication_slot('%s')): a tool that keeps copies (Patroni's slots:) copies the primary's again", there, slot)
	case c.Kept():
		return "", ""
	case !c.SyncSlots:
		return fmt.Sprintf("%s has a synchronized copy of the slot but sync_replication_slots is off there: nothing keeps it current, and a failover to it resumes from where it stopped, sending the events since again", who),
			fmt.Sprintf("set sync_replication_slots = on on %s", there)
	case c.PrimaryConfirmed != 0 && c.ConfirmedLSN > c.PrimaryConfirmed:
		return fmt.Sprintf("the copy of the slot on %s is confirmed at %s, %s past the primary's %s (a copy kept from before its own promotion, now behind the primary it follows: slot synchronization refuses to move it back, its log says \"cannot synchronize local slot\"): a failover to it skips the events between, which are lost",
			who, c.ConfirmedLSN, BytesText(int64(c.ConfirmedLSN-c.PrimaryConfirmed)), c.PrimaryConfirmed), remove
	}
	return "", ""
}

// Note says what a failover to a standby with a valid kept copy (Kept,
// without a Problem) costs: how far the copy lags the primary's slot, the
// events a failover sends again. "" for any other copy.
func (c Copy) Note(slot string) string {
	if !c.Kept() || c.Problem(slot) != "" {
		return ""
	}
	who := "standby " + c.Standby
	if c.Standby == "" {
		who = "this standby"
	}
	// The same words whether the copy lags or not: the relay logs the
	// line again only when its words change, not its figures.
	lag := fmt.Sprintf("confirmed at %s", c.ConfirmedLSN)
	if c.PrimaryConfirmed != 0 {
		lag += fmt.Sprintf(", %s behind the primary's %s", BytesText(int64(c.PrimaryConfirmed-c.ConfirmedLSN)), c.PrimaryConfirmed)
	}
	return fmt.Sprintf("%s keeps a copy of the slot that slot synchronization did not make (a tool's, such as Patroni's permanent slots), %s: a failover to it keeps the slot and resumes from the copy's position, sending the events after it again",
		who, lag)
}

// Causes are the standbys' copies that do not protect the slot, for
// status --explain: they hold nothing, but decide what a failover resumes
// from.
func (f Failover) Causes() []Cause {
	copies := f.Copies
	if f.DecodedHere {
		return nil // no copy: the slot itself (Describe)
	}
	if f.Local != nil {
		copies = []Copy{*f.Local}
	}
	var causes []Cause
	for _, c := range copies {
		if text, fix := c.problem(f.Name); text != "" {
			causes = append(causes, Cause{Kind: "standby_slot", Holds: "nothing here: what a failover to that standby resumes from", Text: text, Fix: fix})
		}
	}
	return causes
}

// distance is how far the copy is behind the primary, when known.
func (c Copy) distance() string {
	if c.PrimaryConfirmed == 0 || c.PrimaryConfirmed <= c.ConfirmedLSN {
		return ""
	}
	return fmt.Sprintf(", %s behind the primary's %s", BytesText(int64(c.PrimaryConfirmed-c.ConfirmedLSN)), c.PrimaryConfirmed)
}

// Protected reports whether a promoted standby has the slot at a position
// no later than the WAL it received and no earlier than slot
// synchronization left it: a failover slot, held back by
// synchronized_standby_slots whose standbys all stream, and a
// synchronized, current copy on every standby, read on the standbys.
func (f Failover) Protected() bool {
	if !f.Slot || len(f.StandbySlots) == 0 || len(f.Missing) > 0 || f.Local != nil || !f.Checked {
		return false
	}
	current := 0
	for _, c := range f.Copies {
		if !c.Current() {
			return false
		}
		current++
	}
	return current > 0 && current >= f.Standbys
}

// failoverSlotsSQL reads, on one server, its version, its
// synchronized_standby_slots, whether it is in recovery, and the physical
// WAL streams it sends: those of standbys, and those of clients that
// replay nothing. pg_receivewal and pg_basebackup report no replay
// position (replay_lsn stays NULL once they have replied); a standby's
// walreceiver always does. pg_stat_replication shows a role without
// pg_read_all_stats (the relay's least-privileged one) the pid and
// application_name of another role's walsender and nothing else: such a
// row counts as a standby, unless its name is one of those programs'
// defaults, and a row without a state as streaming.
const failoverSlotsSQL = `
	SELECT current_setting('server_version_num')::int, coalesce(current_setting('synchronized_standby_slots', true), ''), pg_is_in_recovery(),
	       count(*) FILTER (WHERE NOT archiver), count(*) FILTER (WHERE archiver)
	FROM (SELECT r.application_name IN ('pg_receivewal', 'pg_basebackup') OR (r.write_lsn IS NOT NULL AND r.replay_lsn IS NULL) AS archiver
	        FROM pg_stat_replication r
	       WHERE coalesce(r.state, 'streaming') = 'streaming'
	         AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical')) w`

// standbyTimeout bounds the connection to, and the read of, one standby:
// one that does not answer must not hold the relay's slot watch.
const standbyTimeout = 10 * time.Second

// ReadFailover reads the failover state of a slot whose row is info, on
// conn, and the slot's copies on the standbys of standbyURLs (none: the
// copies are not checked).
func ReadFailover(ctx context.Context, conn *pgx.Conn, info slot.Info, standbyURLs []string) (Failover, error) {
	f := Failover{Name: info.Name}
	var version int
	var standbySlots string
	var inRecovery bool
	if err := conn.QueryRow(ctx, failoverSlotsSQL).Scan(&version, &standbySlots, &inRecovery, &f.Standbys, &f.Archivers); err != nil {
		return f, fmt.Errorf("read the failover settings: %w", err)
	}
	f.Supported = version >= slot.FailoverSlots
	f.Slot = info.Failover != nil && *info.Failover
	if inRecovery {
		c := readCopy(ctx, conn, info)
		f.Local = &c
		f.DecodedHere = info.Active && (info.Synced == nil || !*info.Synced)
		return f, nil
	}
	for _, s := range strings.Split(standbySlots, ",") {
		if s = strings.TrimSpace(s); s != "" {
			f.StandbySlots = append(f.StandbySlots, s)
		}
	}
	if len(f.StandbySlots) > 0 {
		rows, err := conn.Query(ctx, `SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' AND active AND slot_name = ANY($1)`, f.StandbySlots)
		if err != nil {
			return f, fmt.Errorf("read the standbys' slots: %w", err)
		}
		active, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return f, fmt.Errorf("read the standbys' slots: %w", err)
		}
		for _, s := range f.StandbySlots {
			if !slices.Contains(active, s) {
				f.Missing = append(f.Missing, s)
			}
		}
	}
	if len(standbyURLs) == 0 {
		return f, nil
	}
	// Read on every version, a failover slot or not: a tool may keep
	// copies where PostgreSQL keeps none (Copy.Kept).
	f.Checked = true
	for _, u := range standbyURLs {
		if c, standby := readStandby(ctx, u, info); standby {
			f.Copies = append(f.Copies, c)
		}
	}
	// The primary's position is read after the copies: slot sync copies
	// a position the primary had, so a copy past this one is truly ahead.
	var confirmed *string
	if err := conn.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, info.Name).Scan(&confirmed); err != nil {
		return f, fmt.Errorf("read the slot's confirmed position: %w", err)
	}
	if confirmed != nil {
		lsn, err := slot.ParseLSN(*confirmed)
		if err != nil {
			return f, err
		}
		for i := range f.Copies {
			f.Copies[i].PrimaryConfirmed = lsn
		}
	}
	return f, nil
}

// readStandby reads the slot's copy on the server of url; standby is
// false when that server is not in recovery (a primary: the one walrelay
// streams from, when the operator listed every node).
func readStandby(ctx context.Context, url string, info slot.Info) (c Copy, standby bool) {
	ctx, cancel := context.WithTimeout(ctx, standbyTimeout)
	defer cancel()
	c.Standby = slot.Redact(url)
	conn, err := slot.Connect(ctx, url)
	if err != nil {
		c.Err = err
		return c, true
	}
	defer conn.Close(context.Background())
	var inRecovery bool
	if err := conn.QueryRow(ctx, `SELECT pg_is_in_recovery()`).Scan(&inRecovery); err != nil {
		c.Err = slot.RedactError(err, url)
		return c, true
	}
	if !inRecovery {
		return c, false
	}
	c = readCopy(ctx, conn, info)
	c.Standby = slot.Redact(url)
	if c.Err != nil {
		c.Err = slot.RedactError(c.Err, url)
	}
	return c, true
}

// readCopy reads, on a standby, the row of the slot of primary's name and
// the slot sync settings; a slot of that name of another type, plugin or
// database than primary's is named in Mismatch. synced and
// invalidation_reason exist from PostgreSQL 17 on; read through to_jsonb
// they are NULL before.
func readCopy(ctx context.Context, conn *pgx.Conn, primary slot.Info) Copy {
	var c Copy
	var confirmed, slotType, plugin, database string
	err := conn.QueryRow(ctx, `
		SELECT current_setting('server_version_num')::int,
		       coalesce((SELECT setting FROM pg_settings WHERE name = 'primary_slot_name'), ''),
		       coalesce((SELECT setting FROM pg_settings WHERE name = 'sync_replication_slots'), 'off') = 'on',
		       s.slot_name IS NOT NULL, coalesce((to_jsonb(s)->>'synced')::bool, false), coalesce(s.temporary, false),
		       coalesce(to_jsonb(s)->>'invalidation_reason', CASE WHEN s.wal_status = 'lost' THEN 'wal_removed' END, ''),
		       coalesce(s.confirmed_flush_lsn::text, '0/0'), coalesce(s.slot_type, ''), coalesce(s.plugin, ''), coalesce(s.database, '')
		FROM (SELECT 1) one LEFT JOIN pg_replication_slots s ON s.slot_name = $1`, primary.Name).Scan(
		&c.Version, &c.PrimarySlot, &c.SyncSlots, &c.Exists, &c.Synced, &c.Temporary, &c.Invalidation, &confirmed, &slotType, &plugin, &database)
	if err != nil {
		c.Err = fmt.Errorf("read pg_replication_slots: %w", err)
		return c
	}
	if c.ConfirmedLSN, err = slot.ParseLSN(confirmed); err != nil {
		c.Err = err
	}
	if c.Exists {
		c.Mismatch = mismatch(primary, slotType, plugin, database)
	}
	return c
}

// mismatch says how a standby's slot of primary's name differs from it
// ("" when it does not): a slot of the same name that is no copy.
func mismatch(primary slot.Info, slotType, plugin, database string) string {
	switch {
	case primary.SlotType != "" && slotType != primary.SlotType:
		return "a " + slotType + " slot"
	case primary.Plugin != "" && plugin != primary.Plugin:
		return fmt.Sprintf("a slot of plugin %s, not %s", plugin, primary.Plugin)
	case primary.Database != "" && database != primary.Database:
		return fmt.Sprintf("a slot of database %s, not %s", database, primary.Database)
	}
	return ""
}

// Describe says in one sentence what a failover would do to the slot, and
// whether that needs the operator's attention.
func (f Failover) Describe() (text string, warn bool) {
	switch {
	case f.DecodedHere:
		return "the slot is this standby's own, decoded on it: promoting this standby keeps the slot; losing or rebuilding it loses the slot, and a failover of the primary to another server leaves this standby to follow the new primary (repoint its primary_conninfo, and relay.Config.PrimaryURL unless a multi-host URL follows the primary)", false
	case f.Local != nil:
		return f.describeLocal()
	case (!f.Supported || !f.Slot) && f.Checked && (len(f.Copies) > 0 || f.Standbys > 0):
		return f.describeKept()
	case !f.Supported && f.Standbys > 0:
		return fmt.Sprintf("PostgreSQL before 17 keeps logical slots on the primary only: a failover to one of its %d standbys loses the slot, and walrelay then refuses to go on until the gap is accepted, unless a tool keeps a copy of the slot there (Patroni does for a slot named under slots: in its dynamic configuration: give walrelay the standbys' URLs, relay.Config.StandbyURLs, and it reads their copies; PostgreSQL 17's failover slots carry the slot over)%s", f.Standbys, f.archivers()), true
	case !f.Supported:
		return "no standby streams from this server; PostgreSQL before 17 has no failover slots" + f.archivers(), false
	case !f.Slot:
		return "the slot is not a failover slot: a failover loses it (turn on source.SetupConfig.Failover, or ALTER_REPLICATION_SLOT ... (FAILOVER true)), unless a tool keeps a copy of it on the standbys (Patroni's slots:; give walrelay their URLs, relay.Config.StandbyURLs, and it reads their copies)" + f.archivers(), f.Standbys > 0
	case len(f.StandbySlots) == 0:
		return "failover slot, but synchronized_standby_slots is empty: a standby may be behind what walrelay published, and after a failover to it Kafka would hold events of transactions the new primary never had; set synchronized_standby_slots on the primary to the standbys' physical slots (and sync_replication_slots = on, hot_standby_feedback = on on the standbys)", true
	case len(f.Missing) > 0:
		return fmt.Sprintf("failover slot, but no standby streams from %s, named in synchronized_standby_slots: PostgreSQL holds walrelay's stream back until it does", strings.Join(f.Missing, ", ")), true
	}
	held := fmt.Sprintf("failover slot, held back by synchronized_standby_slots = %s until those standbys have the WAL", strings.Join(f.StandbySlots, ", "))
	if !f.Checked {
		return held + "; walrelay checked this from the primary, not the standbys' copies of the slot, which the primary cannot see: a standby with a slot of the same name of its own (an old primary that rejoined as a standby keeps its slot so) is never synchronized, and a failover to it resumes from that stale position, sending every event since again; give walrelay the standbys' URLs (relay.Config.StandbyURLs) to check their copies, or run SELECT slot_name, synced, temporary FROM pg_replication_slots on each standby (synced must be true)", true
	}
	var problems, synced, notes []string
	for _, c := range f.Copies {
		switch {
		case c.Problem(f.Name) != "":
			problems = append(problems, c.Problem(f.Name))
		case c.Kept():
			notes = append(notes, c.Note(f.Name))
		default:
			synced = append(synced, c.Standby)
		}
	}
	if len(problems) > 0 {
		return held + ", but " + strings.Join(problems, "; "), true
	}
	if keeping := len(synced) + len(notes); keeping == 0 || keeping < f.Standbys {
		return fmt.Sprintf("%s, but of the %d standbys streaming walrelay read the copies of %d (relay.Config.StandbyURLs): a failover to another may resume from a stale copy, or lose the slot; give walrelay every standby's URL", held, f.Standbys, keeping), true
	}
	line := held
	if len(synced) > 0 {
		line += fmt.Sprintf(", and the copies on %s are synchronized and current", strings.Join(synced, ", "))
	}
	if len(notes) > 0 {
		line += "; " + strings.Join(notes, "; ")
	}
	return line + ": a promoted standby keeps the slot", false
}

// describeKept is Describe for a slot PostgreSQL copies to no standby
// (before 17, or not a failover slot) whose standbys walrelay read: the
// copies a tool keeps there (Copy.Kept) decide what a failover does.
func (f Failover) describeKept() (string, bool) {
	base := "PostgreSQL before 17 keeps logical slots on the primary only"
	unheld := "nothing before PostgreSQL 17 holds decoding back until the standbys have the WAL"
	if f.Supported {
		base = "the slot is not a failover slot (source.SetupConfig.Failover), which PostgreSQL would copy to standbys with sync_replication_slots"
		unheld = "synchronized_standby_slots holds back only a failover slot's decoding until the standbys have the WAL"
	}
	var problems, notes []string
	for _, c := range f.Copies {
		if p := c.Problem(f.Name); p != "" {
			problems = append(problems, p)
		} else if n := c.Note(f.Name); n != "" {
			notes = append(notes, n)
		}
	}
	if len(problems) > 0 {
		text := base + ": " + strings.Join(problems, "; ")
		if len(notes) > 0 {
			text += "; " + strings.Join(notes, "; ")
		}
		return text + f.archivers(), true
	}
	if len(notes) == 0 {
		return fmt.Sprintf("%s: a failover to one of its %d standbys loses the slot, and walrelay then refuses to go on until the gap is accepted, unless a tool keeps a copy there; every URL walrelay was given for the standbys (relay.Config.StandbyURLs) reached a server that takes writes: give it the standbys' URLs%s",
			base, f.Standbys, f.archivers()), true
	}
	if len(notes) < f.Standbys {
		return fmt.Sprintf("%s, and of the %d standbys streaming walrelay read a copy of the slot on %d (relay.Config.StandbyURLs): a failover to another loses the slot, and walrelay then refuses to go on until the gap is accepted, unless a tool keeps a copy there too; give walrelay every standby's URL%s",
			base, f.Standbys, len(notes), f.archivers()), true
	}
	return fmt.Sprintf("%s, but %s (at-least-once: duplicates in Kafka; exactly-once skips those its checkpoint covers); %s, so after a failover Kafka can hold events of the old primary's last transactions that the new primary does not have%s",
		base, strings.Join(notes, "; "), unheld, f.archivers()), false
}

// describeLocal is Describe for status run on a standby: its own copy.
func (f Failover) describeLocal() (string, bool) {
	if p := f.Local.Problem(f.Name); p != "" {
		return p, true
	}
	if f.Local.Kept() {
		return "this server is a standby, and " + f.Local.Note(f.Name) + " (status run against the primary, with this standby's URL in relay.Config.StandbyURLs, says how far it lags the primary's slot)", false
	}
	if !f.Supported {
		return "this server is a standby; PostgreSQL before 17 keeps no copy of a logical slot on a standby that survives its promotion", true
	}
	return "this server is a standby with a synchronized copy of the slot (synced = true), kept current by sync_replication_slots: its promotion keeps the slot", false
}

// archivers notes WAL streams that are no standby's.
func (f Failover) archivers() string {
	if f.Archivers == 0 {
		return ""
	}
	return fmt.Sprintf(" (%d WAL stream(s) of clients that replay nothing, such as pg_receivewal, are not counted as standbys: no failover can go to them)", f.Archivers)
}
