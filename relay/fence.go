package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// fence.go decides what an exactly-once relay does once Kafka says another
// producer took its transactional id (router.ErrFenced). Nothing it sent
// since its last commit can become visible either way; what differs is who
// took the id:
//
//   - a relay that took the slot after this one lost it without noticing
//     (a frozen process, a cut replication connection): this one restarts,
//     finds the slot busy and waits as a standby. Exiting would make a
//     supervisor's restart do the same, one restart delay later.
//   - anything else while this relay still holds the slot: a relay of
//     another slot, or a tool, configured with the same transactional id.
//     Restarting would take the id back and fence the other, forever: this
//     one stops instead (exit code 3).
//
// A relay takes the id only once it holds the slot (initTransactions), so
// a relay fenced by a rival on its own slot has necessarily lost the slot:
// whether its walsender still holds the slot tells the two cases apart.

// slotHolder reports whether the walsender with the given backend PID is
// the one streaming the relay's slot. Unit tests replace it.
type slotHolder func(ctx context.Context, walsender uint32) (bool, error)

// holdsSlot is the slotHolder that asks pg_replication_slots.
func (r *Relay) holdsSlot(ctx context.Context, walsender uint32) (bool, error) {
	if walsender == 0 {
		return false, errors.New("the replication connection's backend PID is unknown")
	}
	conn, err := slot.Connect(ctx, r.cfg.PGURL)
	if err != nil {
		return false, err
	}
	defer conn.Close(context.Background())
	info, err := slot.ReadInfo(ctx, conn, r.cfg.Slot)
	if err != nil {
		return false, err
	}
	return info.ActivePID != nil && uint32(*info.ActivePID) == walsender, nil
}

// afterFence returns what a session that ended with err does next, err
// being fenced: a fatal error when this relay (replication backend
// walsender) still holds the slot, else err itself, to restart from (as a
// standby while the other relay streams). Call it before the replication
// connection closes. Any other err is returned as is.
func (r *Relay) afterFence(err error, walsender uint32) error {
	if !errors.Is(err, router.ErrFenced) || isFatal(err) {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	txnID := r.cfg.Router.TransactionalID
	holds, qerr := r.slotHolder(ctx, walsender)
	switch {
	case qerr != nil:
		// Restarting is safe whatever the answer: the next session takes
		// the slot before the id, so it waits while another relay streams.
		r.log.Warn("fenced: another producer took the transactional id, and whether this relay still holds the slot is unknown; restarting (it waits as a standby while another relay streams)",
			zap.String("slot", r.cfg.Slot), zap.String("transactional_id", txnID), zap.NamedError("slot_check", qerr), zap.Error(err))
		return err
	case holds:
		return &fatalError{fmt.Errorf("transactional id %q was taken by another producer while this relay holds slot %q: a relay of another slot, or another tool, uses the same transactional id (relay.Config.Router.TransactionalID); give each relay its own (restarting would take it back, and the two would fence each other forever): %w",
			txnID, r.cfg.Slot, err)}
	default:
		r.log.Warn("fenced: another relay took the slot and then the transactional id while this one had lost the slot without noticing; nothing this one sent since its last Kafka commit becomes visible; restarting, it waits as a standby",
			zap.String("slot", r.cfg.Slot), zap.String("transactional_id", txnID), zap.Error(err))
		return err
	}
}
