package integration

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/deadletter"
)

// vmHWM is the peak resident set size of process pid, in bytes.
func vmHWM(t *testing.T, pid int) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc status")
	return 0
}

// One outbox row far over every limit (150 MB of payload) neither takes
// the relay's memory nor stops the stream: the binary's peak RSS stays
// within a small multiple of --max-message-bytes, the row is dead-lettered
// with its id and size, and a row written after it is published.
func TestHugeRowBoundedMemory(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("needs /proc to read the relay's peak RSS")
	}
	e := newEnv(t)
	c := e.consume()
	const capBytes = 16 << 20
	const payloadBytes = 150_000_000
	cmd := e.runBinary(append(e.args(), "--max-message-bytes", strconv.Itoa(capBytes), "--read-buffer-bytes", "65536")...)
	e.waitFor("slot active", 60*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, payload) VALUES ('00000000-0000-0000-0000-000000000001', 'order', 'warm', '{}')`)
	c.waitIDs(1, 60*time.Second)

	const huge = "00000000-0000-0000-0000-0000000000ff"
	e.exec(fmt.Sprintf(`INSERT INTO outbox (id, aggregate_type, aggregate_id, payload)
		VALUES ('%s', 'order', 'big', ('{"x":"' || repeat('x', %d) || '"}')::jsonb)`, huge, payloadBytes-8))
	const after = "00000000-0000-0000-0000-000000000002"
	e.exec(fmt.Sprintf(`INSERT INTO outbox (id, aggregate_type, aggregate_id, payload) VALUES ('%s', 'order', 'after', '{}')`, after))

	recs := c.waitIDs(3, 120*time.Second)
	var dead, later bool
	for _, r := range recs {
		id, _ := header(r, "id")
		switch id {
		case huge:
			dead = true
			if r.Topic != e.topicPrefix()+"dlq" {
				t.Errorf("huge row on %s, want the dead-letter topic", r.Topic)
			}
			if got, _ := header(r, deadletter.HeaderReason); got != string(deadletter.ReasonTooLarge) {
				t.Errorf("huge row reason %q, want %q", got, deadletter.ReasonTooLarge)
			}
			size, _ := header(r, deadletter.HeaderPayloadOmit)
			if n, _ := strconv.Atoi(size); n < payloadBytes {
				t.Errorf("huge row %s = %q, want its size (at least %d)", deadletter.HeaderPayloadOmit, size, payloadBytes)
			}
			if len(r.Value) != 0 {
				t.Errorf("huge row carries a %d-byte value", len(r.Value))
			}
		case after:
			later = r.Topic == e.topic("order")
		}
	}
	if !dead || !later {
		t.Fatalf("dead-lettered huge row: %v, later row published: %v", dead, later)
	}
	peak := vmHWM(t, cmd.Process.Pid)
	t.Logf("peak RSS %d MiB with --max-message-bytes %d MiB and a %d MB row", peak>>20, capBytes>>20, payloadBytes/1_000_000)
	if limit := int64(4 * capBytes); peak > limit {
		t.Fatalf("peak RSS %d MiB exceeds 4 × --max-message-bytes (%d MiB)", peak>>20, limit>>20)
	}
}

// Writers do not choose topics without limit: with an allowlist and
// --max-topics 2, rows of topics outside the list and of a third allowed
// topic are dead-lettered with their reasons, those topics are never
// created, and rows of the allowed topics keep flowing after them.
func TestTopicAllowlistAndMaxTopics(t *testing.T) {
	e := newEnv(t)
	c := e.consume()
	cfg := e.config()
	cfg.Router.TopicAllow = regexp.QuoteMeta(e.topicPrefix()) + `(order|payment|invoice)`
	cfg.Router.MaxTopics = 2
	_, reg := e.startRelayGathered(cfg)
	rows := []struct{ id, agg, want string }{
		{"00000000-0000-0000-0000-000000000001", "order", "order"},
		{"00000000-0000-0000-0000-000000000002", "secret", string(deadletter.ReasonTopicNotAllowed)},
		{"00000000-0000-0000-0000-000000000003", "payment", "payment"},
		{"00000000-0000-0000-0000-000000000004", "invoice", string(deadletter.ReasonTooManyTopics)},
		{"00000000-0000-0000-0000-000000000005", "orderx", string(deadletter.ReasonTopicNotAllowed)},
		{"00000000-0000-0000-0000-000000000006", "order", "order"},
	}
	for _, r := range rows {
		e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, payload) VALUES ($1, $2, 'k', '{}')`, r.id, r.agg)
	}
	recs := c.waitIDs(len(rows), 60*time.Second)
	byID := map[string]*kgo.Record{}
	for _, r := range recs {
		id, _ := header(r, "id")
		byID[id] = r
	}
	for _, r := range rows {
		rec := byID[r.id]
		switch r.want {
		case "order", "payment":
			if rec.Topic != e.topic(r.want) {
				t.Errorf("row %s (%s) on %s, want %s", r.id, r.agg, rec.Topic, e.topic(r.want))
			}
		default:
			reason, _ := header(rec, deadletter.HeaderReason)
			if rec.Topic != e.topicPrefix()+"dlq" || reason != r.want {
				t.Errorf("row %s (%s) on %s with reason %q, want the dead-letter topic with %q", r.id, r.agg, rec.Topic, reason, r.want)
			}
		}
	}
	dl := gathered(reg, "walrelay_events_dead_lettered_total")
	if dl[string(deadletter.ReasonTopicNotAllowed)] != 2 || dl[string(deadletter.ReasonTooManyTopics)] != 1 {
		t.Errorf("dead-lettered by reason = %v", dl)
	}
	adm := kadm.NewClient(c.client)
	topics, err := adm.ListTopics(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, agg := range []string{"secret", "invoice", "orderx"} {
		if topics.Has(e.topic(agg)) {
			t.Errorf("topic %s was created", e.topic(agg))
		}
	}
}

// A topic Kafka refuses for good does not block the rows behind it, in
// either delivery mode: a topic whose creation a policy refuses and one
// whose records a policy refuses (dead-lettered in flight) are
// dead-lettered (topic_rejected), with the aggregate type and id headers,
// and the rows after them are published. (kfake answers as a broker with
// those policies would. A topic the relay may not write to is not
// dead-lettered: TestKafkaACL.)
func TestTopicRefusedIsDeadLettered(t *testing.T) {
	for _, eos := range []bool{false, true} {
		t.Run(map[bool]string{false: "at-least-once", true: "exactly-once"}[eos], func(t *testing.T) {
			e := newEnv(t)
			e.needKfake()
			e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.CreateTopics}, Topic: e.topic("policy"), Err: kerr.PolicyViolation, Count: -1})
			e.kafka.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: e.topic("locked"), Err: kerr.PolicyViolation, Count: -1})
			cfg := e.config()
			var records func() []*kgo.Record
			if eos {
				cfg.ExactlyOnce = true
				cfg.Router.CheckpointTopic = e.checkpointTopic()
				rc := e.consumeIsolated(true)
				records = rc.records
			} else {
				records = e.consume().records
			}
			rr := e.startRelay(cfg)
			rows := []struct{ id, agg string }{
				{"00000000-0000-0000-0000-000000000001", "order"},
				{"00000000-0000-0000-0000-000000000002", "locked"},
				{"00000000-0000-0000-0000-000000000003", "policy"},
				{"00000000-0000-0000-0000-000000000004", "order"},
				{"00000000-0000-0000-0000-000000000005", "locked"},
			}
			for _, r := range rows {
				e.exec(`INSERT INTO outbox (id, aggregate_type, aggregate_id, payload) VALUES ($1, $2, 'k', '{}')`, r.id, r.agg)
			}
			byID := map[string]*kgo.Record{}
			e.waitFor("every row delivered", 90*time.Second, func() (bool, error) {
				for _, r := range records() {
					id, _ := header(r, "id")
					byID[id] = r
				}
				return len(byID) == len(rows), fmt.Errorf("%d of %d rows read", len(byID), len(rows))
			})
			for _, r := range rows {
				rec := byID[r.id]
				reason, _ := header(rec, deadletter.HeaderReason)
				if r.agg == "order" {
					if rec.Topic != e.topic("order") {
						t.Errorf("row %s on %s, want %s", r.id, rec.Topic, e.topic("order"))
					}
				} else if rec.Topic != e.topicPrefix()+"dlq" || reason != string(deadletter.ReasonTopicRejected) {
					t.Errorf("row %s (%s) on %s with reason %q, want the dead-letter topic with %q", r.id, r.agg, rec.Topic, reason, deadletter.ReasonTopicRejected)
				} else if aggType, _ := header(rec, deadletter.HeaderAggregateType); aggType != r.agg {
					t.Errorf("dead letter of row %s: %s %q, want %q", r.id, deadletter.HeaderAggregateType, aggType, r.agg)
				} else if aggID, _ := header(rec, deadletter.HeaderAggregateID); aggID != "k" {
					t.Errorf("dead letter of row %s: %s %q, want k", r.id, deadletter.HeaderAggregateID, aggID)
				}
			}
			if ok, err := rr.returned(); ok {
				t.Fatalf("relay stopped: %v", err)
			}
		})
	}
}
