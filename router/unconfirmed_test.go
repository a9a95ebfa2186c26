package router

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// firstOffsets is, per partition, the first offset among the records
// published since the index from.
func (e *env) firstOffsets(from int) []written {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []written
	seen := map[int32]bool{}
	for _, rec := range e.published[from:] {
		if !seen[rec.Partition] {
			seen[rec.Partition] = true
			out = append(out, written{topic: rec.Topic, partition: rec.Partition, offset: rec.Offset})
		}
	}
	return out
}

func (e *env) publishedCount() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.published)
}

func sortWritten(w []written) []written {
	w = slices.Clone(w)
	slices.SortFunc(w, func(a, b written) int { return int(a.partition - b.partition) })
	return w
}

// sendSpread sends n events with distinct keys, so that they spread over
// the topic's partitions, several to each.
func (e *env) sendSpread(prefix string, n int) {
	e.t.Helper()
	for i := range n {
		e.mustSend(event(fmt.Sprintf("%s%d", prefix, i), "order", fmt.Sprintf("k%d", i), "{}"), lsnOf(i+1), &testAcker{})
	}
	e.flush()
}

// A commit whose EndTxn fails is a *CommitUnconfirmed naming the first
// record the transaction wrote to each partition; read back after another
// producer took the id (which aborted it), it did not land.
func TestUnconfirmedCommitNamesItsFirstRecords(t *testing.T) {
	e := newEOSEnv(t)
	e.sendSpread("a", 12)
	e.commitTxn("slot", "ck-1")
	from := e.publishedCount()
	e.sendSpread("b", 12)
	want := e.firstOffsets(from)
	if len(want) < 2 {
		t.Fatalf("the transaction wrote to %d partitions; the test needs several", len(want))
	}
	e.answerEndTxn(kerr.InvalidTxnState.Code, false)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("ck-2"))
	var uc *CommitUnconfirmed
	if !errors.As(err, &uc) {
		t.Fatalf("Commit with EndTxn failing: %v; want a *CommitUnconfirmed", err)
	}
	if !errors.Is(err, kerr.InvalidTxnState) {
		t.Errorf("%v does not wrap the commit's error", err)
	}
	if got := sortWritten(uc.written); !slices.Equal(got, sortWritten(want)) {
		t.Fatalf("CommitUnconfirmed names %v, want the transaction's first record in each partition %v", got, want)
	}

	// Another producer takes the id: the coordinator aborts the open
	// transaction.
	other, err := kgo.NewClient(kgo.SeedBrokers(e.seeds...), kgo.TransactionalID(eosTxnID))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, _, err := other.ProducerID(ctx); err != nil {
		t.Fatal(err)
	}
	landed, err := e.r.Txn().Landed(ctx, uc)
	if err != nil || landed {
		t.Fatalf("Landed of an aborted transaction = %v, %v; want false", landed, err)
	}
}

// Landed reads a committed transaction as landed, and one that names a
// partition where the transaction was aborted (the split outcome a
// coordinator killed during a commit has left) as not.
func TestLandedReadsEachPartitionsOutcome(t *testing.T) {
	e := newEOSEnv(t)
	e.sendSpread("c", 12)
	committed := e.firstOffsets(0)
	e.commitTxn("slot", "ck-1")
	from := e.publishedCount()
	e.sendSpread("a", 12)
	aborted := e.firstOffsets(from)
	e.abortTxn()
	// Records after both, so that an aborted record is not the last thing
	// on its partition.
	e.sendSpread("d", 12)
	e.commitTxn("slot", "ck-2")

	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	for _, c := range []struct {
		name    string
		written []written
		want    bool
	}{
		{"committed", committed, true},
		{"aborted", aborted, false},
		{"committed but on one partition", append(slices.Clone(committed[1:]), aborted[0]), false},
		{"only the checkpoint", nil, true},
	} {
		got, err := e.r.Txn().Landed(ctx, &CommitUnconfirmed{err: errors.New("cut off"), written: c.written})
		if err != nil || got != c.want {
			t.Errorf("%s: Landed = %v, %v; want %v", c.name, got, err, c.want)
		}
	}
}

// BenchmarkFirstWritesNote is what each record's promise adds under
// exactly-once delivery: a lookup in a map of the partitions written.
func BenchmarkFirstWritesNote(b *testing.B) {
	f := firstWrites{}
	t := &topic{name: "outbox.event.order"}
	recs := make([]kgo.Record, 16)
	for i := range recs {
		recs[i] = kgo.Record{Partition: int32(i % 6), Offset: int64(i)}
	}
	for i := 0; b.Loop(); i++ {
		f.note(t, &recs[i%len(recs)])
	}
}
