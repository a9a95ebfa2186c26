package doctor

// creation.go: what creating a slot waits for, as PostgreSQL shows it.
//
// PostgreSQL creates a logical slot only at a consistent point: once every
// transaction that held an xid when the creation began has ended (and, in
// up to two more rounds, those holding one when the round before ended),
// prepared transactions included. Until then CREATE_REPLICATION_SLOT blocks
// inside the server, its walsender waiting on the lock of each such xid,
// and the client hears nothing. A batch job's long transaction, or a
// prepared transaction whose XA manager crashed, holds a first start for
// as long as it lives.
//
// This reads such a creation and the transactions it waits for
// (pg_stat_activity, pg_locks, pg_prepared_xacts) and words each with its
// fix: for the warnings of the relay that creates the slot (package
// source's creation watch reads its own walsender, ReadCreationBy), and
// for status from anywhere (ReadCreation), which finds the creating
// connection by the name the relay gives it (RelayAppName(slot,
// RelayCreatingSlot)) even while the slot itself does not exist yet (the
// initial snapshot creates a temporary slot first).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// maxBlockers bounds how many open transactions are read to find those a
// creation waits for.
const maxBlockers = 50

// Creation is a slot's creation under way, as PostgreSQL shows it, and
// what it waits for.
type Creation struct {
	// Slot is the slot being created; Creating the slot the command
	// creates: Slot itself, or the initial snapshot's temporary slot.
	Slot, Creating string
	// PID is the creating walsender's, ClientAddr its client.
	PID        int32
	ClientAddr string
	// Waited is how long the command has run.
	Waited time.Duration
	// WaitXid is the xid whose end the walsender waits for at this moment;
	// 0 between two rounds.
	WaitXid int64
	// Xacts and Prepared are the transactions it waits for: the one of
	// WaitXid and those already open when the creation began, oldest
	// first. More counts open ones left out of Xacts.
	Xacts    []Xact
	Prepared []PreparedXact
	More     int
}

// ReadCreation reads, on conn, a creation of slot under way: by the name
// of walrelay's creating connection, or by the slot (one created without
// the initial snapshot shows in pg_replication_slots while it is being
// created). Nil when there is none.
func ReadCreation(ctx context.Context, conn *pgx.Conn, slot string) (*Creation, error) {
	c, err := readCreation(ctx, conn, "(a.application_name = $1 OR s.slot_name = $2)",
		AppNameAsShown(RelayAppName(slot, RelayCreatingSlot)), slot)
	if err != nil || c == nil {
		return nil, err
	}
	c.Slot = slot
	return c, c.readBlockers(ctx, conn)
}

// ReadCreationBy reads, on conn, the creation of slot that the walsender
// of pid runs, and what it waits for; nil when the command no longer runs.
func ReadCreationBy(ctx context.Context, conn *pgx.Conn, slot string, pid int32) (*Creation, error) {
	c, err := readCreation(ctx, conn, "a.pid = $1", pid)
	if err != nil || c == nil {
		return nil, err
	}
	c.Slot = slot
	return c, c.readBlockers(ctx, conn)
}

// readCreation reads the CREATE_REPLICATION_SLOT under way of the
// walsender where selects; nil when none runs.
func readCreation(ctx context.Context, conn *pgx.Conn, where string, args ...any) (*Creation, error) {
	var c Creation
	var waited float64
	err := conn.QueryRow(ctx, `
		SELECT a.pid, coalesce(host(a.client_addr), 'local'), coalesce(s.slot_name, ''),
		       coalesce(extract(epoch FROM now() - a.query_start), 0)::float8,
		       coalesce((SELECT l.transactionid::text::bigint FROM pg_locks l
		                  WHERE l.pid = a.pid AND l.locktype = 'transactionid' AND NOT l.granted LIMIT 1), 0)
		FROM pg_stat_activity a LEFT JOIN pg_replication_slots s ON s.active_pid = a.pid
		WHERE a.backend_type = 'walsender' AND a.state = 'active' AND a.query LIKE 'CREATE\_REPLICATION\_SLOT%'
		  AND `+where+`
		ORDER BY a.query_start LIMIT 1`, args...).Scan(&c.PID, &c.ClientAddr, &c.Creating, &waited, &c.WaitXid)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the slot's creation (pg_stat_activity, pg_locks): %w", err)
	}
	c.Waited = time.Duration(waited * float64(time.Second))
	return &c, nil
}

// readBlockers reads the transactions the creation waits for: the one it
// waits on now, and those open since before it began. (A transaction that
// began later is waited for only in a later round, when it is the one the
// walsender waits on.)
func (c *Creation) readBlockers(ctx context.Context, conn *pgx.Conn) error {
	xacts, err := queryXacts(ctx, conn, c.PID, maxBlockers)
	if err != nil {
		return err
	}
	prepared, err := queryPrepared(ctx, conn)
	if err != nil {
		return err
	}
	waitAge := int64(-1)
	for _, x := range xacts {
		if x.Xid == c.WaitXid {
			waitAge = x.XidAge
		}
	}
	for _, p := range prepared {
		if p.Xid == c.WaitXid {
			waitAge = p.XidAge
		}
	}
	for _, x := range xacts {
		// Another role's transaction hides its start: it counts when it
		// is not younger than the one waited on.
		if x.Xid == c.WaitXid || x.Visible && x.Age >= c.Waited || !x.Visible && x.XidAge >= waitAge {
			if len(c.Xacts) < maxXacts {
				c.Xacts = append(c.Xacts, x)
			} else {
				c.More++
			}
		}
	}
	for _, p := range prepared {
		if p.Xid == c.WaitXid || p.Age >= c.Waited {
			c.Prepared = append(c.Prepared, p)
		}
	}
	return nil
}

// blocker is one transaction a creation waits for: what it is and the
// fix.
type blocker struct {
	kind, text, fix string
	label           string // "pid 123", "'gid'": who the fix is for
	now             bool   // the walsender waits on it at this moment
}

func (c Creation) blockers() []blocker {
	var bs []blocker
	for _, x := range c.Xacts {
		b := blocker{kind: "open_transaction", now: x.Xid == c.WaitXid, label: fmt.Sprintf("pid %d", x.PID),
			fix: fmt.Sprintf("end it: COMMIT or ROLLBACK in its session, or SELECT pg_terminate_backend(%d)", x.PID)}
		if x.Visible {
			b.text = fmt.Sprintf("open transaction: %s, open %s, %s, xid %d: %q", x.who(), DurationText(x.Age), x.State, x.Xid, firstLine(x.Query))
		} else {
			b.text = fmt.Sprintf("open transaction of pid %d in database %q (user %q; xid %d, %d transactions ago; its age, state and query show only to its role or pg_read_all_stats)",
				x.PID, x.Database, x.User, x.Xid, x.XidAge)
		}
		bs = append(bs, b)
	}
	for _, p := range c.Prepared {
		bs = append(bs, blocker{kind: "prepared_transaction", now: p.Xid == c.WaitXid, label: quoteLiteral(p.GID),
			text: fmt.Sprintf("prepared transaction %s (xid %d) in database %q, prepared %s ago by %q", quoteLiteral(p.GID), p.Xid, p.Database, DurationText(p.Age), p.Owner),
			fix: fmt.Sprintf("finish it as its transaction manager meant, in database %q: COMMIT PREPARED %s or ROLLBACK PREPARED %s (nothing else ends it, not even a restart; one whose manager is gone for good is usually rolled back)",
				p.Database, quoteLiteral(p.GID), quoteLiteral(p.GID))})
	}
	return bs
}

// WaitingFor names, on one line, the transactions the creation waits for.
func (c Creation) WaitingFor() string {
	bs := c.blockers()
	if len(bs) == 0 {
		return "no transaction it waits for is open at this moment: it should end shortly"
	}
	var parts []string
	for _, b := range bs {
		t := b.text
		if b.now {
			t += " (waited on now)"
		}
		parts = append(parts, t)
	}
	if c.More > 0 {
		parts = append(parts, fmt.Sprintf("and %d more open transactions", c.More))
	}
	return strings.Join(parts, "; ")
}

// Fix is the fix of each transaction WaitingFor names, on one line.
func (c Creation) Fix() string {
	var parts []string
	for _, b := range c.blockers() {
		parts = append(parts, b.label+": "+b.fix)
	}
	return strings.Join(parts, "; ")
}

// holdsCreation is what a transaction the creation waits for holds.
const holdsCreation = "the slot's creation: the relay streams only once it exists"

// Causes explain the creation for status --explain: the creation, then
// each transaction it waits for.
func (c Creation) Causes() []Cause {
	through := ""
	meanwhile := "it is created without the initial snapshot, so what is committed before it exists is not published"
	if c.Creating != "" && c.Creating != c.Slot {
		through = fmt.Sprintf("; first the initial snapshot's temporary slot %q", c.Creating)
		meanwhile = "what is committed meanwhile is in its initial snapshot"
	}
	now := ""
	if c.WaitXid != 0 {
		now = fmt.Sprintf("; it waits on xid %d now", c.WaitXid)
	}
	bs := c.blockers()
	if len(bs) == 0 {
		now += "; no transaction it waits for is open at this moment: it should end shortly"
	}
	causes := []Cause{{Kind: "slot_creation", Holds: "the relay's first stream: nothing streams from the slot until its creation ends",
		Text: fmt.Sprintf("walrelay is creating replication slot %q (walsender pid %d, from %s%s) and has waited %s: PostgreSQL creates a logical slot only once every transaction that held an xid when the creation began has ended, prepared transactions included%s",
			c.Slot, c.PID, c.ClientAddr, through, DurationText(c.Waited), now),
		Fix: "end the transactions named next, or wait for them: the relay streams by itself once they have ended (" + meanwhile + "); relay.Config.StartupTimeout ends the wait, leaving no slot behind"}}
	for _, b := range bs {
		text := b.text + ": the slot's creation waits until it ends"
		if b.kind == "prepared_transaction" {
			text = b.text + ": the slot's creation waits until it is committed or rolled back, across restarts"
		}
		if b.now {
			text += " (it waits on it now)"
		}
		causes = append(causes, Cause{Kind: b.kind, Holds: holdsCreation, Text: text, Fix: b.fix})
	}
	if c.More > 0 {
		causes = append(causes, Cause{Kind: "open_transaction", Holds: holdsCreation,
			Text: fmt.Sprintf("%d more open transactions with an xid, open since before the creation began", c.More),
			Fix:  "end them (pg_stat_activity, backend_xid IS NOT NULL, oldest xact_start first)"})
	}
	return causes
}
