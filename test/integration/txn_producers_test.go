package integration

// Exactly-once with two transactional producers taking turns
// (--txn-producers 2): the relay's id and "<id>-1". The crash points new
// to two producers are the moments between two commits, when one
// producer's commit may still be on its way and the other's transaction is
// open: a relay that takes over then, whether the old one was killed or
// only frozen, and whether it runs with two producers or one, must end
// that open transaction before it reads the checkpoint, and every
// committed id must then be read exactly once, per key in commit order.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// TestTwoProducersCrashBetweenCommits runs paced writers under a relay
// with two producers, freezes it once the second producer's Kafka
// transaction is open (the first's commit just answered or still on its
// way), and takes over:
//   - killed, restarted with two producers;
//   - killed, restarted with one (a downgrade, or the flag lowered);
//   - frozen, a second relay with two producers takes the slot once the
//     frozen one's walsender times out, and the frozen one is thawed.
//
// When the new relay says it resumes after the newest checkpoint, the old
// relay's open transaction on "<id>-1" must be over (fenced or aborted):
// otherwise it would hold read_committed consumers, and the checkpoint
// read, until the broker's 60 s transaction timeout, or commit behind the
// new relay's back. Then every committed id is read exactly once.
func TestTwoProducersCrashBetweenCommits(t *testing.T) {
	for _, c := range []struct {
		name      string
		kill      bool
		producers string
	}{
		{"killed, two producers again", true, "2"},
		{"killed, one producer", true, "1"},
		{"frozen, a second relay", false, "2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			args := e.eosArgs("--txn-min-interval", "500ms")
			a := startProc(t, nil, append(args[:len(args):len(args)], "--txn-producers", "2")...)
			rc := e.consumeIsolated(true)
			pidA := e.waitWalsender(0, 60*time.Second)

			const writers, perWriter = 4, 400
			wr := e.startWriters(writers, 0, perWriter, 20*time.Millisecond)
			rc.waitDistinct(writers*perWriter/4, 2*time.Minute)
			second := "walrelay-" + e.name + "-1"
			open := e.freezeWithTxnOpen(a, second)

			var b *proc
			if c.kill {
				kill9(a)
				b = startProc(t, nil, append(args[:len(args):len(args)], "--txn-producers", c.producers)...)
			} else {
				b = startProc(t, nil, append(args[:len(args):len(args)], "--txn-producers", c.producers)...)
				e.waitWalsender(pidA, 60*time.Second)
			}
			const resumed = "exactly-once: resuming after the newest committed checkpoint"
			e.waitFor("the new relay resuming after the checkpoint", 90*time.Second, func() (bool, error) {
				if exited(b) {
					return false, fmt.Errorf("the new relay exited (%v): %s", b.err, lastLines(b.out.String(), 3))
				}
				return strings.Contains(b.out.String(), resumed), fmt.Errorf("its last lines:\n%s", lastLines(b.out.String(), 3))
			})
			if d := e.describeTxn(second); d.State == "Ongoing" && d.ProducerID == open.ProducerID && d.ProducerEpoch == open.ProducerEpoch {
				t.Fatalf("the new relay resumed while the old relay's transaction on %s (producer %d, epoch %d) is still open", second, d.ProducerID, d.ProducerEpoch)
			}
			if !c.kill {
				if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
					t.Fatal(err)
				}
			}
			wr.wait(t)
			_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
			checkRunning(t, b, "the new relay")
			if !c.kill {
				checkRunning(t, a, "the thawed relay (the standby)")
			}
			t.Logf("took over with %s producer(s) from a relay frozen with %s open (producer %d, epoch %d): %d events read exactly once",
				c.producers, second, open.ProducerID, open.ProducerEpoch, n)
		})
	}
}

// freezeWithTxnOpen SIGSTOPs p once the broker has a transaction of txnID
// open and returns it as described while p is frozen: one seen open may
// commit before the signal lands, so p is thawed and frozen again until it
// stays open.
func (e *env) freezeWithTxnOpen(p *proc, txnID string) kadm.DescribedTransaction {
	e.t.Helper()
	for attempt := 1; ; attempt++ {
		e.waitTxnOngoing(txnID, 30*time.Second)
		if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			e.t.Fatal(err)
		}
		if d := e.describeTxn(txnID); d.State == "Ongoing" {
			return d
		} else if attempt == 10 {
			e.t.Fatalf("10 times the transaction of %s was %s once the relay was frozen, not Ongoing", txnID, d.State)
		}
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
	}
}

// describeTxn is the broker's description of txnID's transaction.
func (e *env) describeTxn(txnID string) kadm.DescribedTransaction {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(e.ctx, 10*time.Second)
	defer cancel()
	ds, err := kadm.NewClient(cl).DescribeTransactions(ctx, txnID)
	if err != nil {
		e.t.Fatalf("describe transaction %s: %v", txnID, err)
	}
	d, ok := ds[txnID]
	if !ok || d.Err != nil {
		e.t.Fatalf("describe transaction %s: %v (described: %v)", txnID, d.Err, ok)
	}
	return d
}

// TestTwoProducersOneIDTaken fences one of a two-producer relay's two
// transactional ids, the other's transaction open or committing:
//   - an outside producer takes "<id>" or "<id>-1" once (a tool, an
//     operator's script), while that id's Kafka transaction is open;
//   - a relay of another slot runs with "<id>-1" as its own id, the
//     collision two producers bring: the ids differ, so only the error can
//     tell the operator why they fence each other.
//
// The relay still holds its slot, so it must not take the id back in a
// loop: it stops with exit code 3 and an error naming the id taken (Apache
// Kafka 4.4 may answer the fence UNKNOWN_SERVER_ERROR, which the relay takes
// for a broker's failure and restarts from: against a one-off producer,
// that takes the id back once and goes on). Whatever the other lane's
// commit did, every committed id is then read exactly once.
func TestTwoProducersOneIDTaken(t *testing.T) {
	for _, lane := range []string{"", "-1"} {
		t.Run("an outside producer takes <id>"+lane, func(t *testing.T) {
			e := newEnv(t)
			args := e.eosArgs("--txn-min-interval", "500ms", "--txn-producers", "2")
			a := startProc(t, nil, args...)
			rc := e.consumeIsolated(true)
			e.waitWalsender(0, 60*time.Second)
			const writers, perWriter = 4, 400
			wr := e.startWriters(writers, 0, perWriter, 20*time.Millisecond)
			rc.waitDistinct(writers*perWriter/4, 2*time.Minute)

			taken := "walrelay-" + e.name + lane
			e.waitTxnOngoing(taken, 30*time.Second)
			e.takeTransactionalID(taken)
			const restartMsg = "relay restarting from the last confirmed position"
			e.waitFor("the relay stopping, or restarting, once fenced", time.Minute, func() (bool, error) {
				out := a.out.String()
				return exited(a) || strings.Contains(out, restartMsg), fmt.Errorf("its last lines:\n%s", lastLines(out, 3))
			})
			out := a.out.String()
			if exited(a) {
				code, _, _ := a.wait(time.Second)
				if code != 3 || !strings.Contains(out, strconv.Quote(taken)) || !strings.Contains(out, "--transactional-id") {
					t.Fatalf("the fenced relay exited %d, want 3 with an error naming %q and --transactional-id: %s", code, taken, lastLines(out, 3))
				}
				if strings.Contains(out, "another relay took the slot") {
					t.Errorf("the relay took itself for one that lost its slot:\n%s", grepLines(out, "fenced", 2))
				}
				a = startProc(t, nil, args...) // the outside producer is gone: the operator's restart
			} else if apache == nil {
				t.Fatalf("on kfake the fenced relay must stop with exit code 3 while it holds its slot; it restarted: %s", grepLines(out, restartMsg, 1))
			}
			wr.wait(t)
			_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
			checkRunning(t, a, "the relay")
			t.Logf("%s taken by an outside producer: %s; %d events read exactly once", taken, lastLines(out, 1), n)
		})
	}
	t.Run("a relay whose id is <id>-1", func(t *testing.T) {
		e := newEnv(t)
		id := "walrelay-pair-" + e.name
		out := e.sharedTransactionalID(id, id+"-1", []string{"--txn-producers", "2"})
		if !strings.Contains(out, "second producer") {
			t.Errorf("the error does not say that %q is the second producer's id of the relay with id %q: %s", id+"-1", id, lastLines(out, 2))
		}
	})
}

// takeTransactionalID registers a producer of its own under txnID, as a
// tool would: the broker aborts the transaction open under it and fences
// its producer.
func (e *env) takeTransactionalID(txnID string) {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.TransactionalID(txnID))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(e.ctx, 30*time.Second)
	defer cancel()
	if _, _, err := cl.ProducerID(ctx); err != nil {
		e.t.Fatalf("take transactional id %s: %v", txnID, err)
	}
}
