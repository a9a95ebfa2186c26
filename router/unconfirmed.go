package router

import (
	"context"
	"fmt"
	"slices"
	"strconv"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// unconfirmed.go: a Kafka commit that was asked for and never answered.
// EndTxn cut off by a broker's death or a network failure may have
// committed, or not, and on Apache Kafka has been seen to leave one
// transaction committed on some partitions and aborted on others (its
// coordinator killed during the commit). Commit then returns a
// *CommitUnconfirmed naming the first record the transaction wrote to each
// partition, and once the transactional id is taken again (Init, which
// makes the coordinator finish the transaction) AbortHanging ends what
// the coordinator left open of it and Landed reads those records back to
// learn the outcome.

// CommitUnconfirmed is Commit's error when Kafka did not answer the commit
// (EndTxn failed): the transaction may have committed, on every partition
// or on some. Landed tells. It wraps the commit's error.
type CommitUnconfirmed struct {
	err     error
	lane    int // the lane (transactional producer) that asked
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

// unconfirmed wraps err, the commit's failure on lane n, with what the
// transaction wrote.
func (f firstWrites) unconfirmed(n int, err error) *CommitUnconfirmed {
	e := &CommitUnconfirmed{err: err, lane: n, written: make([]written, 0, len(f))}
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

// AbortHanging aborts what the coordinator left open of the transaction
// of a failed Commit (uc), and reports where: the partitions, by
// "topic/partition". Apache Kafka's coordinator, finishing a transaction
// after its node restarts, skips the markers of a partition whose leader
// it cannot find at that moment (it logs "likely deleted"; seen on Kafka
// 4.4 when a node restarts within its broker session timeout: its old
// session is fenced, every partition it leads loses its leader for a
// moment, while it writes them). The transaction's records there stay
// open: read_committed consumers stop before them (the last stable
// offset), Landed waits in vain, and the next transaction of this
// producer to write there ends them with its own marker: committed with
// it, events resent in it are read twice; aborted, events skipped on the
// checkpoint's word are lost.
//
// It asks each partition the transaction wrote, and the checkpoint
// topic's, which producers hold a transaction open (DescribeProducers,
// which needs READ on the topic, as Landed's read does). Where this
// producer does (none of its own is open now: call it after Init, and
// before ReadCheckpoint, whose probe would commit a checkpoint left
// open), it writes a record there in a transaction it then aborts: the
// abort marker ends the older records too. Those events then read as not
// landed, and are resent once.
func (t *Txn) AbortHanging(ctx context.Context, uc *CommitUnconfirmed) ([]string, error) {
	r := t.r
	if uc.lane >= len(t.lanes) {
		return nil, fmt.Errorf("find hanging Kafka transactions: the unconfirmed commit was the second transactional producer's, %q, which this router does not have (Init found it denied)", laneID(r.cfg.TransactionalID, uc.lane))
	}
	l := t.lanes[uc.lane]
	pid, _, err := l.client.ProducerID(ctx)
	if err != nil {
		return nil, fmt.Errorf("find hanging Kafka transactions: %w", err)
	}
	adm := kadm.NewClient(l.client)
	meta, err := adm.Metadata(ctx, r.cfg.CheckpointTopic)
	if err != nil {
		return nil, fmt.Errorf("find hanging Kafka transactions: %w", err)
	}
	asked := make(kadm.TopicsSet)
	for _, p := range meta.Topics[r.cfg.CheckpointTopic].Partitions {
		asked.Add(r.cfg.CheckpointTopic, p.Partition)
	}
	for _, w := range uc.written {
		asked.Add(w.topic, w.partition)
	}
	described, err := adm.DescribeProducers(ctx, asked)
	if err != nil {
		return nil, fmt.Errorf("find hanging Kafka transactions: %w", err)
	}
	type hanging struct {
		topic     string
		partition int32
	}
	var open []hanging
	var failed error
	described.EachPartition(func(p kadm.DescribedProducersPartition) {
		if p.Err != nil {
			failed = fmt.Errorf("find hanging Kafka transactions on %s/%d: %w", p.Topic, p.Partition, p.Err)
			return
		}
		for _, ap := range p.ActiveProducers {
			if ap.ProducerID == pid && ap.CurrentTxnStartOffset >= 0 {
				open = append(open, hanging{p.Topic, p.Partition})
			}
		}
	})
	if failed != nil {
		return nil, failed
	}
	if len(open) == 0 {
		return nil, nil
	}
	counts, err := adm.Metadata(ctx, topicsOf(open, func(h hanging) string { return h.topic })...)
	if err != nil {
		return nil, fmt.Errorf("abort hanging Kafka transactions: %w", err)
	}
	recs := make([]*kgo.Record, 0, len(open))
	where := make([]string, 0, len(open))
	for _, h := range open {
		n := len(counts.Topics[h.topic].Partitions)
		rec := sweepRecord(h.topic, h.partition, n)
		if rec == nil {
			return nil, fmt.Errorf("abort hanging Kafka transactions: found no key the partitioner maps to %s/%d", h.topic, h.partition)
		}
		recs = append(recs, rec)
		where = append(where, h.topic+"/"+strconv.Itoa(int(h.partition)))
	}
	cur := t.cur
	t.cur = uc.lane
	defer func() { t.cur = cur }()
	if err := t.begin(); err != nil {
		return nil, err
	}
	if err := l.client.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		_ = t.Abort(context.Background())
		return nil, t.error(l, fmt.Errorf("abort hanging Kafka transactions: %w", err))
	}
	if err := t.Abort(ctx); err != nil {
		return nil, err
	}
	slices.Sort(where)
	return where, nil
}

// sweepRecord is a record the router's partitioner (StickyKeyPartitioner,
// keyed) puts in partition p of topic's n: its key is tried until one
// hashes there. Only an aborted transaction holds it, so read_committed
// consumers never see it; a read_uncommitted one sees its key.
func sweepRecord(topic string, p int32, n int) *kgo.Record {
	part := kgo.StickyKeyPartitioner(nil).ForTopic(topic)
	for i := range 100 * n {
		rec := &kgo.Record{Topic: topic, Key: []byte("walrelay-abort-hanging-" + strconv.Itoa(i)), Value: []byte{}}
		if int32(part.Partition(rec, n)) == p {
			return rec
		}
	}
	return nil
}

func topicsOf[T any](xs []T, topic func(T) string) []string {
	var ts []string
	for _, x := range xs {
		if t := topic(x); !slices.Contains(ts, t) {
			ts = append(ts, t)
		}
	}
	return ts
}
