package router

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

// Kafka answers PRODUCER_FENCED or INVALID_PRODUCER_EPOCH both to a
// producer another one fenced and to one whose transaction it timed out:
// the transaction's age decides.
func TestTxnErrorClassification(t *testing.T) {
	for _, tc := range []struct {
		name          string
		err           error
		open          time.Duration
		fenced, timed bool
	}{
		{"fenced young transaction", kerr.ProducerFenced, 100 * time.Millisecond, true, false},
		{"fenced after the timeout", kerr.ProducerFenced, 3 * time.Second, false, true},
		{"stale epoch, young transaction", kerr.InvalidProducerEpoch, 100 * time.Millisecond, true, false},
		{"stale epoch after the timeout", kerr.InvalidProducerEpoch, 3 * time.Second, false, true},
		{"other error", kerr.InvalidTxnState, 100 * time.Millisecond, false, false},
		{"other error after the timeout", kerr.InvalidTxnState, 3 * time.Second, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &Router{cfg: Config{TransactionTimeout: 2 * time.Second}}
			l := &lane{id: "relay"}
			r.txn = &Txn{r: r, lanes: []*lane{l}}
			l.began.Store(time.Now().Add(-tc.open).UnixNano())
			err := r.txn.error(l, fmt.Errorf("commit Kafka transaction: %w", tc.err))
			if got := errors.Is(err, ErrFenced); got != tc.fenced {
				t.Errorf("errors.Is(%v, ErrFenced) = %v, want %v", err, got, tc.fenced)
			}
			if got := errors.Is(err, ErrTxnTimedOut); got != tc.timed {
				t.Errorf("errors.Is(%v, ErrTxnTimedOut) = %v, want %v", err, got, tc.timed)
			}
			if !errors.Is(err, tc.err) {
				t.Errorf("%v does not wrap %v", err, tc.err)
			}
			if !r.Failed() {
				t.Error("a failed transactional call leaves the router not Failed: it would be reused")
			}
		})
	}
}

// The tests below run the exactly-once path against an in-process kfake
// broker and check what a read_committed consumer sees, which transactions
// are acked, and what ReadCheckpoint returns.

const (
	eosTopic   = "outbox.event.order" // where event(…, "order", …) lands
	eosCkTopic = "test.checkpoints"
	eosTxnID   = "walrelay-test"
)

// newEOSEnv is newEnv with exactly-once delivery, its transactional
// producer initialized.
func newEOSEnv(t *testing.T) *env {
	t.Helper()
	e := newEnv(t, withDefaults(Config{TransactionalID: eosTxnID, CheckpointTopic: eosCkTopic}))
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := e.r.Txn().Init(ctx); err != nil {
		t.Fatalf("InitTransactions: %v", err)
	}
	return e
}

func (e *env) commitTxn(key, value string) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := e.r.Txn().Commit(ctx, []byte(key), []byte(value)); err != nil {
		e.t.Fatalf("CommitKafkaTxn: %v", err)
	}
}

// answerEndTxn makes the broker answer the next EndTxn (every one, with
// keep) with the error code, without acting on it.
func (e *env) answerEndTxn(code int16, keep bool) {
	e.c.ControlKey(int16(kmsg.EndTxn), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if keep {
			e.c.KeepControl()
		}
		resp := req.(*kmsg.EndTxnRequest).ResponseKind().(*kmsg.EndTxnResponse)
		resp.ErrorCode = code
		return resp, nil, true
	})
}

func (e *env) abortTxn() {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := e.r.Txn().Abort(ctx); err != nil {
		e.t.Fatalf("AbortKafkaTxn: %v", err)
	}
}

func (e *env) readCheckpoint(key string) (string, bool) {
	e.t.Helper()
	e.restart()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	v, found, err := e.r.Txn().ReadCheckpoint(ctx, []byte(key))
	if err != nil {
		e.t.Fatalf("ReadCheckpoint(%q): %v", key, err)
	}
	return string(v), found
}

// restart replaces the router with a new one of the same transactional id,
// as a restarted relay does before it reads its checkpoint: the new one's
// InitTransactions fences the old and aborts its open transaction. (The
// relay never reads its checkpoint on a producer that has committed
// transactions, and kfake now and then answers such a probe with
// OUT_OF_ORDER_SEQUENCE_NUMBER.)
func (e *env) restart() {
	e.t.Helper()
	r, err := New(withDefaults(Config{TransactionalID: eosTxnID, CheckpointTopic: eosCkTopic, CreateTopics: true}),
		[]kgo.Opt{kgo.SeedBrokers(e.seeds...), kgo.RetryBackoffFn(func(int) time.Duration { return 10 * time.Millisecond })},
		zaptest.NewLogger(e.t, zaptest.Level(zap.ErrorLevel)), e.m, func(err error) {
			e.fatals.Add(1)
			e.mu.Lock()
			e.fatalErr = err
			e.mu.Unlock()
		})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(r.Close)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := r.Start(ctx); err != nil {
		e.t.Fatalf("Start: %v", err)
	}
	if err := r.Txn().Init(ctx); err != nil {
		e.t.Fatalf("InitTransactions: %v", err)
	}
	e.r = r
}

// lastStable returns the sum over the topic's partitions of the last
// stable offset: how far a read_committed consumer can read.
func (e *env) lastStable(topic string) int64 {
	e.t.Helper()
	return e.listOffsets((*kadm.Client).ListCommittedOffsets, topic)[topic]
}

// readCommitted reads the topics read_committed from the start until a
// record for which last is true, and returns every record up to it. Give
// it the last record of a committed transaction written after everything
// of interest on the same partition: whatever else read_committed shows
// before it is among the records returned.
func (e *env) readCommitted(last func(*kgo.Record) bool, topics ...string) []*kgo.Record {
	e.t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(e.seeds...),
		kgo.ConsumeTopics(topics...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
	)
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	var recs []*kgo.Record
	for {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			e.t.Fatalf("read_committed: %d records read, the last one expected not among them: %v", len(recs), ctx.Err())
		}
		fs.EachError(func(topic string, p int32, err error) { e.t.Errorf("fetch %s/%d: %v", topic, p, err) })
		done := false
		fs.EachRecord(func(r *kgo.Record) {
			recs = append(recs, r)
			done = done || last(r)
		})
		if done {
			return recs
		}
	}
}

// otherTxnClient is a second transactional producer (its own id) writing
// to the checkpoint topic: an older relay, or anything else that races the
// router's transactions.
func (e *env) otherTxnClient(id string) *kgo.Client {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.seeds...), kgo.TransactionalID(id), kgo.DefaultProduceTopic(eosCkTopic))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(cl.Close)
	return cl
}

// otherTxn writes a checkpoint record in a transaction of cl's own and
// ends it with commit or abort.
func otherTxn(t *testing.T, cl *kgo.Client, key, value string, commit kgo.TransactionEndTry) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := cl.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	if err := cl.ProduceSync(ctx, &kgo.Record{Key: []byte(key), Value: []byte(value)}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if err := cl.EndTransaction(ctx, commit); err != nil {
		t.Fatal(err)
	}
}

func ids(recs []*kgo.Record, topic string) []string {
	var out []string
	for _, r := range recs {
		if r.Topic == topic {
			for _, h := range r.Headers {
				if h.Key == "id" {
					out = append(out, string(h.Value))
				}
			}
		}
	}
	return out
}

// Records of an open Kafka transaction are in the log, acknowledged by
// Kafka, and still neither visible read_committed nor acked to their
// PostgreSQL transaction; CommitKafkaTxn makes them and its checkpoint record
// visible together and only then acks them.
func TestCommitTxnAcksAfterCommit(t *testing.T) {
	e := newEOSEnv(t)
	a := &testAcker{}
	for i := range 3 {
		e.mustSend(event(fmt.Sprintf("a%d", i), "order", "k", "{}"), lsnOf(i), a)
	}
	if !e.r.Txn().Open() || e.r.Txn().Records() != 3 {
		t.Fatalf("after 3 sends KafkaTxnOpen() = %v, KafkaTxnRecords() = %d; want true, 3", e.r.Txn().Open(), e.r.Txn().Records())
	}
	e.flush()
	if n := e.endOffsets(eosTopic)[eosTopic]; n != 3 {
		t.Fatalf("the topic holds %d records after Flush; want the 3 of the open transaction", n)
	}
	if n := e.lastStable(eosTopic); n != 0 {
		t.Errorf("read_committed can read %d records of an open transaction", n)
	}
	if got := a.acks.Load(); got != 0 {
		t.Errorf("%d acks before the Kafka transaction committed; want 0", got)
	}

	e.commitTxn("slot", "ck-1")
	if got := a.acks.Load(); got != 3 {
		t.Errorf("%d acks after the commit; want 3", got)
	}
	if e.r.Txn().Open() || e.r.Txn().Records() != 0 {
		t.Errorf("after CommitKafkaTxn KafkaTxnOpen() = %v, KafkaTxnRecords() = %d; want false, 0", e.r.Txn().Open(), e.r.Txn().Records())
	}
	recs := e.readCommitted(func(r *kgo.Record) bool { return bytes.Equal(idOf(r), []byte("a2")) }, eosTopic)
	if got := strings.Join(ids(recs, eosTopic), ","); got != "a0,a1,a2" {
		t.Errorf("read_committed reads %s; want a0,a1,a2", got)
	}
	ck := e.readCommitted(func(r *kgo.Record) bool { return string(r.Key) == "slot" }, eosCkTopic)
	if v := string(ck[len(ck)-1].Value); v != "ck-1" {
		t.Errorf("checkpoint record %q; want ck-1", v)
	}
	if v, found := e.readCheckpoint("slot"); !found || v != "ck-1" {
		t.Errorf("ReadCheckpoint = %q, %v; want ck-1, true", v, found)
	}

	// With nothing sent since, CommitKafkaTxn has nothing to close: no
	// checkpoint record is written.
	before := e.endOffsets(eosCkTopic)[eosCkTopic]
	e.commitTxn("slot", "ck-empty")
	if after := e.endOffsets(eosCkTopic)[eosCkTopic]; after != before {
		t.Errorf("CommitKafkaTxn with no transaction open wrote %d records", after-before)
	}
}

func idOf(r *kgo.Record) []byte {
	for _, h := range r.Headers {
		if h.Key == "id" {
			return h.Value
		}
	}
	return nil
}

// AbortKafkaTxn drops an open transaction: its records are never visible
// read_committed and never acked, and the next transaction commits and is
// read normally.
func TestAbortTxnDropsTheTransaction(t *testing.T) {
	e := newEOSEnv(t)
	aborted, committed := &testAcker{}, &testAcker{}
	for i := range 2 {
		e.mustSend(event(fmt.Sprintf("x%d", i), "order", "k", "{}"), lsnOf(i), aborted)
	}
	e.flush()
	e.abortTxn()
	if e.r.Txn().Open() || e.r.Txn().Records() != 0 {
		t.Errorf("after AbortKafkaTxn KafkaTxnOpen() = %v, KafkaTxnRecords() = %d; want false, 0", e.r.Txn().Open(), e.r.Txn().Records())
	}
	if e.r.Failed() {
		t.Fatalf("a clean abort left the router Failed: %v", e.r.Err())
	}
	e.mustSend(event("y0", "order", "k", "{}"), lsnOf(2), committed)
	e.commitTxn("slot", "ck-y")

	recs := e.readCommitted(func(r *kgo.Record) bool { return bytes.Equal(idOf(r), []byte("y0")) }, eosTopic)
	if got := strings.Join(ids(recs, eosTopic), ","); got != "y0" {
		t.Errorf("read_committed reads %s; want only y0 (x0, x1 were aborted)", got)
	}
	if n := e.endOffsets(eosTopic)[eosTopic]; n < 3 {
		t.Errorf("the topic holds %d records: the aborted ones never reached Kafka, the test proves nothing", n)
	}
	if got := aborted.acks.Load(); got != 0 {
		t.Errorf("the aborted transaction's events were acked %d times; want 0", got)
	}
	if got := committed.acks.Load(); got != 1 {
		t.Errorf("the committed transaction's event was acked %d times; want 1", got)
	}
	if v, found := e.readCheckpoint("slot"); !found || v != "ck-y" {
		t.Errorf("ReadCheckpoint = %q, %v; want ck-y, true", v, found)
	}
}

// ReadCheckpoint returns the newest committed checkpoint of its key:
// nothing before any, never one of an aborted transaction, never another
// key's, and never its own probes.
func TestReadCheckpointSkipsAbortedTransactions(t *testing.T) {
	e := newEOSEnv(t)
	if v, found := e.readCheckpoint("slot"); found {
		t.Fatalf("ReadCheckpoint on an empty topic = %q, true; want not found", v)
	}
	e.mustSend(event("e1", "order", "k", "{}"), lsnOf(1), &testAcker{})
	e.commitTxn("slot", "ck-1")

	other := e.otherTxnClient("someone-else")
	otherTxn(t, other, "slot", "ck-aborted", kgo.TryAbort)
	otherTxn(t, other, "other-slot", "ck-other", kgo.TryCommit)
	if v, found := e.readCheckpoint("slot"); !found || v != "ck-1" {
		t.Errorf("after an aborted checkpoint ReadCheckpoint = %q, %v; want ck-1, true", v, found)
	}
	// Twice: the first call's probe lies between the checkpoints now.
	e.mustSend(event("e2", "order", "k", "{}"), lsnOf(2), &testAcker{})
	e.commitTxn("slot", "ck-2")
	if v, found := e.readCheckpoint("slot"); !found || v != "ck-2" {
		t.Errorf("ReadCheckpoint = %q, %v; want ck-2, true", v, found)
	}
	if v, found := e.readCheckpoint("other-slot"); !found || v != "ck-other" {
		t.Errorf("ReadCheckpoint(other-slot) = %q, %v; want ck-other, true", v, found)
	}
}

// A checkpoint written before the probe in a transaction still open when
// the probe commits: read_committed cannot pass it until it ends, so
// ReadCheckpoint waits, and returns it if it commits or the older one if
// it aborts.
func TestReadCheckpointProbeRacesACommit(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  kgo.TransactionEndTry
		want string
	}{{"racing commit", kgo.TryCommit, "ck-racing"}, {"racing abort", kgo.TryAbort, "ck-1"}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEOSEnv(t)
			e.mustSend(event("e1", "order", "k", "{}"), lsnOf(1), &testAcker{})
			e.commitTxn("slot", "ck-1")

			ctx, cancel := context.WithTimeout(context.Background(), patience)
			defer cancel()
			racer := e.otherTxnClient("racer")
			if err := racer.BeginTransaction(); err != nil {
				t.Fatal(err)
			}
			if err := racer.ProduceSync(ctx, &kgo.Record{Key: []byte("slot"), Value: []byte("ck-racing")}).FirstErr(); err != nil {
				t.Fatal(err)
			}
			type result struct {
				v     string
				found bool
				err   error
			}
			done := make(chan result, 1)
			before := e.endOffsets(eosCkTopic)[eosCkTopic]
			e.restart()
			go func() {
				v, found, err := e.r.Txn().ReadCheckpoint(ctx, []byte("slot"))
				done <- result{string(v), found, err}
			}()
			// The probe and its commit marker are in the log once it has
			// committed: from then on only the racer holds the reader.
			deadline := time.Now().Add(patience)
			for e.endOffsets(eosCkTopic)[eosCkTopic] < before+2 {
				if time.Now().After(deadline) {
					t.Fatal("the probe never committed")
				}
				select {
				case r := <-done:
					t.Fatalf("ReadCheckpoint returned %+v before its probe committed", r)
				case <-time.After(10 * time.Millisecond):
				}
			}
			select {
			case r := <-done:
				t.Fatalf("ReadCheckpoint returned %+v with a transaction open before its probe", r)
			default:
			}
			if err := racer.EndTransaction(ctx, tc.end); err != nil {
				t.Fatal(err)
			}
			r := <-done
			if r.err != nil || !r.found || r.v != tc.want {
				t.Errorf("ReadCheckpoint = %q, %v, %v; want %q", r.v, r.found, r.err, tc.want)
			}
		})
	}
}

// A second producer with the same transactional id (a newer relay) fences
// the first: its commit fails, nothing of its transaction is acked or
// visible read_committed, and the router is Failed. The error says fenced
// whichever call notices first (kfake and Apache Kafka answer the
// checkpoint record's produce with INVALID_PRODUCER_EPOCH, before the
// commit is tried).
func TestCommitTxnFenced(t *testing.T) {
	e := newEOSEnv(t)
	a := &testAcker{}
	e.mustSend(event("f1", "order", "k", "{}"), lsnOf(1), a)
	e.flush()

	newer := e.otherTxnClient(eosTxnID)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if _, _, err := newer.ProducerID(ctx); err != nil {
		t.Fatal(err)
	}
	err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("ck-fenced"))
	if err == nil {
		t.Fatal("CommitKafkaTxn succeeded after a newer producer took the transactional id")
	}
	if !errors.Is(err, ErrFenced) {
		t.Errorf("CommitKafkaTxn after a newer producer took the id: %v; want ErrFenced", err)
	}
	if got := a.acks.Load(); got != 0 {
		t.Errorf("a fenced transaction was acked %d times", got)
	}
	if !e.r.Failed() {
		t.Error("the fenced router is not Failed: it would be reused")
	}
	if err := newer.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	rec := &kgo.Record{Topic: eosTopic, Key: []byte("k"), Headers: []kgo.RecordHeader{{Key: "id", Value: []byte("n1")}}}
	if err := newer.ProduceSync(ctx, rec).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if err := newer.EndTransaction(ctx, kgo.TryCommit); err != nil {
		t.Fatal(err)
	}
	recs := e.readCommitted(func(r *kgo.Record) bool { return bytes.Equal(idOf(r), []byte("n1")) }, eosTopic)
	if got := strings.Join(ids(recs, eosTopic), ","); got != "n1" {
		t.Errorf("read_committed reads %s; want only n1 (f1 was fenced)", got)
	}
}

// The broker refuses the commit itself (EndTxn answered PRODUCER_FENCED
// while the transaction is young): CommitKafkaTxn says fenced and acks nothing,
// though Kafka acknowledged every record of the transaction.
func TestCommitTxnRefusedCommitAcksNothing(t *testing.T) {
	e := newEOSEnv(t)
	a := &testAcker{}
	e.mustSend(event("r1", "order", "k", "{}"), lsnOf(1), a)
	e.flush()
	e.answerEndTxn(kerr.ProducerFenced.Code, true)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("ck-refused"))
	if !errors.Is(err, ErrFenced) {
		t.Errorf("CommitKafkaTxn with the commit refused: %v; want ErrFenced", err)
	}
	if got := a.acks.Load(); got != 0 {
		t.Errorf("a transaction whose commit was refused was acked %d times", got)
	}
	if !e.r.Failed() {
		t.Error("the router is not Failed after a refused commit: it would be reused")
	}
}
