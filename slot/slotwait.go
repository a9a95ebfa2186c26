package slot

// slotwait.go: what creating a slot waits for.
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
// So the command runs under a watch (createWatched): every
// SetupConfig.CreateWarnInterval a second, normal connection reads what
// the creating walsender waits for (pg_stat_activity, pg_locks,
// pg_prepared_xacts) and walrelay warns, naming each transaction and its
// fix. The creating connection is named RelayAppName(slot,
// RelayCreatingSlot), so that walrelay status finds a creation under way
// from anywhere (ReadCreation), even while the slot itself does not exist
// yet (the initial snapshot creates a temporary slot first).
//
// A deadline (SetupConfig.CreateDeadline) or the end of the caller's
// context cancels the command on the server with a cancel request:
// closing the connection alone would leave the walsender waiting, holding
// the slot's name, until the transactions end. A cancelled creation leaves
// no slot: PostgreSQL drops a slot whose creation failed.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// DefaultCreateWarnInterval is what SetupConfig.CreateWarnInterval 0
// stands for.
const DefaultCreateWarnInterval = 10 * time.Second

// createWaitMessage is the warning logged while creating the slot waits.
const createWaitMessage = "creating the replication slot waits for transactions to end: PostgreSQL creates a logical slot only once every transaction that held an xid when the creation began has ended, prepared transactions included; the relay streams once it exists"

// cancelTimeout bounds the wait for a cancelled creation to end.
const cancelTimeout = 10 * time.Second

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

// CreateWaitError is a creation of the slot given up at
// SetupConfig.CreateDeadline while PostgreSQL still waited for
// transactions to end. Retrying may help once they have: it is not a
// *SetupError.
type CreateWaitError struct {
	Waited time.Duration
	// Creation is what it waited for at the end; nil when that could not
	// be read.
	Creation *Creation
}

func (e *CreateWaitError) Error() string {
	s := fmt.Sprintf("waited %s for the transactions that held an xid when the creation began to end, then cancelled it, leaving no slot (PostgreSQL creates a logical slot only once they have all ended, prepared transactions included)",
		DurationText(e.Waited))
	if c := e.Creation; c != nil && len(c.blockers()) > 0 {
		s += "; it waited for " + c.WaitingFor() + "; fix: " + c.Fix()
	}
	return s
}

// createWatched runs create, the CREATE_REPLICATION_SLOT of slot creating
// on rconn, under the watch this file's comment describes.
func createWatched(ctx context.Context, cfg SetupConfig, rconn *pgconn.PgConn, creating string, log *zap.Logger, create func(context.Context) error) error {
	nameCreating(ctx, rconn, cfg.Slot)
	interval := cfg.CreateWarnInterval
	if interval <= 0 {
		interval = DefaultCreateWarnInterval
	}
	began := time.Now()
	stop := ctx
	if !cfg.CreateDeadline.IsZero() {
		// At least one interval, so that a last attempt started at the
		// deadline still creates a slot nothing holds.
		deadline := cfg.CreateDeadline
		if earliest := began.Add(interval); deadline.Before(earliest) {
			deadline = earliest
		}
		var cancel context.CancelFunc
		stop, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}
	// The command runs on a context of its own: pgconn answers the end of
	// one by closing the connection, and the walsender would wait on.
	runCtx, abandon := context.WithCancel(context.WithoutCancel(ctx))
	defer abandon()
	done := make(chan error, 1)
	go func() { done <- create(runCtx) }()
	w := &createWatch{cfg: cfg, pid: int32(rconn.PID()), creating: creating, log: log}
	defer w.close()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			return err
		case <-tick.C:
			w.warn(ctx, time.Since(began))
		case <-stop.Done():
			var last *Creation
			if ctx.Err() == nil {
				readCtx, cancel := context.WithTimeout(ctx, cancelTimeout)
				last, _ = w.read(readCtx)
				cancel()
			}
			err := cancelCreate(rconn, done, abandon, log)
			var pgErr *pgconn.PgError
			switch {
			case err == nil: // it ended before the cancel arrived
				return nil
			case errors.As(err, &pgErr) && pgErr.Code != "57014": // not the cancel's query_canceled
				return err
			case ctx.Err() != nil:
				return ctx.Err()
			}
			return &CreateWaitError{Waited: time.Since(began), Creation: last}
		}
	}
}

// nameCreating names the creating connection for walrelay status, unless
// the connection string chose a name: an operator's is left alone. A
// logical replication connection runs SQL too.
func nameCreating(ctx context.Context, rconn *pgconn.PgConn, slot string) {
	if rconn.ParameterStatus("application_name") != "walrelay" {
		return
	}
	// Unnamed, status finds only a creation without the snapshot (by its
	// slot): nothing worse.
	_, _ = rconn.Exec(ctx, "SET application_name = "+quoteLiteral(AppNameAsShown(RelayAppName(slot, RelayCreatingSlot)))).ReadAll()
}

// cancelCreate cancels the command create runs on the server and returns
// its result; the connection is abandoned (closed) if the server does
// not answer within cancelTimeout.
func cancelCreate(rconn *pgconn.PgConn, done <-chan error, abandon context.CancelFunc, log *zap.Logger) error {
	ctx, cancel := context.WithTimeout(context.Background(), cancelTimeout)
	defer cancel()
	cerr := rconn.CancelRequest(ctx)
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	abandon()
	log.Warn("PostgreSQL did not cancel creating the replication slot: its walsender may wait on, holding the slot's name, until the transactions it waits for end",
		zap.Uint32("walsender_pid", rconn.PID()), zap.NamedError("cancel_error", cerr))
	return <-done
}

// createWatch is what createWatched keeps between warnings.
type createWatch struct {
	cfg      SetupConfig
	pid      int32
	creating string
	log      *zap.Logger
	conn     *pgx.Conn
	reported bool // OnCreateWait was called
}

// read reads the creation and what it waits for; nil when the command is
// no longer running.
func (w *createWatch) read(ctx context.Context) (*Creation, error) {
	if w.conn == nil {
		c, err := Connect(ctx, w.cfg.URL)
		if err != nil {
			return nil, err
		}
		w.conn = c
	}
	c, err := readCreation(ctx, w.conn, "a.pid = $1", w.pid)
	if err == nil && c != nil {
		c.Slot = w.cfg.Slot
		err = c.readBlockers(ctx, w.conn)
	}
	if err != nil {
		w.conn.Close(context.Background())
		w.conn = nil
		return nil, err
	}
	return c, nil
}

// warn logs what the creation waits for, after waited.
func (w *createWatch) warn(ctx context.Context, waited time.Duration) {
	if w.cfg.OnCreateWait != nil {
		w.cfg.OnCreateWait(waited)
		w.reported = true
	}
	readCtx, cancel := context.WithTimeout(ctx, cancelTimeout)
	c, err := w.read(readCtx)
	cancel()
	fields := []zap.Field{zap.String("slot", w.cfg.Slot)}
	if w.creating != w.cfg.Slot {
		fields = append(fields, zap.String("temporary_slot", w.creating))
	}
	fields = append(fields, zap.String("waited", DurationText(waited)), zap.Int32("walsender_pid", w.pid))
	switch {
	case err != nil:
		if ctx.Err() == nil {
			w.log.Warn(createWaitMessage+"; what it waits for cannot be read", append(fields, zap.Error(err))...)
		}
	case c != nil:
		fields = append(fields, zap.String("waiting_for", c.WaitingFor()))
		if fix := c.Fix(); fix != "" {
			fields = append(fields, zap.String("fix", fix))
		}
		w.log.Warn(createWaitMessage, fields...)
	}
}

func (w *createWatch) close() {
	if w.conn != nil {
		w.conn.Close(context.Background())
	}
	if w.reported {
		w.cfg.OnCreateWait(0)
	}
}
