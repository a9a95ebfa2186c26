package relay

// streamedrecord.go: writing into walrelay's record, once, that a relay
// started a stream from the slot. A slot that is gone at a later start is
// refused either way (the events after the record's position never
// reached Kafka), but the refusal of a slot no relay ever streamed from
// says so, and names what drops a slot nobody streams from (Patroni, an
// operator) rather than a failover under a running relay
// (doctor.SlotGoneError).

import (
	"context"

	"go.uber.org/zap"

	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// recordStreamed waits until this process's first stream started, then
// writes that into the record (source.RecordStreamed), unless the record
// read at the start already says a relay streamed from the slot. It runs
// beside the stream, not before it: a primary that is slow to answer must
// not hold the stream back. A failure is logged and not retried: the
// record then says no relay streamed from the slot, which only a refusal
// of the slot, once gone, would word amiss.
func (g *guard) recordStreamed(ctx context.Context) {
	if !g.record.NeverStreamed {
		return
	}
	select {
	case <-ctx.Done():
		return
	case <-g.firstStream:
	}
	ctx, cancel := context.WithTimeout(ctx, refusalWriteTimeout)
	defer cancel()
	conn, err := slot.Connect(ctx, g.live.writeURL(g.cfg))
	if err == nil {
		defer conn.Close(context.Background())
		err = source.RecordStreamed(ctx, conn, g.cfg.RecordSchema, g.cfg.Slot)
	}
	if err != nil && ctx.Err() == nil {
		g.log.Warn("cannot write into walrelay's record that a relay streams from the slot; should the slot be dropped, the refusal will say no relay streamed from it", zap.String("slot", g.cfg.Slot), zap.Error(err))
	}
}
