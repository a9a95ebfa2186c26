package relay

import (
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/walrelay/walrelay/router"
)

// Two transactional producers taking turns (router.Config.TxnProducers
// 2): a commit goes on in the background while the next Kafka
// transaction's records are produced, and the next commit waits for its
// answer, so one commit is in flight at most and a transaction commits
// only after the one before it did.

func TestExactlyOnceOverlapsACommitWithTheNextRecords(t *testing.T) {
	p := &fakeProducer{async: true}
	h := startSessionWith(t, noInterval, p, &resumePoint{}, func(r *Relay, s *session) {
		eo := s.d.(*exactlyOnce)
		eo.committed, eo.unconfirmed = r.commits.committed, r.commits.unconfirmed
	})
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the first commit handed over", func() bool { return p.handed() == 1 })
	h.st.send(txnMsgs(3000, "e2")...)
	waitFor(t, "the next event sent while the first commit is unanswered", func() bool { return len(p.sent()) == 2 })
	// The stream is dry again: the second Kafka transaction is due, but
	// waits for the first one's answer, answering PostgreSQL meanwhile.
	before := len(h.st.updates())
	h.st.send(keepalive(3100, true))
	waitFor(t, "a keepalive answered while the first commit is unanswered", func() bool { return len(h.st.updates()) > before })
	if n := p.handed(); n != 1 || h.st.confirmed() >= 2008 {
		t.Fatalf("%d commits handed over and %s confirmed before the first was answered; want 1, and nothing of it confirmed", n, h.st.confirmed())
	}
	p.answer(nil)
	waitFor(t, "the second commit handed over", func() bool { return p.handed() == 2 })
	p.answer(nil)
	waitFor(t, "both transactions confirmed", func() bool { return h.st.confirmed() >= 3008 })
	waitFor(t, "both commits counted", func() bool { return testutil.ToFloat64(h.r.metrics.KafkaTransactions) == 2 })
	if c := p.checkpoints(); len(c) != 2 || c[0].LSN != 2008 || c[1].LSN != 3008 {
		t.Fatalf("checkpoints %+v, want 2008 then 3008", c)
	}
	p.mu.Lock()
	overlaps := p.overlaps
	p.mu.Unlock()
	if overlaps != 0 {
		t.Fatalf("%d commits asked while another was in flight: one could commit though the one before it did not", overlaps)
	}
	h.cancel()
	if err := h.end(t); err != nil {
		t.Fatal(err)
	}
	mem := h.r.commits
	if mem.unsure || mem.lastSure.ckpt.LSN != 3008 {
		t.Fatalf("commit memory: unsure %v, last sure %s; want sure, 3008", mem.unsure, mem.lastSure.ckpt.LSN)
	}
}

// A commit answered while the stream is quiet is collected without
// waiting for the next event: counted, and remembered as the last sure
// checkpoint.
func TestExactlyOnceCollectsAnAnswerWhileQuiet(t *testing.T) {
	p := &fakeProducer{async: true}
	h := startSession(t, noInterval, p, &resumePoint{})
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the commit handed over", func() bool { return p.handed() == 1 })
	p.answer(nil)
	waitFor(t, "the commit counted with nothing more to read", func() bool { return testutil.ToFloat64(h.r.metrics.KafkaTransactions) == 1 })
	waitFor(t, "the transaction confirmed", func() bool { return h.st.confirmed() == 2008 })
}

// A commit in the background that Kafka did not answer ends the session:
// the next transaction, open on the other producer, is aborted (it may
// not commit after one that did not), nothing of either is confirmed, and
// the commit memory holds what the unanswered commit wrote, to read back
// at the next start.
func TestExactlyOnceUnansweredCommitAbortsTheNext(t *testing.T) {
	p := &fakeProducer{async: true}
	h := startSessionWith(t, func(c *Config) { noInterval(c); c.TxnMaxEvents = 1 }, p, &resumePoint{}, func(r *Relay, s *session) {
		eo := s.d.(*exactlyOnce)
		eo.committed, eo.unconfirmed = r.commits.committed, r.commits.unconfirmed
	})
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the first commit handed over", func() bool { return p.handed() == 1 })
	// A transaction of two events: the first fills the next Kafka
	// transaction (--txn-max-events 1), whose commit waits for the answer.
	h.st.send(txnMsgs(3000, "e2", "e3")...)
	waitFor(t, "the next event sent", func() bool { return len(p.sent()) == 2 })
	p.answer(fmt.Errorf("commit Kafka transaction: %w", unconfirmedCommit{&router.CommitUnconfirmed{}}))
	if err := h.end(t); causeOf(err) != CauseKafka {
		t.Fatalf("session ended with %v (cause %s), want cause kafka", err, causeOf(err))
	}
	if c := h.st.confirmed(); c >= 2008 {
		t.Fatalf("confirmed %s after an unanswered commit, want nothing of it", c)
	}
	p.mu.Lock()
	aborts, commits, calls := p.aborts, len(p.commits), p.calls
	p.mu.Unlock()
	if aborts != 1 || commits != 0 || calls != 1 {
		t.Fatalf("%d aborts, %d commits, %d commits asked; want the next transaction aborted, none committed, only the first asked", aborts, commits, calls)
	}
	if mem := h.r.commits; !mem.unsure || mem.doubt == nil {
		t.Fatalf("commit memory: unsure %v, doubt %v; want the unanswered commit's writes to read back", mem.unsure, mem.doubt)
	}
}

// A clean stop commits the open transaction after the one in flight, and
// waits for both answers.
func TestExactlyOnceStopSettlesTheCommitInFlight(t *testing.T) {
	p := &fakeProducer{async: true, autoAnswer: true}
	h := startSession(t, noInterval, p, &resumePoint{})
	h.st.send(txnMsgs(2000, "e1")...)
	waitFor(t, "the first commit handed over", func() bool { return p.handed() == 1 })
	h.st.send(txnMsgs(3000, "e2")...)
	h.st.send(keepalive(3100, true))
	waitFor(t, "the second event sent", func() bool { return len(p.sent()) == 2 })
	h.cancel()
	if err := h.end(t); err != nil {
		t.Fatalf("stop returned %v", err)
	}
	if c := p.checkpoints(); len(c) != 2 || c[1].LSN != 3008 {
		t.Fatalf("checkpoints %+v, want both transactions committed", c)
	}
	if p.Settling() != nil {
		t.Fatal("the stop left a commit unsettled")
	}
}
