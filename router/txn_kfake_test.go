package router

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
)

// TestKafkaTxnCommitAcksAbortDoesNot runs the transactional producer
// against kfake: a record's transaction is acked when its Kafka transaction
// commits, never when Kafka merely has the record, and an aborted Kafka
// transaction acks nothing and stays invisible to read_committed readers.
func TestKafkaTxnCommitAcksAbortDoesNot(t *testing.T) {
	e := newEnv(t, withDefaults(Config{TransactionalID: "walrelay-test"}))
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

// describeAs answers the router's DescribeTransactions (settle's questions)
// with state or errCode for every transactional id asked about, until
// answer returns false; asks counts the questions.
func describeAs(e *env, asks *atomic.Int64, answer func(n int64) (state string, errCode int16, ok bool)) {
	e.c.ControlKey(int16(kmsg.DescribeTransactions), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.c.KeepControl()
		n := asks.Add(1)
		state, code, ok := answer(n)
		if !ok {
			return nil, nil, false // kfake answers
		}
		dreq := req.(*kmsg.DescribeTransactionsRequest)
		resp := dreq.ResponseKind().(*kmsg.DescribeTransactionsResponse)
		for _, id := range dreq.TransactionalIDs {
			st := kmsg.NewDescribeTransactionsResponseTransactionState()
			st.TransactionalID, st.State, st.ErrorCode = id, state, code
			resp.TransactionStates = append(resp.TransactionStates, st)
		}
		return resp, nil, true
	})
}

// After a commit the coordinator still writes the transaction's markers
// (PrepareCommit): the next transaction's first record waits until it is
// done, then is taken, and both transactions are read.
func TestTxnNextWaitsForCommitMarkers(t *testing.T) {
	e := newEOSEnv(t)
	e.r.txn.settleMax = patience // only the coordinator's answer ends the wait
	var asks atomic.Int64
	var complete atomic.Bool
	askedTwice := make(chan struct{})
	describeAs(e, &asks, func(n int64) (string, int16, bool) {
		if complete.Load() {
			return "", 0, false
		}
		if n == 2 {
			close(askedTwice)
		}
		return "PrepareCommit", 0, true
	})
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()

	e.mustSend(event("t1", "order", "k1", `{}`), 1, &testAcker{})
	if err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("checkpoint 1")); err != nil {
		t.Fatal(err)
	}
	second := event("t2", "order", "k1", `{}`)
	wait, err := e.r.Send(second, 2, &testAcker{})
	if err != nil || wait == nil {
		t.Fatalf("Send of the next transaction's first record while the coordinator completes the last commit: channel %v, error %v; want a channel to wait on", wait, err)
	}
	select {
	case <-askedTwice:
	case <-ctx.Done():
		t.Fatal("the coordinator was not asked again while it said PrepareCommit")
	}
	select {
	case <-wait:
		t.Fatal("the wait ended while the coordinator still said PrepareCommit")
	default:
	}
	if e.r.Txn().Open() {
		t.Fatal("a Kafka transaction is open: the record was taken while told to wait")
	}

	complete.Store(true) // kfake answers from now on: the commit is complete
	select {
	case <-wait:
	case <-ctx.Done():
		t.Fatal("the wait did not end once the coordinator completed the commit")
	}
	e.mustSend(second, 2, &testAcker{})
	// The wait is measured: at least from the first refused Send to the
	// coordinator's second answer.
	if n, sum := histogramValue(t, e.m.KafkaMarkerWait); n != 1 || sum <= 0 {
		t.Fatalf("walrelay_kafka_marker_wait_seconds: %d observations summing to %gs, want one above 0", n, sum)
	}
	if err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("checkpoint 2")); err != nil {
		t.Fatal(err)
	}
	if got := e.endOffsets(eosTopic)[eosTopic]; got < 2 {
		t.Fatalf("%s holds %d records, want both transactions' (and their markers)", eosTopic, got)
	}
}

// A coordinator that refuses the question (no DESCRIBE on the
// transactional id) is not asked again and nothing waits for it; one that
// fails in passing (loading its log), or a failure to authenticate to
// Kafka (a token that expired while its endpoint was down, a refused
// re-authentication), which says nothing of DESCRIBE, is asked again
// after the next commit.
func TestTxnSettleRefusedOrPassing(t *testing.T) {
	for _, tc := range []struct {
		name      string
		code      int16
		asksAgain bool
	}{
		{"refused", kerr.TransactionalIDAuthorizationFailed.Code, false},
		{"passing", kerr.CoordinatorLoadInProgress.Code, true},
		{"authentication failed", kerr.SaslAuthenticationFailed.Code, true},
		{"illegal SASL state", kerr.IllegalSaslState.Code, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEOSEnv(t)
			var asks atomic.Int64
			describeAs(e, &asks, func(int64) (string, int16, bool) { return "", tc.code, true })
			ctx, cancel := context.WithTimeout(context.Background(), patience)
			defer cancel()
			var after [2]int64 // questions once each commit's wait is over
			for i := range 2 {
				id := fmt.Sprintf("r%d", i)
				e.mustSend(event(id, "order", "k1", `{}`), decoder.LSN(i+1), &testAcker{})
				if err := e.r.Txn().Commit(ctx, []byte("slot"), []byte("checkpoint "+id)); err != nil {
					t.Fatal(err)
				}
				// The next record is taken once the wait is over.
				e.mustSend(event(id+"-next", "order", "k1", `{}`), decoder.LSN(i+1), &testAcker{})
				after[i] = asks.Load()
			}
			if after[0] == 0 {
				t.Fatal("the coordinator was not asked after the first commit")
			}
			if again := after[1] > after[0]; again != tc.asksAgain {
				t.Fatalf("asked again after the second commit: %v (%d, then %d questions), want %v", again, after[0], after[1], tc.asksAgain)
			}
		})
	}
}

// TestKafkaTxnTwoLanesTakeTurns: with two transactional producers, a
// commit goes on in the background and the next records go to the other
// producer ("<id>-1") meanwhile; a record is acked only once its own
// transaction's commit was answered; read_committed readers see the
// records in the order sent, and the checkpoint read back is the newest,
// whichever producer committed it.
func TestKafkaTxnTwoLanesTakeTurns(t *testing.T) {
	e := newEnv(t, withDefaults(Config{TransactionalID: "walrelay-test", TxnProducers: 2}))
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	txn := e.r.Txn()
	if err := txn.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if txn.Lanes() != 2 {
		t.Fatalf("%d lanes, want 2", txn.Lanes())
	}
	var ackers []*testAcker
	for i := range 6 {
		a := &testAcker{}
		ackers = append(ackers, a)
		e.mustSend(event(fmt.Sprint("e", i), "order", "k1", `{}`), decoder.LSN(i+1), a)
		if txn.Settling() != nil {
			if err := txn.Settle(); err != nil {
				t.Fatal(err)
			}
		}
		if err := txn.Commit(ctx, []byte("slot"), []byte(fmt.Sprint("checkpoint ", i))); err != nil {
			t.Fatal(err)
		}
		if txn.Settling() == nil {
			t.Fatalf("commit %d: not handed to the background", i)
		}
		if i > 0 && ackers[i-1].acks.Load() != 1 {
			t.Fatalf("commit %d handed over before the last one's records were acked", i)
		}
	}
	if err := txn.Settle(); err != nil {
		t.Fatal(err)
	}
	for i, a := range ackers {
		if n := a.acks.Load(); n != 1 {
			t.Fatalf("record %d acked %d times, want once", i, n)
		}
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.seeds...), kgo.ConsumeTopics("outbox.event.order"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var ids []string
	for len(ids) < 6 {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %v: %v", ids, ctx.Err())
		}
		fs.EachRecord(func(r *kgo.Record) { ids = append(ids, string(r.Headers[0].Value)) })
	}
	if got := fmt.Sprint(ids); got != "[e0 e1 e2 e3 e4 e5]" {
		t.Fatalf("read_committed saw %s, want the order sent", got)
	}
	value, found, err := txn.ReadCheckpoint(ctx, []byte("slot"))
	if err != nil || !found || string(value) != "checkpoint 5" {
		t.Fatalf("checkpoint read back %q (found %v, %v), want the newest, checkpoint 5", value, found, err)
	}
}

// TestKafkaTxnOneProducerSweepsTheSecond leaves a Kafka transaction open on
// the second producer, "<id>-1", as a relay with two producers killed
// between two commits does, and starts a router with one producer (a
// downgrade, or --txn-producers lowered): its Init must abort that
// transaction, which nothing else takes before the broker's transaction
// timeout, so that read_committed readers do not stall behind it.
func TestKafkaTxnOneProducerSweepsTheSecond(t *testing.T) {
	e := newEnv(t, withDefaults(Config{TransactionalID: "walrelay-test", TxnProducers: 2}))
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	txn := e.r.Txn()
	if err := txn.Init(ctx); err != nil {
		t.Fatal(err)
	}
	e.mustSend(event("e0", "order", "k1", `{}`), 1, &testAcker{})
	if err := txn.Commit(ctx, []byte("slot"), []byte("checkpoint 0")); err != nil {
		t.Fatal(err)
	}
	if err := txn.Settle(); err != nil {
		t.Fatal(err)
	}
	e.mustSend(event("e1", "order", "k1", `{}`), 2, &testAcker{})
	e.flush()
	adm := kadm.NewClient(e.helper())
	state := func(id string) string {
		d, err := adm.DescribeTransactions(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return d[id].State
	}
	if st := state("walrelay-test-1"); st != "Ongoing" {
		t.Fatalf("the second producer's transaction is %q, want Ongoing: the scenario did not happen", st)
	}

	one, err := New(withDefaults(Config{TransactionalID: "walrelay-test", CreateTopics: true}), e.routerOpts(),
		zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), metrics.NewUnregistered(), func(error) {})
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	if err := one.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := one.Txn().Init(ctx); err != nil {
		t.Fatal(err)
	}
	if st := state("walrelay-test-1"); st == "Ongoing" {
		t.Fatal("a router with one producer left the second producer's transaction open")
	}
	value, found, err := one.Txn().ReadCheckpoint(ctx, []byte("slot"))
	if err != nil || !found || string(value) != "checkpoint 0" {
		t.Fatalf("checkpoint read back %q (found %v, %v), want checkpoint 0", value, found, err)
	}
}
