package integration

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// A fence answers "has the consumer read everything there is?" without
// waiting a while and hoping: one marker record goes to every partition of
// the test's topics, in a Kafka transaction committed after everything the
// test wants to see, and the wait ends when the consumer has read the
// marker on each partition it reads. Kafka keeps a partition's order and a
// read_committed consumer stops at the first transaction still open, so
// the consumer then holds every record written (read_committed: every
// transaction decided) before the fence. A record that should not exist,
// a duplicate or a record of an aborted transaction would be among them.

// fenceHeader marks a fence record; consumers keep such records apart from
// what they read, so no assertion on records ever sees one.
const fenceHeader = "walrelay-test-fence"

// fenceSeen tracks the fence markers a consumer has read.
type fenceSeen struct {
	topics *regexp.Regexp // the topics the consumer reads
	mu     sync.Mutex
	seen   map[string]map[string]bool // nonce -> "topic/partition"
}

func newFenceSeen(topicRegex string) *fenceSeen {
	return &fenceSeen{topics: regexp.MustCompile(topicRegex), seen: map[string]map[string]bool{}}
}

// take records r if it is a fence marker and says whether it was.
func (f *fenceSeen) take(r *kgo.Record) bool {
	nonce, ok := header(r, fenceHeader)
	if !ok {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.seen[nonce] == nil {
		f.seen[nonce] = map[string]bool{}
	}
	f.seen[nonce][fmt.Sprintf("%s/%d", r.Topic, r.Partition)] = true
	return true
}

// missing lists the partitions of want the consumer has not read nonce on.
func (f *fenceSeen) missing(nonce string, want []string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, tp := range want {
		if f.topics.MatchString(tp[:strings.LastIndexByte(tp, '/')]) && !f.seen[nonce][tp] {
			out = append(out, tp)
		}
	}
	return out
}

// fence writes a marker to every partition of the test's topics in a
// committed Kafka transaction of transactional id txnID (default: one of
// the test's own), and waits until each of cs has read it wherever it
// reads. Pass the transactional id of a relay that is no longer running to
// also abort the Kafka transaction it left open, as its successor would
// (InitProducerID fences it): what that relay committed is then final.
func (e *env) fence(txnID string, cs ...interface{ fences() *fenceSeen }) {
	e.t.Helper()
	if txnID == "" {
		txnID = "walrelay-test-fence-" + e.name
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.TransactionalID(txnID),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	topics, err := kadm.NewClient(cl).ListTopics(e.ctx)
	if err == nil {
		err = topics.Error()
	}
	if err != nil {
		e.t.Fatalf("fence: list topics: %v", err)
	}
	b := make([]byte, 8)
	rand.Read(b)
	nonce := hex.EncodeToString(b)
	if err := cl.BeginTransaction(); err != nil {
		e.t.Fatalf("fence: %v", err)
	}
	var where []string
	for _, td := range topics.Sorted() {
		if !strings.HasPrefix(td.Topic, e.topicPrefix()) {
			continue
		}
		for _, p := range td.Partitions.Numbers() {
			where = append(where, fmt.Sprintf("%s/%d", td.Topic, p))
			rec := &kgo.Record{Topic: td.Topic, Partition: p, Key: []byte(fenceHeader),
				Headers: []kgo.RecordHeader{{Key: fenceHeader, Value: []byte(nonce)}}}
			if err := cl.ProduceSync(e.ctx, rec).FirstErr(); err != nil {
				e.t.Fatalf("fence: produce to %s/%d: %v", td.Topic, p, err)
			}
		}
	}
	if err := cl.EndTransaction(e.ctx, kgo.TryCommit); err != nil {
		e.t.Fatalf("fence: commit: %v", err)
	}
	for _, c := range cs {
		// A deadlock guard: a consumer far behind reads its backlog first.
		e.waitFor("the fence read", 3*time.Minute, func() (bool, error) {
			m := c.fences().missing(nonce, where)
			return len(m) == 0, fmt.Errorf("fence not read on %v", m)
		})
	}
}

func (c *consumer) fences() *fenceSeen    { return c.fenced }
func (c *eosConsumer) fences() *fenceSeen { return c.fenced }

// replyTime is when the walsender serving the test's slot last received a
// status update from its client (pg_stat_replication.reply_time), and that
// walsender's pid; ok is false when no walsender serves the slot.
func (e *env) replyTime() (at time.Time, pid int32, ok bool) {
	e.t.Helper()
	c, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	defer c.Close(context.Background())
	var t *time.Time
	err = c.QueryRow(e.ctx, `SELECT r.reply_time, r.pid FROM pg_stat_replication r
		JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1`, e.name).Scan(&t, &pid)
	if err == pgx.ErrNoRows || err == nil && t == nil {
		return time.Time{}, 0, false
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return *t, pid, true
}

// serverNow is the database server's clock (status update times are
// compared with it).
func (e *env) serverNow() time.Time {
	e.t.Helper()
	c, err := pgx.Connect(e.ctx, e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	defer c.Close(context.Background())
	var now time.Time
	if err := c.QueryRow(e.ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
		e.t.Fatal(err)
	}
	return now
}

// transactionalID is the Kafka transactional id of the test's relays with
// exactly-once delivery (the default, "walrelay-<slot>").
func (e *env) transactionalID() string { return "walrelay-" + e.name }

// scrapeMetric reads an unlabelled metric from a relay's /metrics.
func scrapeMetric(addr, name string) (float64, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return -1, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return -1, err
	}
	return metricValue(string(body), name), nil
}

// topicID is the Kafka topic id of an existing topic.
func (e *env) topicID(topic string) [16]byte {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
	td, err := kadm.NewClient(cl).ListTopics(e.ctx, topic)
	if err == nil {
		err = td.Error()
	}
	if err != nil {
		e.t.Fatalf("describe topic %s: %v", topic, err)
	}
	return td[topic].ID
}
