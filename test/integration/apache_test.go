package integration

// What only a real broker shows: these tests run on Apache Kafka
// (WALRELAY_TEST_KAFKA=apache, `make test-kafka`) and skip on kfake or an
// external broker. They use the package's broker (one node with SCRAM and
// TLS listeners besides PLAINTEXT) or clusters of their own when they need
// other broker settings, a broker restart or three nodes.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/test/kafkacluster"
)

// apacheOptions configures the package's Apache Kafka node: SCRAM, TLS and
// OAUTHBEARER listeners for the tests of authentication; a transaction timeout
// enforced within half a second and a log cleaner that looks every half
// second, so that the tests of both need not wait for the defaults (10s
// and 15s).
func apacheOptions() kafkacluster.Options {
	iss := testIssuer()
	return kafkacluster.Options{
		SCRAM: true,
		TLS:   &kafkacluster.TLS{},
		// An OAUTHBEARER listener trusting the test's issuer; sessions
		// end at their token's expiry, so a client that does not
		// re-authenticate with a new token loses its connections.
		OAuth: &kafkacluster.OAuth{JWKSURL: iss.jwksURL(), Issuer: iss.url(), Audience: oidcAudience, MaxReauth: time.Hour},
		Settings: map[string]string{
			"transaction.abort.timed.out.transaction.cleanup.interval.ms": "500",
			"log.cleaner.backoff.ms": "500",
		},
	}
}

// startApache starts an Apache Kafka cluster of the test's own; it is
// killed when the test ends, its log kept (and its path logged) when the
// test failed.
func startApache(t *testing.T, opts kafkacluster.Options) *kafkacluster.Cluster {
	t.Helper()
	needApache(t)
	start := time.Now()
	c, err := kafkacluster.Start(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d-node Apache Kafka cluster answering after %s", len(c.Nodes()), time.Since(start).Round(time.Millisecond))
	t.Cleanup(func() {
		if t.Failed() {
			opts.KeepDir = true
			t.Logf("Apache Kafka's logs kept in %s", c.Dir)
			for _, n := range c.Nodes() {
				c.Kill(n.ID)
			}
			return
		}
		c.Close()
	})
	return c
}

// createTopic creates topic on brokers with configs, failing the test on
// error.
func (e *env) createTopic(partitions int32, rf int16, configs map[string]string, topic string) {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	cfg := map[string]*string{}
	for k, v := range configs {
		cfg[k] = &v
	}
	ctx, cancel := context.WithTimeout(e.ctx, 30*time.Second)
	defer cancel()
	if _, err := kadm.NewClient(cl).CreateTopic(ctx, partitions, rf, cfg, topic); err != nil {
		e.t.Fatalf("create topic %s: %v", topic, err)
	}
}

// TestApacheMaxMessageBytes gives a topic max.message.bytes 4096 (below
// the broker's default of about 1 MB): the relay reads the limit, sends an
// event of 20 KB to the dead-letter topic with reason record_too_large
// (the broker would refuse it with MESSAGE_TOO_LARGE), and delivers the
// small events before and after it to the topic.
func TestApacheMaxMessageBytes(t *testing.T) {
	needApache(t)
	e := newEnv(t)
	e.createTopic(3, 1, map[string]string{"max.message.bytes": "4096"}, e.topic("small"))
	rr, reg := e.startRelayGathered(e.config())
	c := e.consume()
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('small', 'k', 'T', '{"n": 1}')`)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('small', 'k', 'T', jsonb_build_object('n', 2, 'pad', repeat('x', 20000)))`)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('small', 'k', 'T', '{"n": 3}')`)
	recs := c.waitIDs(3, 60*time.Second)
	var inTopic, inDLQ []string
	for _, r := range recs {
		switch r.Topic {
		case e.topic("small"):
			inTopic = append(inTopic, string(r.Value))
		case e.topic("dlq"):
			reason, _ := header(r, deadletter.HeaderReason)
			inDLQ = append(inDLQ, reason)
		}
	}
	if len(inTopic) != 2 || inTopic[0] != `{"n": 1}` || inTopic[1] != `{"n": 3}` {
		t.Errorf("topic holds %q, want the two small events in order", inTopic)
	}
	if len(inDLQ) != 1 || inDLQ[0] != string(deadletter.ReasonTooLarge) {
		t.Errorf("dead-letter topic holds reasons %q, want one %s", inDLQ, deadletter.ReasonTooLarge)
	}
	if got := gathered(reg, "walrelay_events_dead_lettered_total")[string(deadletter.ReasonTooLarge)]; got != 1 {
		t.Errorf("walrelay_events_dead_lettered_total{reason=record_too_large} = %v, want 1", got)
	}
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay stopped: %v", err)
	}
}

// TestApacheSASLSCRAM runs the relay binary against the broker's
// SASL_PLAINTEXT listener with a SCRAM-SHA-512 user created through the
// broker's admin API (AlterUserScramCredentials): with the right password
// it delivers; with a wrong one the broker answers
// SASL_AUTHENTICATION_FAILED and the relay exits non-zero within 10s
// (--startup-timeout 60s) naming SASL authentication. No password appears
// in its output.
func TestApacheSASLSCRAM(t *testing.T) {
	needApache(t)
	const user, pass, wrong = "relay-scram", "s3cret-Pa55-apache", "wr0ng-Pa55-apache"
	if err := apache.AddSCRAMUser(context.Background(), kadm.ScramSha512, user, pass); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t)
	e.brokers = apache.SASLAddrs()
	saslArgs := []string{"--kafka-sasl-mechanism", "scram-sha-512", "--kafka-sasl-user", user}

	t.Run("right password", func(t *testing.T) {
		p := startProc(t, []string{"WALRELAY_KAFKA_SASL_PASSWORD=" + pass}, withFlag(append(e.args(), saslArgs...), "--log-level", "debug")...)
		c := e.consumeWith(kgo.SASL(scram.Auth{User: user, Pass: pass}.AsSha512Mechanism()))
		e.waitSlotActive(p)
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('s', 'k', 'T', '{"sasl": true}')`)
		recs := c.waitIDs(1, 60*time.Second)
		if recs[0].Topic != e.topic("s") {
			t.Errorf("read from %s, want %s", recs[0].Topic, e.topic("s"))
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		if code, _, ok := p.wait(60 * time.Second); !ok || code != 0 {
			t.Errorf("SIGTERM: exit %d (exited %v), want 0", code, ok)
		}
		if strings.Contains(p.out.String(), pass) {
			t.Error("the password appears in the relay's output")
		}
	})
	t.Run("wrong password", func(t *testing.T) {
		p := startProc(t, []string{"WALRELAY_KAFKA_SASL_PASSWORD=" + wrong}, withFlag(append(e.args(), saslArgs...), "--startup-timeout", "60s")...)
		code, elapsed, ok := p.wait(10 * time.Second)
		out := p.out.String()
		if !ok || code == 0 {
			t.Fatalf("with a wrong password: exit %d after %s (exited by itself: %v), want a non-zero exit within 10s:\n%s", code, elapsed, ok, lastLines(out, 5))
		}
		if !strings.Contains(strings.ToLower(lastLines(out, 1)), "sasl") {
			t.Errorf("the error does not name SASL authentication: %s", lastLines(out, 1))
		}
		if strings.Contains(out, wrong) {
			t.Error("the password appears in the relay's output")
		}
		t.Logf("wrong password: exit %d after %s: %s", code, elapsed.Round(time.Millisecond), lastLines(out, 1))
	})
}

// TestApacheTLS runs the relay binary against the broker's SSL listener
// (a certificate from a throwaway CA): with --kafka-tls-ca naming the CA
// it delivers; with --kafka-tls alone (the system roots do not know the
// CA) it exits non-zero within 10s with a certificate error.
func TestApacheTLS(t *testing.T) {
	needApache(t)
	e := newEnv(t)
	e.brokers = apache.TLSAddrs()
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caFile, apache.CA, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Run("server verified with --kafka-tls-ca", func(t *testing.T) {
		p := startProc(t, nil, append(e.args(), "--kafka-tls-ca", caFile)...)
		e.brokers = apache.Addrs() // the test's consumer reads over PLAINTEXT
		c := e.consume()
		e.brokers = apache.TLSAddrs()
		e.waitSlotActive(p)
		e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('tls', 'k', 'T', '{"tls": true}')`)
		c.waitIDs(1, 60*time.Second)
	})
	t.Run("unknown CA", func(t *testing.T) {
		p := startProc(t, nil, withFlag(append(e.args(), "--kafka-tls"), "--startup-timeout", "60s")...)
		code, elapsed, ok := p.wait(10 * time.Second)
		out := p.out.String()
		if !ok || code == 0 {
			t.Fatalf("with an unknown CA: exit %d after %s (exited by itself: %v), want a non-zero exit within 10s:\n%s", code, elapsed, ok, lastLines(out, 5))
		}
		if !strings.Contains(lastLines(out, 1), "certificate") {
			t.Errorf("the error does not name the certificate: %s", lastLines(out, 1))
		}
	})
}

// TestApacheNoCreateTopics runs the relay binary with --no-create-topics
// on a broker with auto.create.topics.enable=false: an event for a topic
// that does not exist makes the relay warn, naming the topic and the fix
// (create it or allow --create-topics), and restart from the last
// confirmed position, again and again: the slot is not confirmed past the
// event. Once an administrator creates the topic, it and the events after
// it arrive, from the same relay process.
func TestApacheNoCreateTopics(t *testing.T) {
	k := startApache(t, kafkacluster.Options{Settings: map[string]string{"auto.create.topics.enable": "false"}})
	e := newEnv(t)
	e.brokers = k.Addrs()
	e.createTopic(3, 1, nil, e.topic("present"))
	e.createTopic(1, 1, nil, e.topic("dlq"))
	p := startProc(t, nil, append(e.args(), "--no-create-topics")...)
	c := e.consume()
	e.waitSlotActive(p)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('present', 'k', 'T', '{"n": 1}')`)
	c.waitIDs(1, 60*time.Second)
	conn := e.conn()
	before := e.currentLSN(conn)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('missing', 'k', 'T', '{"n": 2}')`)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('present', 'k', 'T', '{"n": 3}')`)
	missing := e.topic("missing")
	// The event for the present topic may be delivered (Kafka orders
	// nothing across topics); the slot must not be confirmed past the
	// stuck one.
	var complaint string
	e.waitFor("a warning or error naming the missing topic", 60*time.Second, func() (bool, error) {
		for _, l := range strings.Split(p.out.String(), "\n") {
			if strings.Contains(l, missing) && !strings.Contains(l, `"level":"info"`) && !strings.Contains(l, `"level":"debug"`) {
				complaint = l
				return true, nil
			}
		}
		return false, fmt.Errorf("output so far ends: %s", lastLines(p.out.String(), 2))
	})
	t.Logf("the relay says: %s", complaint)
	if !strings.Contains(complaint, "--create-topics") {
		t.Errorf("the complaint does not name the fix (create the topic or allow --create-topics): %s", complaint)
	}
	if got := e.slotInfo().ConfirmedLSN; got > before {
		t.Errorf("slot confirmed to %s, past the event for the missing topic (written after %s)", got, before)
	}
	e.createTopic(3, 1, nil, missing)
	recs := c.waitIDs(3, 2*time.Minute)
	checkRunning(t, p, "the relay")
	t.Logf("after the topic was created: %d records read", len(recs))
}

// TestApacheTxnTimeoutAboveBrokerMax starts the relay binary with
// exactly-once delivery and the default --txn-timeout 60s on a broker
// whose transaction.max.timeout.ms is 10s: the broker refuses the
// transactional producer (INVALID_TRANSACTION_TIMEOUT) and the relay
// exits non-zero within 30s with an error naming --txn-timeout.
func TestApacheTxnTimeoutAboveBrokerMax(t *testing.T) {
	k := startApache(t, kafkacluster.Options{Settings: map[string]string{"transaction.max.timeout.ms": "10000"}})
	e := newEnv(t)
	e.brokers = k.Addrs()
	p := startProc(t, nil, withFlag(e.eosArgs(), "--startup-timeout", "60s")...)
	code, elapsed, ok := p.wait(30 * time.Second)
	out := p.out.String()
	if !ok || code == 0 {
		t.Fatalf("exit %d after %s (exited by itself: %v), want a non-zero exit within 30s:\n%s", code, elapsed, ok, lastLines(out, 5))
	}
	if !strings.Contains(lastLines(out, 1), "--txn-timeout") {
		t.Errorf("the error does not name --txn-timeout: %s", lastLines(out, 1))
	}
	t.Logf("exit %d after %s: %s", code, elapsed.Round(time.Millisecond), lastLines(out, 1))
}

// TestApacheCheckpointCompaction runs exactly-once delivery with one event
// per Kafka transaction (--txn-max-events 1) for 2,000 events: 2,000
// checkpoint records and more. The checkpoint topic the relay created is
// compacted (cleanup.policy=compact); the test then shortens its segments
// (segment.ms 200, min.cleanable.dirty.ratio 0.01: what an hour of
// segment.ms does in production) and waits for the broker's log cleaner:
// a read_committed reader of the topic from the start, as a restarting
// relay reads it, then finds a handful of records, and a relay restarted
// on the compacted topic resumes exactly once.
func TestApacheCheckpointCompaction(t *testing.T) {
	needApache(t)
	e := newEnv(t)
	args := e.eosArgs("--txn-max-events", "1", "--txn-max-interval", "10ms")
	p := startProc(t, nil, args...)
	rc := e.consumeIsolated(true)
	e.waitSlotStreamed(60 * time.Second)
	adm, err := apache.Admin()
	if err != nil {
		t.Fatal(err)
	}
	defer adm.Close()
	rcs, err := adm.DescribeTopicConfigs(e.ctx, e.checkpointTopic())
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := rcs.On(e.checkpointTopic(), nil); !hasConfig(v, "cleanup.policy", "compact") {
		t.Fatalf("the checkpoint topic is not compacted: %+v", v.Configs)
	}
	if _, err := adm.AlterTopicConfigs(e.ctx, []kadm.AlterConfig{
		{Name: "segment.ms", Value: ptr("200")},
		{Name: "min.cleanable.dirty.ratio", Value: ptr("0.01")},
	}, e.checkpointTopic()); err != nil {
		t.Fatal(err)
	}
	const writers, perWriter = 4, 500
	e.startWriters(writers, 0, perWriter, 5*time.Millisecond).wait(t)
	e.deliveredExactlyOnce(rc, 3*time.Minute)
	written := len(rc.checkpoints())
	if written < writers*perWriter {
		t.Fatalf("%d checkpoint records read, want at least one per event (%d)", written, writers*perWriter)
	}
	kill9(p)
	// The cleaner leaves the newest record of each key (the slot's
	// checkpoint and its probe) and the active segment, the last 200ms.
	var left int
	e.waitFor("the checkpoint topic compacted", 2*time.Minute, func() (bool, error) {
		left = e.countCommitted(e.checkpointTopic())
		return left*20 <= written, fmt.Errorf("%d of %d checkpoint records left", left, written)
	})
	p = startProc(t, nil, args...)
	e.startWriters(writers, perWriter, 50, 5*time.Millisecond).wait(t)
	_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, p, "the restarted relay")
	t.Logf("%d checkpoint records written, %d left after compaction; %d events read exactly once across the restart", written, left, n)
}

func hasConfig(rc kadm.ResourceConfig, key, value string) bool {
	for _, c := range rc.Configs {
		if c.Key == key && c.Value != nil && *c.Value == value {
			return true
		}
	}
	return false
}

func ptr[T any](v T) *T { return &v }

// countCommitted reads topic from the start read_committed, as a relay
// reading its checkpoint does, and returns how many records it holds: all
// it reads until two polls of a second each bring nothing.
func (e *env) countCommitted(topic string) int {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	n, empty := 0, 0
	for empty < 2 {
		ctx, cancel := context.WithTimeout(e.ctx, time.Second)
		fs := cl.PollFetches(ctx)
		cancel()
		got := fs.NumRecords()
		n += got
		if got == 0 {
			empty++
		} else {
			empty = 0
		}
	}
	return n
}

// TestApacheTransactionTimedOut freezes the relay binary (SIGSTOP) while
// its Kafka transaction is open, with --txn-timeout 2s: the broker aborts
// the transaction (it looks every 500ms here) and bumps the producer's
// epoch. Thawed (SIGCONT) once the broker no longer reports the
// transaction Ongoing, the relay must take that for a timed-out
// transaction, not for fencing by another relay: it keeps running, and
// every committed id is read exactly once read_committed, while
// read_uncommitted reads the aborted copies too.
func TestApacheTransactionTimedOut(t *testing.T) {
	needApache(t)
	e := newEnv(t)
	p := startProc(t, nil, e.eosArgs("--txn-timeout", "2s", "--txn-max-interval", "1s")...)
	rc := e.consumeIsolated(true)
	ru := e.consumeIsolated(false)
	e.waitSlotStreamed(60 * time.Second)
	const writers, perWriter = 4, 1500
	wr := e.startWriters(writers, 0, perWriter, 20*time.Millisecond)
	rc.waitDistinct(writers*perWriter/10, time.Minute)
	txnID := "walrelay-" + e.name
	// Freeze the relay with its transaction open: a transaction seen
	// Ongoing may commit before the signal lands, so check again once the
	// relay is stopped, and thaw and retry if it did.
	var frozen time.Time
	for attempt := 1; ; attempt++ {
		e.waitTxnOngoing(txnID, 30*time.Second)
		if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		frozen = time.Now()
		if st := e.txnState(txnID); st == "Ongoing" {
			break
		} else if attempt == 10 {
			t.Fatalf("10 times the relay's transaction was %s once the relay was frozen, not Ongoing", st)
		}
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
	}
	var state string
	e.waitFor("the broker aborting the frozen relay's transaction", 30*time.Second, func() (bool, error) {
		state = e.txnState(txnID)
		return state != "Ongoing", fmt.Errorf("transaction %s", state)
	})
	if state != "PrepareAbort" && state != "CompleteAbort" {
		t.Errorf("the frozen relay's transaction ended %s, want aborted by the broker", state)
	}
	abortedAfter := time.Since(frozen)
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	wr.wait(t)
	_, n := e.deliveredExactlyOnce(rc, 2*time.Minute)
	checkRunning(t, p, "the thawed relay")
	ruIDs, ruExtra := ru.duplicates()
	if ruIDs == 0 {
		t.Errorf("read_uncommitted read no id twice: the timed-out transaction's aborted copies are missing")
	}
	t.Logf("the broker ended the frozen relay's transaction after %s (state %s); the relay said: %s; %d events read exactly once; read_uncommitted: %d ids twice or more (%d aborted copies)",
		abortedAfter.Round(time.Millisecond), state, grepLines(p.out.String(), "relay restarting", 1), n, ruIDs, ruExtra)
}

// TestApacheBrokerRestartTxnOpen kills the broker (SIGKILL: a node of its
// own) while the in-process relay's Kafka transaction is open
// (DescribeTransactions: Ongoing) and 8 writers run, and restarts it on
// the same data: the relay rides the outage out without Run returning,
// and every committed id is read exactly once read_committed, per key in
// commit order.
func TestApacheBrokerRestartTxnOpen(t *testing.T) {
	k := startApache(t, kafkacluster.Options{})
	e := newEnv(t)
	e.brokers = k.Addrs()
	cfg := e.config()
	cfg.ExactlyOnce = true
	cfg.Router.CheckpointTopic = e.checkpointTopic()
	cfg.TxnMaxInterval = 300 * time.Millisecond
	rr, reg := e.startRelayGathered(cfg)
	rc := e.consumeIsolated(true)
	ru := e.consumeIsolated(false)
	const writers, perWriter = 8, 600
	wr := e.startWriters(writers, 0, perWriter, 60*time.Millisecond)
	rc.waitDistinct(writers*perWriter/4, 2*time.Minute)
	state := e.waitTxnOngoing("walrelay-"+e.name, 30*time.Second)
	k.Kill(1)
	rowsAtKill := wr.rows.Load()
	killed := time.Now()
	if err := k.Restart(e.ctx, 1); err != nil {
		t.Fatal(err)
	}
	down := time.Since(killed)
	rowsDuring := wr.rows.Load() - rowsAtKill
	wr.wait(t)
	if rowsDuring == 0 {
		t.Fatal("no rows were committed while the broker was down: the writers did not span the outage")
	}
	_, n := e.deliveredExactlyOnce(rc, 3*time.Minute)
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay Run returned: %v", err)
	}
	ruIDs, ruExtra := ru.duplicates()
	t.Logf("broker killed with the relay's transaction %s, back after %s, %d rows committed meanwhile; %d events read exactly once; "+
		"read_uncommitted saw %d ids twice or more (%d extra copies); kafka transactions %v, stream restarts %v",
		state, down.Round(time.Millisecond), rowsDuring, n, ruIDs, ruExtra,
		gathered(reg, "walrelay_kafka_transactions_total"), gathered(reg, "walrelay_stream_restarts_total"))
}

// TestApacheThreeNodeKills runs the relay binary on a three-node cluster
// (replication factor 3, min.insync.replicas 2) while 4 writers commit
// 4 × 1000 events per kill, in both delivery modes, and kills nodes with
// SIGKILL one at a time (WALRELAY_TEST_APACHE_KILLS, default 4 per mode):
// in turn the leader of a partition of the event topic and (exactly-once)
// the node of the relay's transaction coordinator. Each killed node is
// restarted, and the next kill waits until every partition is fully in
// sync again, so that two replicas always hold each acknowledged record.
// At-least-once: every committed id is read, per key in commit order.
// Exactly-once, with one transactional producer and with two taking turns
// (--txn-producers 2): read_committed reads every committed id exactly
// once. The relay keeps running throughout. Reported: events, kills, lost,
// duplicates and the longest time no new id arrived while writers ran.
func TestApacheThreeNodeKills(t *testing.T) {
	needApache(t)
	if testing.Short() {
		t.Skip("a three-node cluster under kills")
	}
	kills := 4
	if s, err := strconv.Atoi(os.Getenv("WALRELAY_TEST_APACHE_KILLS")); err == nil && s >= 0 {
		kills = s
	}
	k := startApache(t, kafkacluster.Options{Nodes: 3, HeapMB: 384, Settings: map[string]string{"min.insync.replicas": "2"}})
	adm, err := k.Admin()
	if err != nil {
		t.Fatal(err)
	}
	defer adm.Close()
	for _, mode := range []string{"at-least-once", "exactly-once", "exactly-once, two producers"} {
		t.Run(mode, func(t *testing.T) {
			e := newEnv(t)
			e.brokers = k.Addrs()
			eos := strings.HasPrefix(mode, "exactly-once")
			args := append(e.args(), "--topic-replication-factor", "3")
			two := strings.HasSuffix(mode, "two producers")
			if two {
				// A coordinator killed while one producer commits and
				// the other's transaction is open.
				args = append(args, "--txn-producers", "2")
			}
			var distinct func() int
			var rc *eosConsumer
			var c *consumer
			if eos {
				args = append(args, "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic())
				rc = e.consumeIsolated(true)
				distinct = rc.distinct
			} else {
				c = e.consume()
				distinct = func() int { return len(distinctIDs(c.records())) }
			}
			p := startProc(t, nil, args...)
			e.waitSlotStreamed(60 * time.Second)

			// About 15s of writing per kill: a kill, the session timeout,
			// the restart and the wait for every replica to be in sync.
			const writers = 4
			perWriter := 1000 * max(kills, 1)
			start := time.Now()
			wr := e.startWriters(writers, 0, perWriter, 30*time.Millisecond)
			stall := watchStall(wr.done, distinct)
			topics := []string{e.topic("w")}
			if eos {
				topics = append(topics, e.checkpointTopic(), "__transaction_state")
			}
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 13))
			var killLog []string
			for i := 0; i < kills; i++ {
				if wrDone(wr) {
					break
				}
				e.waitInSync(adm, 3, topics...)
				victim, why := e.leaderOf(adm, e.topic("w"), int32(i%3)), "leader of partition "+strconv.Itoa(i%3)
				if eos && i%2 == 0 {
					id := "walrelay-" + e.name
					if two && i%4 == 2 {
						id += "-1" // the second producer's coordinator
					}
					victim, why = e.txnCoordinator(adm, id), "transaction coordinator of "+id
				}
				// Pace the kills through the run: a moment of load first.
				time.Sleep(time.Duration(500+rng.IntN(1500)) * time.Millisecond)
				k.Kill(victim)
				if err := k.Restart(e.ctx, victim); err != nil {
					t.Fatal(err)
				}
				killLog = append(killLog, fmt.Sprintf("node %d (%s) at %d rows", victim, why, wr.rows.Load()))
				if exited(p) {
					t.Fatalf("the relay exited after kill %d (%v):\n%s", i+1, p.err, lastLines(p.out.String(), 3))
				}
			}
			wr.wait(t)
			writeTime := time.Since(start)
			var lost, dups, n int
			if eos {
				_, n = e.deliveredExactlyOnce(rc, 3*time.Minute)
			} else {
				conn := e.conn()
				want, total := committedRows(t, e, conn)
				n = total
				recs := waitAllIDs(c, want, 3*time.Minute)
				dups = checkDelivered(t, recs, want, nil)
				lost = total - len(distinctIDs(recs))
			}
			checkRunning(t, p, "the relay")
			t.Logf("%s: %d events written in %s; %d kills: %s; lost %d, duplicates %d; longest stall while writing %s",
				mode, n, writeTime.Round(time.Second), len(killLog), strings.Join(killLog, ", "), lost, dups, stall().Round(time.Millisecond))
		})
	}
}

// wrDone reports whether every writer returned.
func wrDone(wr *writerGroup) bool {
	select {
	case <-wr.done:
		return true
	default:
		return false
	}
}

// watchStall samples count every 20ms until done closes; the returned
// function gives the longest time count did not grow meanwhile.
func watchStall(done <-chan struct{}, count func() int) func() time.Duration {
	var mu sync.Mutex
	var longest time.Duration
	go func() {
		last, since := count(), time.Now()
		for {
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
			}
			if n := count(); n != last {
				last, since = n, time.Now()
				continue
			}
			mu.Lock()
			longest = max(longest, time.Since(since))
			mu.Unlock()
		}
	}()
	return func() time.Duration {
		mu.Lock()
		defer mu.Unlock()
		return longest
	}
}

// waitInSync waits until every partition of topics has a leader and rf
// in-sync replicas.
func (e *env) waitInSync(adm *kadm.Client, rf int, topics ...string) {
	e.t.Helper()
	e.waitFor("every partition in sync", 2*time.Minute, func() (bool, error) {
		ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
		defer cancel()
		tds, err := adm.ListTopics(ctx, topics...)
		if err != nil {
			return false, err
		}
		for _, td := range tds {
			if td.Err != nil {
				return false, fmt.Errorf("%s: %w", td.Topic, td.Err)
			}
			for _, pd := range td.Partitions {
				if pd.Leader < 0 || len(pd.ISR) < rf {
					return false, fmt.Errorf("%s/%d: leader %d, in sync %v", td.Topic, pd.Partition, pd.Leader, pd.ISR)
				}
			}
		}
		return true, nil
	})
}

// leaderOf is the node leading topic's partition.
func (e *env) leaderOf(adm *kadm.Client, topic string, partition int32) int {
	e.t.Helper()
	tds, err := adm.ListTopics(e.ctx, topic)
	if err != nil {
		e.t.Fatal(err)
	}
	pd, ok := tds[topic].Partitions[partition]
	if !ok || pd.Leader < 0 {
		e.t.Fatalf("%s/%d has no leader", topic, partition)
	}
	return int(pd.Leader)
}

// txnCoordinator is the node coordinating transactional id txnID.
func (e *env) txnCoordinator(adm *kadm.Client, txnID string) int {
	e.t.Helper()
	r := adm.FindTxnCoordinators(e.ctx, txnID)
	c, ok := r[txnID]
	if !ok || c.Err != nil {
		e.t.Fatalf("find the coordinator of %s: %+v", txnID, c)
	}
	return int(c.NodeID)
}
