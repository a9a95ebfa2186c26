package relay

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/slot"
)

// snapshotFake is a fakeProducer that can say Kafka refused a record.
type snapshotFake struct {
	*fakeProducer
	err error
}

func (f *snapshotFake) Failed() bool { return f.err != nil }
func (f *snapshotFake) Err() error   { return f.err }

func snapshotEvent(id string) *decoder.Event {
	return &decoder.Event{ID: []byte(id), AggregateType: []byte("order"), AggregateID: []byte("a1")}
}

func TestSnapshotSenderAtLeastOnce(t *testing.T) {
	p := &snapshotFake{fakeProducer: &fakeProducer{}}
	ctx := context.Background()
	s := newSnapshotSender(ctx, p, 5000, metrics.NewUnregistered())
	for _, id := range []string{"r1", "r2"} {
		if err := s.Send(ctx, snapshotEvent(id)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.finish(ctx); err != nil {
		t.Fatalf("finish: %v", err)
	}
	if got := p.sent(); len(got) != 2 {
		t.Fatalf("sent %v, want both rows", got)
	}
	p.err = errors.New("TOPIC_AUTHORIZATION_FAILED")
	if err := s.Send(ctx, snapshotEvent("r3")); err == nil || !strings.Contains(err.Error(), "kafka refused a snapshot record") {
		t.Fatalf("Send after a refusal returned %v", err)
	}
	if err := s.finish(ctx); err == nil {
		t.Fatal("finish after a refusal returned nil")
	}
}

func TestSnapshotSenderUnackedRecordsFail(t *testing.T) {
	p := &snapshotFake{fakeProducer: &fakeProducer{refused: true}}
	s := newSnapshotSender(context.Background(), p, 5000, metrics.NewUnregistered())
	if err := s.Send(context.Background(), snapshotEvent("r1")); err != nil {
		t.Fatal(err)
	}
	if err := s.finish(context.Background()); err == nil || !strings.Contains(err.Error(), "not acknowledged") {
		t.Fatalf("finish with a record never acked returned %v", err)
	}
}

func TestSnapshotSenderWaitsForRoom(t *testing.T) {
	room := make(chan struct{})
	p := &snapshotFake{fakeProducer: &fakeProducer{autoAck: true, room: room}}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	s := newSnapshotSender(ctx, p, 5000, metrics.NewUnregistered())
	if err := s.Send(ctx, snapshotEvent("r1")); !errors.Is(err, context.Canceled) {
		t.Fatalf("Send without room after the stop returned %v", err)
	}
}

func TestSnapshotSenderExactlyOnceCommitsAtTheConsistentPoint(t *testing.T) {
	cfg := validConfig()
	cfg.ExactlyOnce, cfg.TxnMaxEvents = true, 2
	r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	p := &snapshotFake{fakeProducer: &fakeProducer{eos: true}}
	ctx := context.Background()
	s := r.newExactlyOnceSnapshot(ctx, p, p, 5000, pglogrepl.IdentifySystemResult{SystemID: "42"})
	for _, id := range []string{"r1", "r2", "r3"} {
		if err := s.Send(ctx, snapshotEvent(id)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.finish(ctx); err != nil {
		t.Fatal(err)
	}
	c := p.checkpoints()
	if len(c) != 2 || c[0].LSN != 5000 || c[1].LSN != 5000 || c[1].SystemID != "42" || c[1].Partial != nil {
		t.Fatalf("checkpoints %+v, want two at the consistent point 5000", c)
	}
}

func TestRecordSlotAndByTable(t *testing.T) {
	r, err := New(validConfig(), zap.NewNop(), metrics.NewUnregistered())
	if err != nil {
		t.Fatal(err)
	}
	size := int64(7)
	recordSlot(r.metrics, slot.Info{WALStatus: "lost", RetainedWALBytes: 3, LagBytes: 2, SafeWALSize: &size})
	got := byTable(r.cfg.Tables, []int64{4})
	if got["public.outbox"] != 4 {
		t.Fatalf("byTable = %v", got)
	}
}
