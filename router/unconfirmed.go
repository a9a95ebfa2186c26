package router

import (
	"context"
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"
)

// unconfirmed.go: a Kafka commit that was asked for and never answered.
// EndTxn cut off by a broker's death or a network failure may have
// committed, or not, and on Apache Kafka has been seen to leave one
// transaction committed on some partitions and aborted on others (its
// coordinator killed during the commit). Commit then returns a
// *CommitUnconfirmed naming the first record the transaction wrote to each
// partition, and once the transactional id is taken again (Init, which
// makes the coordinator finish the transaction) Landed reads those records
// back to learn the outcome.

// CommitUnconfirmed is Commit's error when Kafka did not answer the commit
// (EndTxn failed): the transaction may have committed, on every partition
// or on some. Landed tells. It wraps the commit's error.
type CommitUnconfirmed struct {
	err     error
	written []written
}

// written is the first record a Kafka transaction wrote to a partition:
// all of the transaction's records there share its fate.
type written struct {
	topic     string
	partition int32
	offset    int64
}

func (e *CommitUnconfirmed) Error() string { return e.err.Error() }
func (e *CommitUnconfirmed) Unwrap() error { return e.err }

// Partitions is how many partitions (besides the checkpoint's) the
// transaction wrote to.
func (e *CommitUnconfirmed) Partitions() int { return len(e.written) }

// firstWrites is, per partition, the offset of the first record the open
// Kafka transaction wrote there. Only the producer's promise goroutine
// writes it while records are in flight; the Send goroutine reads and
// clears it once none are (after Flush or AbortBufferedRecords, which
// return only after every promise ran).
type firstWrites map[partitionOf]int64

type partitionOf struct {
	t         *topic
	partition int32
}

// note records rec's offset if it is the transaction's first in its
// partition.
func (f firstWrites) note(t *topic, rec *kgo.Record) {
	k := partitionOf{t, rec.Partition}
	if _, ok := f[k]; !ok {
		f[k] = rec.Offset
	}
}

// unconfirmed wraps err, the commit's failure, with what the transaction
// wrote.
func (f firstWrites) unconfirmed(err error) *CommitUnconfirmed {
	e := &CommitUnconfirmed{err: err, written: make([]written, 0, len(f))}
	for k, off := range f {
		e.written = append(e.written, written{topic: k.t.name, partition: k.partition, offset: off})
	}
	return e
}

// Landed reports whether the Kafka transaction of a failed Commit (uc)
// committed on every partition it wrote to: reading each read_committed
// from its first record there, that record is what comes first. An aborted
// record is skipped by a read_committed fetch, and the abort marker after
// it (kept: KeepControlRecords) comes first instead, so the read ends on
// every partition whatever the outcome. Call it after Init on a new
// router: the coordinator has then completed or aborted the transaction,
// and the fetch waits for its markers. A record gone from a partition
// (retention, compaction) reads as not landed: resending costs duplicates,
// trusting a transaction that did not land would lose events.
func (t *Txn) Landed(ctx context.Context, uc *CommitUnconfirmed) (bool, error) {
	if len(uc.written) == 0 {
		return true, nil // only the checkpoint was in it
	}
	type partition struct {
		topic string
		n     int32
	}
	start := make(map[string]map[int32]kgo.Offset)
	want := make(map[partition]int64, len(uc.written))
	for _, w := range uc.written {
		if start[w.topic] == nil {
			start[w.topic] = make(map[int32]kgo.Offset)
		}
		start[w.topic][w.partition] = kgo.NewOffset().At(w.offset)
		want[partition{w.topic, w.partition}] = w.offset
	}
	cl, err := kgo.NewClient(append(append([]kgo.Opt(nil), t.r.connOpts...),
		kgo.ConsumePartitions(start),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(),
	)...)
	if err != nil {
		return false, fmt.Errorf("read back an unconfirmed Kafka commit: %w", err)
	}
	defer cl.Close()
	for len(want) > 0 {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return false, fmt.Errorf("read back an unconfirmed Kafka commit (%d partitions left): %w", len(want), err)
		}
		var fetchErr error
		fs.EachError(func(_ string, _ int32, err error) { fetchErr = err })
		if fetchErr != nil {
			return false, fmt.Errorf("read back an unconfirmed Kafka commit: %w", fetchErr)
		}
		landed := true
		fs.EachRecord(func(rec *kgo.Record) {
			k := partition{rec.Topic, rec.Partition}
			off, ok := want[k]
			if !ok {
				return // this partition's first record was seen
			}
			delete(want, k)
			if rec.Offset != off || rec.Attrs.IsControl() {
				landed = false
			}
		})
		if !landed {
			return false, nil
		}
	}
	return true, nil
}
