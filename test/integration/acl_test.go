package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/test/kafkacluster"
)

// The relay's SCRAM user on the authorizing broker of TestKafkaACL.
const aclUser, aclPass = "relay-acl", "acl-Pa55-w0rd"

// TestKafkaACL revokes, on Apache Kafka with the StandardAuthorizer and a
// SCRAM user for the relay, one permission the relay needs while it
// streams, writes rows, restores the permission and writes more. An
// authorization failure is the operator's to fix, not the events': while
// revoked the relay reports not ready, names the principal, the operation
// and the resource in a warning, and does not confirm the slot past the
// first row written meanwhile; once restored it delivers every row by
// itself (no restart of the process), none dead-lettered.
func TestKafkaACL(t *testing.T) {
	needApache(t)
	k := startApache(t, kafkacluster.Options{SCRAM: true, Authorizer: true})
	if err := k.AddSCRAMUser(context.Background(), kadm.ScramSha512, aclUser, aclPass); err != nil {
		t.Fatal(err)
	}
	for _, eos := range []bool{false, true} {
		t.Run("topic WRITE/"+modeName(eos), func(t *testing.T) {
			a := newACLEnv(t, k)
			a.revokeRestore(eos, a.topicWrite(a.topic("orders")), a.topic("orders"), func(from, n int) { a.insertRows("orders", from, n) })
		})
	}
	t.Run("dead-letter topic WRITE", func(t *testing.T) {
		a := newACLEnv(t, k)
		a.revokeRestore(false, a.topicWrite(a.topic("dlq")), a.topic("dlq"), func(from, n int) {
			// An invalid event (no aggregate id) first, then valid ones.
			a.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('orders', NULL, 'T', jsonb_build_object('seq', $1::int), $1)`, from)
			a.insertRows("orders", from+1, n-1)
		})
	})
	t.Run("transactional id WRITE/exactly-once", func(t *testing.T) {
		a := newACLEnv(t, k)
		a.revokeRestore(true, kadm.NewACLs().Allow(a.principal()).AllowHosts().TransactionalIDs(a.txnID()).Operations(kadm.OpWrite), "",
			func(from, n int) { a.insertRows("orders", from, n) })
	})
	// Two transactional producers (--txn-producers 2) also write as
	// "<id>-1": a literal ACL on the id leaves the relay one, with a
	// warning naming the ACL to add; a prefixed one covers both.
	for _, prefixed := range []bool{false, true} {
		t.Run(fmt.Sprintf("second transactional id/prefixed ACL %v", prefixed), func(t *testing.T) {
			newACLEnv(t, k).twoProducers(prefixed)
		})
	}
}

// twoProducers runs the relay with two transactional producers, granted
// WRITE on its transactional id by a literal ACL (newACLEnv's) or also a
// prefixed one, writes rows and checks each is read once read_committed,
// and that the second id, "<id>-1", was used only when the prefixed ACL
// allows it, with one warning naming the ACL to add when not, and
// walrelay_kafka_transactional_producers saying how many are used.
func (a *aclEnv) twoProducers(prefixed bool) {
	t := a.t
	second := a.txnID() + "-1"
	if prefixed {
		a.grant(kadm.NewACLs().Allow(a.principal()).AllowHosts().TransactionalIDs(a.txnID()).
			ResourcePatternType(kadm.ACLPatternPrefixed).Operations(kadm.OpWrite, kadm.OpDescribe))
	}
	logs := a.observeLogs()
	rc := a.consumeIsolated(true)
	cfg := a.relayConfig(true)
	cfg.Router.TxnProducers = 2
	rr, reg := a.startRelayGathered(cfg)
	const rows = 40
	for s := 0; s < rows; s += 10 {
		a.insertRows("orders", s, 10)
		a.waitFor(fmt.Sprintf("%d rows read", s+10), 120*time.Second, func() (bool, error) {
			if ok, err := rr.returned(); ok {
				return false, fmt.Errorf("relay stopped: %v", err)
			}
			return rc.distinct() >= s+10, fmt.Errorf("%d rows read", rc.distinct())
		})
	}
	if n := len(rc.records()); n != rows {
		t.Errorf("%d records read read_committed, want each of the %d rows once", n, rows)
	}
	warned := warnings(logs, "second transactional id")
	used := a.describeTxnErr(second) == nil
	if got, want := gathered(reg, "walrelay_kafka_transactional_producers")[""], map[bool]float64{false: 1, true: 2}[prefixed]; got != want {
		t.Errorf("walrelay_kafka_transactional_producers = %v, want %v", got, want)
	}
	switch {
	case prefixed && (len(warned) > 0 || !used):
		t.Errorf("with a prefixed ACL: %d warnings about the second id, %s used: %v; want none, and used", len(warned), second, used)
	case !prefixed && (len(warned) != 1 || used):
		t.Errorf("with a literal ACL on the id only: %d warnings about the second id, %s used: %v; want one, and not used", len(warned), second, used)
	case !prefixed && !strings.Contains(fmt.Sprint(warned[0].Message, warned[0].Context), "PREFIXED"):
		t.Errorf("the warning does not name the prefixed ACL to add: %s %v", warned[0].Message, warned[0].Context)
	}
	if len(warned) > 0 {
		t.Logf("warning: %s %v", warned[0].Message, warned[0].Context)
	}
}

// describeTxnErr is the broker's error describing txnID's transaction
// (TRANSACTIONAL_ID_NOT_FOUND when no producer ever took the id), as the
// super user.
func (a *aclEnv) describeTxnErr(txnID string) error {
	ds, err := a.adm.DescribeTransactions(a.ctx, txnID)
	if err != nil {
		return err
	}
	if d, ok := ds[txnID]; ok {
		return d.Err
	}
	return fmt.Errorf("%s not described", txnID)
}

func modeName(eos bool) string {
	return map[bool]string{false: "at-least-once", true: "exactly-once"}[eos]
}

// aclEnv is a test's env on the authorizing cluster: the relay connects as
// aclUser through the SASL listener, with the ACLs of security.md granted
// on the test's topics; the test's consumers and admin connect through
// PLAINTEXT as the super user.
type aclEnv struct {
	*env
	k   *kafkacluster.Cluster
	adm *kadm.Client
}

func newACLEnv(t *testing.T, k *kafkacluster.Cluster) *aclEnv {
	e := newEnv(t)
	e.brokers = k.Addrs()
	adm, err := k.Admin()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(adm.Close)
	a := &aclEnv{env: e, k: k, adm: adm}
	p := a.principal()
	// DESCRIBE, CREATE, DESCRIBE_CONFIGS (and READ, for the checkpoint
	// read) on the test's prefix; WRITE per topic, so that one topic's can
	// be revoked alone.
	a.grant(kadm.NewACLs().Allow(p).AllowHosts().Topics(e.topicPrefix()).ResourcePatternType(kadm.ACLPatternPrefixed).
		Operations(kadm.OpDescribe, kadm.OpCreate, kadm.OpDescribeConfigs, kadm.OpRead))
	for _, topic := range []string{e.topic("orders"), e.topic("dlq"), e.checkpointTopic()} {
		a.grant(a.topicWrite(topic))
	}
	a.grant(kadm.NewACLs().Allow(p).AllowHosts().TransactionalIDs(a.txnID()).Operations(kadm.OpWrite, kadm.OpDescribe))
	return a
}

func (a *aclEnv) principal() string { return "User:" + aclUser }
func (a *aclEnv) txnID() string     { return "walrelay-" + a.name }

func (a *aclEnv) topicWrite(topic string) *kadm.ACLBuilder {
	return kadm.NewACLs().Allow(a.principal()).AllowHosts().Topics(topic).Operations(kadm.OpWrite)
}

// grant creates the ACLs of b and waits until the broker's authorizer
// lists them.
func (a *aclEnv) grant(b *kadm.ACLBuilder) {
	a.t.Helper()
	res, err := a.adm.CreateACLs(a.ctx, b)
	if err == nil {
		for _, r := range res {
			if r.Err != nil {
				err = r.Err
			}
		}
	}
	if err != nil {
		a.t.Fatalf("create ACLs: %v", err)
	}
	a.waitACLs(b, true)
}

// revoke deletes the ACLs of b and waits until the broker's authorizer no
// longer lists them.
func (a *aclEnv) revoke(b *kadm.ACLBuilder) {
	a.t.Helper()
	res, err := a.adm.DeleteACLs(a.ctx, b)
	if err == nil {
		for _, r := range res {
			if r.Err != nil {
				err = r.Err
			}
		}
	}
	if err != nil {
		a.t.Fatalf("delete ACLs: %v", err)
	}
	a.waitACLs(b, false)
}

// waitACLs waits until the broker lists the ACLs of b (present) or none of
// them: DescribeAcls reads the broker's authorizer, the one that answers
// the relay's requests.
func (a *aclEnv) waitACLs(b *kadm.ACLBuilder, present bool) {
	a.t.Helper()
	a.waitFor(fmt.Sprintf("ACLs applied (present: %v)", present), 30*time.Second, func() (bool, error) {
		res, err := a.adm.DescribeACLs(a.ctx, b)
		if err != nil {
			return false, err
		}
		n := 0
		for _, r := range res {
			if r.Err != nil {
				return false, r.Err
			}
			n += len(r.Described)
		}
		return (n > 0) == present, fmt.Errorf("%d ACLs listed", n)
	})
}

// relayConfig is the test's relay configuration as the SCRAM user.
func (a *aclEnv) relayConfig(eos bool) relay.Config {
	cfg := a.config()
	cfg.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(a.k.SASLAddrs()...), kgo.SASL(scram.Auth{User: aclUser, Pass: aclPass}.AsSha512Mechanism())}
	cfg.Router.Principal = a.principal() // as walrelay run derives it from --kafka-sasl-user
	if eos {
		cfg.ExactlyOnce = true
		cfg.Router.CheckpointTopic = a.checkpointTopic()
	}
	return cfg
}

// insertRows inserts rows seq from..from+n-1 of aggregate type agg, two per
// transaction, keys k-0..k-2.
func (a *aclEnv) insertRows(agg string, from, n int) {
	a.t.Helper()
	for s := from; s < from+n; s += 2 {
		a.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq)
			SELECT $1, 'k-' || (s % 3), 'T', jsonb_build_object('seq', s), s FROM generate_series($2::int, $3::int) s`,
			agg, s, min(s+1, from+n-1))
	}
}

// confirmed is the slot's confirmed_flush_lsn.
func (a *aclEnv) confirmed() decoder.LSN { return a.slotInfo().ConfirmedLSN }

// revokeRestore streams rows 0-9 (write(from, n) writes rows), revokes the
// ACLs of acl, writes rows 10-29, and checks the relay waits: not ready, a
// warning naming the principal and WRITE, the denial met again after the
// stream restarted (for a topic: while streaming, holding the event, not
// ready), the slot not confirmed past the first row written meanwhile,
// none of those rows on topic (on any topic when topic is empty). It then
// restores the ACLs, writes rows 30-39, and checks every row arrives on
// its topic in order per key and none is dead-lettered, but for the
// invalid events write made (no aggregate id), which arrive on the
// dead-letter topic with their headers. Exactly-once output is read
// read_committed: each row once.
func (a *aclEnv) revokeRestore(eos bool, acl *kadm.ACLBuilder, topic string, write func(from, n int)) {
	t := a.t
	logs := a.observeLogs()
	var records func() []*kgo.Record
	if eos {
		records = a.consumeIsolated(true).records
	} else {
		records = a.consume().records
	}
	rr, reg := a.startRelayGathered(a.relayConfig(eos))
	byID := func() map[string][]*kgo.Record {
		m := map[string][]*kgo.Record{}
		for _, r := range records() {
			id, _ := header(r, "id")
			m[id] = append(m[id], r)
		}
		return m
	}
	waitRows := func(n int) {
		t.Helper()
		a.waitFor(fmt.Sprintf("%d rows read", n), 120*time.Second, func() (bool, error) {
			got := len(byID())
			return got >= n, fmt.Errorf("%d rows read", got)
		})
	}
	write(0, 10)
	waitRows(10)
	a.waitFor("ready", 60*time.Second, func() (bool, error) { return rr.relay.Ready() == nil, rr.relay.Ready() })

	a.revoke(acl)
	conn := a.conn()
	before := a.currentLSN(conn)
	write(10, 20)
	a.waitFor("the relay not ready", 60*time.Second, func() (bool, error) {
		if ok, err := rr.returned(); ok {
			return false, fmt.Errorf("relay stopped: %v", err)
		}
		return rr.relay.Ready() != nil, nil
	})
	t.Logf("not ready while revoked: %v", rr.relay.Ready())
	var warned []observer.LoggedEntry
	a.waitFor("a warning naming the principal and WRITE", 60*time.Second, func() (bool, error) {
		warned = nil
		for _, w := range warnings(logs, "") {
			if s := w.Message + fmt.Sprint(w.Context); strings.Contains(s, a.principal()) && strings.Contains(s, "WRITE") {
				warned = append(warned, w)
			}
		}
		return len(warned) > 0, nil
	})
	t.Logf("warning: %s %v", warned[0].Message, warned[0].Context)
	// Met again after the restart: a topic's check (the relay streams and
	// holds the event, not ready), the transactional id's initialization.
	a.waitFor("the denial met again after the restart", 60*time.Second, func() (bool, error) {
		if topic == "" {
			n := gathered(reg, "walrelay_stream_restarts_total")[string(relay.CauseKafkaAuthorization)]
			return n >= 2, fmt.Errorf("%v restarts of cause %s", n, relay.CauseKafkaAuthorization)
		}
		n := gathered(reg, "walrelay_kafka_authorization_denied_total")["WRITE,topic"] // labels by name: operation, resource
		return n >= 2, fmt.Errorf("%v denials of topic WRITE counted", n)
	})
	if topic != "" {
		if err := rr.relay.Ready(); !rr.relay.Streaming() || err == nil || !strings.Contains(err.Error(), a.principal()) {
			t.Errorf("holding the event: streaming %v, Ready() = %v; want streaming and not ready naming %s", rr.relay.Streaming(), err, a.principal())
		}
	}
	// What holds delivery is named as the authorizer's, with its reason.
	if g := gathered(reg, "walrelay_delivery_held"); g["kafka_authorization,Denied"] != 1 {
		t.Errorf("walrelay_delivery_held %v while revoked: want kafka_authorization,Denied = 1", g)
	}
	// The relay met the refusal and waits: the slot stays before the
	// first row written while revoked, and none of those rows is out.
	if c := a.confirmed(); c > before {
		t.Errorf("while revoked the slot was confirmed to %s, past %s, before the first row written meanwhile", c, before)
	}
	for _, r := range records() {
		if seq := seqOf(t, r.Value); seq >= 10 && (topic == "" || r.Topic == topic) {
			t.Errorf("while revoked row %d was read on %s", seq, r.Topic)
		}
	}
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay stopped: %v", err)
	}
	if c := a.confirmed(); c > before {
		t.Errorf("while revoked the slot was confirmed to %s, past %s", c, before)
	}

	a.grant(acl)
	write(30, 10)
	waitRows(40)
	a.waitFor("ready again", 60*time.Second, func() (bool, error) { return rr.relay.Ready() == nil, rr.relay.Ready() })
	if g := gathered(reg, "walrelay_delivery_held"); len(g) != 0 {
		t.Errorf("walrelay_delivery_held %v once granted: want nothing held", g)
	}
	a.waitFor("the slot confirmed past the rows", 60*time.Second, func() (bool, error) {
		return a.confirmed() > before, nil
	})

	var onTopic []*kgo.Record // in the order read: per partition, the order written
	for _, r := range records() {
		id, _ := header(r, "id")
		reason, invalid := header(r, deadletter.HeaderReason)
		switch {
		case r.Topic == a.topic("orders") && !invalid:
			onTopic = append(onTopic, r)
		case r.Topic == a.topic("dlq") && reason == string(deadletter.ReasonNoAggregateID):
			if v, ok := header(r, deadletter.HeaderAggregateType); !ok || v != "orders" {
				t.Errorf("dead letter %s: %s = %q (present %v), want orders", id, deadletter.HeaderAggregateType, v, ok)
			}
		default:
			t.Errorf("row %s on %s with reason %q: want it on %s", id, r.Topic, reason, a.topic("orders"))
		}
	}
	if eos {
		for id, recs := range byID() {
			if len(recs) > 1 {
				t.Errorf("row %s read %d times read_committed, want once", id, len(recs))
			}
		}
	}
	dups := checkPerKeyOrder(t, onTopic)
	t.Logf("%d records on the topic (%d duplicates); restarts %v; denials %v", len(onTopic), dups,
		gathered(reg, "walrelay_stream_restarts_total"), gathered(reg, "walrelay_kafka_authorization_denied_total"))
	denied := 0.0
	for _, n := range gathered(reg, "walrelay_kafka_authorization_denied_total") {
		denied += n
	}
	if denied == 0 {
		t.Error("walrelay_kafka_authorization_denied_total counted nothing")
	}
	if got := gathered(reg, "walrelay_events_dead_lettered_total")[string(deadletter.ReasonTopicRejected)]; got != 0 {
		t.Errorf("walrelay_events_dead_lettered_total{reason=topic_rejected} = %v, want 0", got)
	}
	if ok, err := rr.returned(); ok {
		t.Fatalf("relay stopped: %v", err)
	}
}
