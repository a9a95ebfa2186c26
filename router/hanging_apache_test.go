package router

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/test/kafkacluster"
	"github.com/walrelay/walrelay/test/testkit"
)

// TestAbortHangingApache makes the hanging transaction Apache Kafka 4.4
// left in CI when a node restarted during an exactly-once commit: the
// coordinator commits a transaction while a partition it wrote has no
// leader, skips that partition's marker ("likely deleted"), and the
// record stays open there once the partition is back. Landed then waits
// in vain on it (read_committed stops at the last stable offset), and
// the next transaction of the producer to write there would commit it
// along with its own, resent, copy. AbortHanging finds it and aborts it:
// Landed then reads the partition as not landed, and read_committed
// consumers pass it.
func TestAbortHangingApache(t *testing.T) {
	testkit.NeedApache(t, os.Getenv("WALRELAY_TEST_KAFKA") == "apache")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	k, err := kafkacluster.Start(ctx, kafkacluster.Options{Nodes: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	defer func() {
		if t.Failed() {
			t.Log(k.LogTail(40))
		}
	}()
	adm, err := k.Admin()
	if err != nil {
		t.Fatal(err)
	}
	defer adm.Close()
	const evTopic, ckTopic = "hanging.events", "hanging.checkpoints"
	// One replica: with its node down the partition has no leader.
	one := "1"
	if _, err := adm.CreateTopic(ctx, 1, 1, map[string]*string{"min.insync.replicas": &one}, evTopic); err != nil {
		t.Fatal(err)
	}
	if _, err := adm.CreateTopic(ctx, 1, 3, nil, ckTopic); err != nil {
		t.Fatal(err)
	}
	leader := func() int32 {
		md, err := adm.Metadata(ctx, evTopic)
		if err != nil || len(md.Topics[evTopic].Partitions) == 0 {
			return -2
		}
		return md.Topics[evTopic].Partitions[0].Leader
	}
	var node int32
	for node = leader(); node < 0; node = leader() {
		time.Sleep(100 * time.Millisecond)
	}
	// A transactional id whose coordinator lives on another node.
	var txnID string
	for i := 0; txnID == ""; i++ {
		id := fmt.Sprintf("walrelay-hanging-%d", i)
		c := adm.FindTxnCoordinators(ctx, id)
		if err := c.Error(); err != nil {
			// The first asks create __transaction_state.
			if ctx.Err() != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond)
			i--
			continue
		}
		if c[id].NodeID != node {
			txnID = id
		}
	}

	// The transaction the coordinator leaves open on evTopic.
	t1, err := kgo.NewClient(kgo.SeedBrokers(k.Addrs()...), kgo.TransactionalID(txnID),
		kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.RecordRetries(3))
	if err != nil {
		t.Fatal(err)
	}
	defer t1.Close()
	if err := t1.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	res := t1.ProduceSync(ctx, &kgo.Record{Topic: evTopic, Value: []byte("t1")}, &kgo.Record{Topic: ckTopic, Value: []byte("ck")})
	if err := res.FirstErr(); err != nil {
		t.Fatal(err)
	}
	first := res[0].Record.Offset
	k.Kill(int(node))
	for leader() != -1 {
		time.Sleep(100 * time.Millisecond)
	}
	if err := t1.EndTransaction(ctx, kgo.TryCommit); err != nil {
		t.Fatalf("commit with the event partition leaderless: %v", err)
	}
	t1.Close()
	if err := k.Restart(ctx, int(node)); err != nil {
		t.Fatal(err)
	}
	for leader() != node {
		time.Sleep(100 * time.Millisecond)
	}
	open := func() []kadm.DescribedProducer {
		d, err := adm.DescribeProducers(ctx, kadm.TopicsSet{evTopic: {0: {}}})
		if err != nil {
			t.Fatal(err)
		}
		var out []kadm.DescribedProducer
		d.EachPartition(func(p kadm.DescribedProducersPartition) {
			for _, ap := range p.ActiveProducers {
				if ap.CurrentTxnStartOffset >= 0 {
					out = append(out, ap)
				}
			}
		})
		return out
	}
	if o := open(); len(o) != 1 || o[0].CurrentTxnStartOffset != first {
		t.Fatalf("the broker left %v open on %s/0; the test needs the transaction's record at %d open (the coordinator skipping its marker)", o, evTopic, first)
	}

	// The next relay session's router: Init, then AbortHanging.
	r, err := New(withDefaults(Config{TransactionalID: txnID, CheckpointTopic: ckTopic}), []kgo.Opt{kgo.SeedBrokers(k.Addrs()...)},
		zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), metrics.NewUnregistered(), func(err error) { t.Errorf("fatal: %v", err) })
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := r.Txn().Init(ctx); err != nil {
		t.Fatal(err)
	}
	uc := &CommitUnconfirmed{err: errors.New("cut off"), written: []written{{topic: evTopic, partition: 0, offset: first}}}
	if os.Getenv("WALRELAY_TEST_NO_ABORT_HANGING") == "" { // to see the test fail without it
		where, err := r.Txn().AbortHanging(ctx, uc)
		if err != nil {
			t.Fatal(err)
		}
		if want := []string{evTopic + "/0"}; !slices.Equal(where, want) {
			t.Errorf("AbortHanging aborted on %v, want %v", where, want)
		}
	}
	lctx, lcancel := context.WithTimeout(ctx, 30*time.Second)
	defer lcancel()
	landed, err := r.Txn().Landed(lctx, uc)
	if err != nil || landed {
		t.Fatalf("Landed = %v, %v; want false: the transaction was aborted on its partition", landed, err)
	}
	if o := open(); len(o) != 0 {
		t.Errorf("still open on %s/0: %v", evTopic, o)
	}
	// A read_committed consumer passes the partition to its end without
	// the aborted record.
	end, err := adm.ListEndOffsets(ctx, evTopic)
	if err != nil {
		t.Fatal(err)
	}
	hw, _ := end.Lookup(evTopic, 0)
	rc, err := kgo.NewClient(kgo.SeedBrokers(k.Addrs()...), kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords(),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{evTopic: {0: kgo.NewOffset().AtStart()}}))
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	for reached := false; !reached; {
		fs := rc.PollFetches(lctx)
		if err := lctx.Err(); err != nil {
			t.Fatalf("read_committed did not reach %s/0's end (%d): %v", evTopic, hw.Offset, err)
		}
		fs.EachRecord(func(rec *kgo.Record) {
			if !rec.Attrs.IsControl() {
				t.Errorf("read_committed read %q at %d", rec.Value, rec.Offset)
			}
			reached = reached || rec.Offset >= hw.Offset-1
		})
	}
}
