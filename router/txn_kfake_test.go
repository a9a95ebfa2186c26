package router

import (
	"context"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

// TestKafkaTxnCommitAcksAbortDoesNot runs the transactional producer
// against kfake: a record's transaction is acked when its Kafka transaction
// commits, never when Kafka merely has the record, and an aborted Kafka
// transaction acks nothing and stays invisible to read_committed readers.
func TestKafkaTxnCommitAcksAbortDoesNot(t *testing.T) {
	e := newEnv(t, Config{TransactionalID: "walrelay-test"})
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := e.r.Txn().Init(ctx); err != nil {
		t.Fatal(err)
	}

	committed := &testAcker{}
	e.mustSend(event("c1", "order", "k1", `{}`), 1, committed)
	if !e.r.Txn().Open() || e.r.Txn().Records() != 1 {
		t.Fatalf("after a send: open %v with %d records, want one open with 1", e.r.Txn().Open(), e.r.Txn().Records())
	}
	if err := e.r.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if n := committed.acks.Load(); n != 0 {
		t.Fatalf("%d acks before the Kafka commit, want 0", n)
	}
	if err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("checkpoint 1")); err != nil {
		t.Fatal(err)
	}
	if n := committed.acks.Load(); n != 1 || e.r.Txn().Open() {
		t.Fatalf("after the commit: %d acks, open %v; want 1 ack and none open", n, e.r.Txn().Open())
	}

	aborted := &testAcker{}
	e.mustSend(event("a1", "order", "k1", `{}`), 2, aborted)
	// In Kafka, not yet committed: an abort now leaves the producer usable
	// (aborting records still buffered fails them, and the router with
	// them, as a session's failure does).
	if err := e.r.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.r.Txn().Abort(ctx); err != nil {
		t.Fatal(err)
	}
	if n := aborted.acks.Load(); n != 0 || e.r.Txn().Open() {
		t.Fatalf("after the abort: %d acks, open %v; want none", n, e.r.Txn().Open())
	}

	last := &testAcker{}
	e.mustSend(event("c2", "order", "k1", `{}`), 3, last)
	if err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("checkpoint 2")); err != nil {
		t.Fatal(err)
	}

	// read_committed up to c2: the aborted record is not among them.
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.seeds...), kgo.ConsumeTopics("outbox.event.order"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var ids []string
	for len(ids) == 0 || ids[len(ids)-1] != "c2" {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %v, never c2: %v", ids, ctx.Err())
		}
		fs.EachRecord(func(r *kgo.Record) { ids = append(ids, string(r.Headers[0].Value)) })
	}
	if len(ids) != 2 || ids[0] != "c1" {
		t.Fatalf("read_committed saw %v, want [c1 c2]", ids)
	}
}
