package source

// slotwait.go: creating the slot while PostgreSQL waits for transactions
// to end.
//
// CREATE_REPLICATION_SLOT blocks inside the server until every transaction
// that held an xid when the creation began has ended, prepared ones
// included, and the client hears nothing (package doctor's creation.go
// says what PostgreSQL waits for). So the command runs under a watch
// (createWatched): every SetupConfig.CreateWarnInterval a second, normal
// connection reads what the creating walsender waits for
// (doctor.ReadCreationBy) and walrelay warns, naming each transaction and
// its fix. The creating connection is named doctor.RelayAppName(slot,
// doctor.RelayCreatingSlot), so that status finds a creation under way
// from anywhere (doctor.ReadCreation).
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
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/slot"
)

// defaultCreateWarnInterval is what SetupConfig.CreateWarnInterval 0
// stands for.
const defaultCreateWarnInterval = 10 * time.Second

// createWaitMessage is the warning logged while creating the slot waits.
const createWaitMessage = "creating the replication slot waits for transactions to end: PostgreSQL creates a logical slot only once every transaction that held an xid when the creation began has ended, prepared transactions included; the relay streams once it exists"

// cancelTimeout bounds the wait for a cancelled creation to end.
const cancelTimeout = 10 * time.Second

// createWaitError is a creation of the slot given up at
// SetupConfig.CreateDeadline while PostgreSQL still waited for
// transactions to end. Retrying may help once they have: it is not a
// *slot.SetupError.
type createWaitError struct {
	Waited time.Duration
	// Creation is what it waited for at the end; nil when that could not
	// be read.
	Creation *doctor.Creation
}

func (e *createWaitError) Error() string {
	s := fmt.Sprintf("waited %s for the transactions that held an xid when the creation began to end, then cancelled it, leaving no slot (PostgreSQL creates a logical slot only once they have all ended, prepared transactions included)",
		doctor.DurationText(e.Waited))
	if c := e.Creation; c != nil && c.Fix() != "" {
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
		interval = defaultCreateWarnInterval
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
	if cfg.PrimaryURL != "" {
		nudgeCtx, stopNudge := context.WithCancel(ctx)
		defer stopNudge()
		go nudgeStandbySnapshot(nudgeCtx, cfg.PrimaryURL, standbySnapshotInterval, log)
	}
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
			var last *doctor.Creation
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
			return &createWaitError{Waited: time.Since(began), Creation: last}
		}
	}
}

// nameCreating names the creating connection for walrelay status, unless
// the connection string chose a name: an operator's is left alone. A
// logical replication connection runs SQL too.
func nameCreating(ctx context.Context, rconn *pgconn.PgConn, slotName string) {
	if rconn.ParameterStatus("application_name") != "walrelay" {
		return
	}
	// Unnamed, status finds only a creation without the snapshot (by its
	// slot): nothing worse.
	_, _ = rconn.Exec(ctx, "SET application_name = "+quoteLiteral(doctor.AppNameAsShown(doctor.RelayAppName(slotName, doctor.RelayCreatingSlot)))).ReadAll()
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
func (w *createWatch) read(ctx context.Context) (*doctor.Creation, error) {
	if w.conn == nil {
		c, err := slot.Connect(ctx, w.cfg.URL)
		if err != nil {
			return nil, err
		}
		w.conn = c
	}
	c, err := doctor.ReadCreationBy(ctx, w.conn, w.cfg.Slot, w.pid)
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
	fields = append(fields, zap.String("waited", doctor.DurationText(waited)), zap.Int32("walsender_pid", w.pid))
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
