package checkpointtopic

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/test/testkit"
)

func cluster(t *testing.T) []kgo.Opt {
	t.Helper()
	c := testkit.Kfake(t)
	return []kgo.Opt{kgo.SeedBrokers(c.ListenAddrs()...)}
}

// commit produces recs in one Kafka transaction and commits it, or aborts
// it when abort is set.
func commit(t *testing.T, ctx context.Context, cl *kgo.Client, abort bool, recs ...*kgo.Record) {
	t.Helper()
	if err := cl.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	end := kgo.TryCommit
	if abort {
		end = kgo.TryAbort
	}
	if err := cl.EndTransaction(ctx, end); err != nil {
		t.Fatal(err)
	}
}

const topic = "walrelay.checkpoints"

// read opens a Reader once the probe is committed and reads up to it.
func read(t *testing.T, ctx context.Context, opts []kgo.Opt, key, probeKey, probe []byte) ([]byte, bool, error) {
	t.Helper()
	rd, err := OpenReader(opts, topic)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	return rd.Until(ctx, key, probeKey, probe)
}

// prepared starts a broker, prepares the checkpoint topic on it and returns
// a context for the test, the connection options and a transactional
// client.
func prepared(t *testing.T) (context.Context, []kgo.Opt, *kgo.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	opts := cluster(t)
	cl, err := kgo.NewClient(append(opts, kgo.TransactionalID("walrelay-test"))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	if err := Prepare(ctx, kadm.NewClient(cl), topic, true, -1); err != nil {
		t.Fatal(err)
	}
	return ctx, opts, cl
}

func TestReadSeesTheNewestCommittedCheckpointBeforeTheProbe(t *testing.T) {
	ctx, opts, cl := prepared(t)
	if err := Prepare(ctx, kadm.NewClient(cl), topic, true, -1); err != nil {
		t.Fatalf("preparing an existing topic again: %v", err)
	}
	key := []byte("slot_a")
	rec := func(k, v string) *kgo.Record { return &kgo.Record{Topic: topic, Key: []byte(k), Value: []byte(v)} }

	probeKey, probe := Probe(key)
	commit(t, ctx, cl, false, rec(string(probeKey), string(probe)))
	if v, found, err := read(t, ctx, opts, key, probeKey, probe); err != nil || found {
		t.Fatalf("empty topic: %q, %v, %v; want nothing found", v, found, err)
	}

	commit(t, ctx, cl, false, rec("slot_a", "first"), rec("slot_b", "other slot"))
	commit(t, ctx, cl, false, rec("slot_a", "second"))
	commit(t, ctx, cl, true, rec("slot_a", "aborted"))
	probeKey, probe = Probe(key)
	commit(t, ctx, cl, false, rec(string(probeKey), string(probe)))
	commit(t, ctx, cl, false, rec("slot_a", "after the probe"))
	v, found, err := read(t, ctx, opts, key, probeKey, probe)
	if err != nil || !found || string(v) != "second" {
		t.Fatalf("read = %q, %v, %v; want the newest committed checkpoint before the probe, \"second\"", v, found, err)
	}
}

func TestPrepareRefusesAMissingOrPartitionedTopic(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cl, err := kgo.NewClient(cluster(t)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	admin := kadm.NewClient(cl)
	if err := Prepare(ctx, admin, "missing", false, -1); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("missing topic without creation: %v", err)
	}
	if _, err := admin.CreateTopic(ctx, 3, -1, nil, "three"); err != nil {
		t.Fatal(err)
	}
	if err := Prepare(ctx, admin, "three", true, -1); err == nil || !strings.Contains(err.Error(), "exactly one") {
		t.Fatalf("three partitions: %v", err)
	}
}

// A tombstone for the slot's key deletes its checkpoint (an operator
// resetting it, as compaction will remove it): the reader finds nothing, where
// it used to return the null value, which the relay refused as an
// unparseable checkpoint at every start. A newer record counts again.
func TestReadTakesATombstoneForNoCheckpoint(t *testing.T) {
	ctx, opts, cl := prepared(t)
	key := []byte("slot_a")
	read := func() ([]byte, bool) {
		t.Helper()
		probeKey, probe := Probe(key)
		commit(t, ctx, cl, false, &kgo.Record{Topic: topic, Key: probeKey, Value: probe})
		v, found, err := read(t, ctx, opts, key, probeKey, probe)
		if err != nil {
			t.Fatal(err)
		}
		return v, found
	}
	commit(t, ctx, cl, false, &kgo.Record{Topic: topic, Key: key, Value: []byte("first")})
	commit(t, ctx, cl, false, &kgo.Record{Topic: topic, Key: key}) // tombstone
	if v, found := read(); found || v != nil {
		t.Fatalf("after a tombstone read = %q, %v; want nothing found", v, found)
	}
	commit(t, ctx, cl, false, &kgo.Record{Topic: topic, Key: key, Value: []byte("again")})
	if v, found := read(); !found || string(v) != "again" {
		t.Fatalf("after a record following the tombstone read = %q, %v; want \"again\"", v, found)
	}
}

// The relay opens the reader before it commits the probe, so that the
// reader's connection and first fetches overlap the commit: what it finds
// must be what a reader opened after finds, checkpoints committed between
// the open and the probe included.
func TestReaderOpenedBeforeTheProbe(t *testing.T) {
	ctx, opts, cl := prepared(t)
	key := []byte("slot_a")
	rec := func(k, v string) *kgo.Record { return &kgo.Record{Topic: topic, Key: []byte(k), Value: []byte(v)} }
	commit(t, ctx, cl, false, rec("slot_a", "first"))
	rd, err := OpenReader(opts, topic)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	commit(t, ctx, cl, false, rec("slot_a", "second"))
	probeKey, probe := Probe(key)
	commit(t, ctx, cl, false, rec(string(probeKey), string(probe)))
	commit(t, ctx, cl, false, rec("slot_a", "after the probe"))
	v, found, err := rd.Until(ctx, key, probeKey, probe)
	if err != nil || !found || string(v) != "second" {
		t.Fatalf("Until = %q, %v, %v; want \"second\", committed after the reader opened and before the probe", v, found, err)
	}
}

// A broker answers metadata from a cache the controller updates after
// CreateTopics returns: right after creating the topic, it may still call
// it unknown or leaderless (a loaded Apache Kafka did, and the relay
// refused to start with "does not exist"). Prepare's describe asks again
// for a topic it just created; for one it did not create, a first answer
// stands.
func TestDescribeWaitsForATopicItJustCreated(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	answers := func() func(context.Context) (kadm.TopicDetails, error) {
		calls := 0
		return func(context.Context) (kadm.TopicDetails, error) {
			calls++
			switch calls {
			case 1:
				return kadm.TopicDetails{}, nil
			case 2:
				return kadm.TopicDetails{topic: {Topic: topic, Err: kerr.UnknownTopicOrPartition}}, nil
			case 3:
				return kadm.TopicDetails{topic: {Topic: topic, Err: kerr.LeaderNotAvailable}}, nil
			}
			return kadm.TopicDetails{topic: {Topic: topic, Partitions: kadm.PartitionDetails{0: {}}}}, nil
		}
	}
	d, ok, err := describe(ctx, answers(), topic, true)
	if err != nil || !ok || d.Err != nil || len(d.Partitions) != 1 {
		t.Fatalf("a topic just created, unknown then leaderless: %+v %v %v", d, ok, err)
	}
	if _, ok, err := describe(ctx, answers(), topic, false); ok || err != nil {
		t.Fatalf("a topic not created: the first answer (none) stands, got ok=%v err=%v", ok, err)
	}
}
