// Package router turns outbox events into Kafka records and produces them.
//
// The record: topic from a template on aggregate_type, key = aggregate_id,
// header "id" (and "type" and configured header columns), value = payload,
// timestamp = the transaction's commit time. Keyed records are partitioned
// with murmur2 exactly as Kafka's Java client does, so consumers joining by
// key across topics see the same partition.
//
// Ordering and acknowledgement: the producer is idempotent with acks=all;
// records of one partition are written in the order Send was called, across
// retries. Each record's fate is reported to the Acker given to Send: Ack
// once Kafka has it (on the producer's promise goroutine; with a
// TransactionalID, only once its Kafka transaction committed, in
// Txn.Commit), or the router's fatal handler when Kafka refused it for
// good (the caller then restarts from the last confirmed position:
// duplicates, never loss).
//
// Invalid events (no aggregate type, a topic name Kafka rejects, a topic
// outside the allowlist or past the topic limit, a topic that does not
// exist and that the relay may not create, or that a creation policy
// refuses, no aggregate id, no id, larger than the broker accepts, a row
// its table's columns could not map) go to a dead-letter topic with
// headers naming the reason, table, LSN and id, and count as acknowledged
// once the dead-letter record is. An authorization failure is not the
// events' fault: the router holds them until an ACL allows them
// (denied.go).
//
// The router routes and produces; it asks three packages for answers.
// Package topics says what a topic accepts (the name an aggregate type
// makes, the allowlist and bounds, creation, the size limit); the router
// keeps one cache entry per destination (topic.go) and prepares new ones
// in the background (create.go) so that Send need not wait. Package
// letter says why an event is invalid and builds its dead letter, with
// the reasons and headers of package deadletter (the contract consumers
// read); the router applies the on-invalid policy and produces the dead
// letter in the event's place (deadletter.go).
//
// Send never blocks: when the producer buffer is full, or a new topic is
// being created, it returns a channel to wait on (so the caller can keep
// answering PostgreSQL meanwhile) and should be called again afterwards.
package router

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router/internal/letter"
	"github.com/walrelay/walrelay/router/internal/topics"
)

// Acker is the transaction a record belongs to; *confirm.Txn is one. Add
// is called once per record before it is handed to the producer, Ack once
// Kafka has acknowledged it (on the promise goroutine; with a
// TransactionalID, in Txn.Commit once the Kafka transaction committed). A
// record Kafka refuses is never acked.
type Acker interface {
	Add()
	Ack()
}

// OnInvalid says what happens to an invalid event.
type OnInvalid string

const (
	// InvalidDeadLetter produces the event to the dead-letter topic (default).
	InvalidDeadLetter OnInvalid = "dlq"
	// InvalidFail stops the relay with an error naming the event.
	InvalidFail OnInvalid = "fail"
	// InvalidSkip drops the event after logging it and counting it.
	InvalidSkip OnInvalid = "skip"
)

// Config configures a Router. Start from DefaultConfig: a field holds the
// value it means, so a zero is zero (none, off), never "the default";
// Validate refuses a zero where only another value works, naming the field
// and its default. Each field's documentation names its default, the value
// DefaultConfig sets.
type Config struct {
	// TopicTemplate maps aggregate_type to a topic. Default
	// "outbox.event.{aggregate_type}".
	TopicTemplate string
	// DeadLetterTopic receives invalid events. Default "walrelay.dlq".
	DeadLetterTopic string
	// OnInvalid: dlq (default), fail or skip.
	OnInvalid OnInvalid
	// CreateTopics creates missing topics (and the dead-letter topic)
	// before the first record goes to them. Default true.
	CreateTopics bool
	// TopicAllow, when set, is a regular expression (anchored at both
	// ends) every event topic must match; events of other topics are
	// dead-lettered (topic_not_allowed). Default empty: every topic.
	TopicAllow string
	// MaxTopics bounds the distinct event topics the relay produces to
	// (and creates); events of further topics are dead-lettered
	// (too_many_topics). Default topics.DefaultMaxTopics; negative: no
	// limit; 0 is refused (every event would be dead-lettered).
	MaxTopics int
	// MaxTopicSeries bounds the topics with their own series of
	// walrelay_events_published_total; the others count under "other".
	// Default topics.DefaultMaxSeries; negative: no limit; 0: every topic
	// under "other".
	MaxTopicSeries int
	// Topics keeps what the bounds above have counted, and the topics
	// Kafka refused, across routers; pass the same set to every router of
	// a relay (WithTopicSet). Default nil: New makes a set of this
	// router's own.
	Topics *topics.Set
	// TopicPartitions and TopicReplicationFactor for created topics;
	// default -1: the broker's default (0 is refused).
	TopicPartitions        int32
	TopicReplicationFactor int16
	// MaxInflightEvents bounds records produced and not yet acknowledged.
	// Default 5,000: a drain to one Apache Kafka node peaked at 36-44 MiB
	// RSS with it against 44-94 MiB with 50,000 and 64 MiB, at the same
	// rate (BENCHMARKS.md, "Memory"); a window covers rate x (linger +
	// acknowledgement), ~1,400 records at 230,000 events/s and 6 ms.
	MaxInflightEvents int64
	// MaxInflightBytes bounds their approximate size. Default 8 MiB. One
	// event larger than this still goes through, alone. Both must be
	// positive.
	MaxInflightBytes int64
	// MaxRecordBytes is the largest record the broker accepts; larger
	// events are invalid. Default 1,000,012 (Kafka's message.max.bytes);
	// must be positive.
	MaxRecordBytes int
	// HeaderID and HeaderType name the id and type headers. Defaults "id"
	// and "type".
	HeaderID, HeaderType string
	// Principal is the Kafka principal the relay authenticates as (such
	// as "User:relay", from its SASL user), named when Kafka denies it an
	// operation; empty: "the relay's principal".
	Principal string
	// OnPublished, if set, is called on the promise goroutine with every
	// record Kafka acknowledged (partition and offset set). It must be
	// fast. Default none.
	OnPublished func(*kgo.Record)
	// Denials, if set, is told when Kafka's authorizer holds delivery
	// (Hold, with the denial in force) and when it no longer does
	// (Clear): the relay's kafka_authorization condition (package
	// holds). Default none.
	Denials HoldReporter
	// Tracer, if set, gives each event's record a span (package tracing;
	// see trace.go). Nil, the default, traces nothing.
	Tracer Tracer

	// TransactionalID, when set, makes delivery exactly-once: records are
	// produced in Kafka transactions, each closed by Txn.Commit with a
	// checkpoint record, and a record's transaction is acked only when its
	// Kafka transaction commits. Default empty: at-least-once.
	TransactionalID string
	// CheckpointTopic receives the checkpoint records (compacted, one
	// partition; created when topic creation is on). Default
	// "walrelay.checkpoints".
	CheckpointTopic string
	// TransactionTimeout is how long the broker lets a Kafka transaction
	// stay open before aborting it. Default 60s; with a TransactionalID it
	// must be positive.
	TransactionTimeout time.Duration
	// TxnProducers is how many transactional producers take turns (see
	// txn.go): 1 commits each Kafka transaction before the next one's
	// first record; 2 produces the next one's records, as the id
	// "<TransactionalID>-1", while the last one commits. Default 1 (0
	// means 1); more than 2 is refused.
	TxnProducers int

	// Values, when set, makes each record's value from its event (package
	// schema: a schema registry's wire format, the payload checked against
	// its schema); nil produces the payload as is.
	Values Values
}

// HoldReporter is told when something holds delivery and when it no
// longer does (Config.Denials); *holds.Condition is one.
type HoldReporter interface {
	Hold(reason, message string)
	Clear()
}

// Values makes the value of an event's record (Config.Values).
type Values interface {
	// Value returns the value of ev's record for topic. A non-nil channel
	// means not now (a schema is being read): Send returns it, and the
	// event is sent again once it delivers. An error makes the event
	// invalid: a *deadletter.SchemaError gives the reason and the subject
	// and version for the dead letter; any other is schema_mismatch.
	Value(topic string, ev *decoder.Event) (value []byte, wait <-chan struct{}, err error)
}

// DefaultConfig is the router walrelay runs with when nothing is set: the
// one place its defaults are written.
func DefaultConfig() Config {
	return Config{
		TopicTemplate:          "outbox.event.{aggregate_type}",
		DeadLetterTopic:        "walrelay.dlq",
		OnInvalid:              InvalidDeadLetter,
		CreateTopics:           true,
		MaxTopics:              topics.DefaultMaxTopics,
		MaxTopicSeries:         topics.DefaultMaxSeries,
		TopicPartitions:        -1,
		TopicReplicationFactor: -1,
		MaxInflightEvents:      5_000,
		MaxInflightBytes:       8 << 20,
		MaxRecordBytes:         1_000_012,
		HeaderID:               "id",
		HeaderType:             "type",
		CheckpointTopic:        "walrelay.checkpoints",
		TransactionTimeout:     60 * time.Second,
		TxnProducers:           1,
	}
}

// WithTopicSet returns c with a topic set of its own when it has none, to
// be shared by every router made from it (Config.Topics).
func (c Config) WithTopicSet() Config {
	if c.Topics == nil {
		c.Topics = topics.NewSet()
	}
	return c
}

// Validate reports what in c no router can work with, naming the field:
// a zero (or an empty name) where only another value works, a topic
// template, dead-letter or checkpoint topic name Kafka would refuse, an
// on-invalid policy or an allowlist that does not parse.
func (c Config) Validate() error {
	def := DefaultConfig()
	for _, f := range []struct {
		field string
		bad   bool
		want  string
		def   any
	}{
		{"router.Config.MaxTopics", c.MaxTopics == 0, "a positive number, or -1 for no limit", def.MaxTopics},
		{"router.Config.TopicPartitions", c.TopicPartitions == 0, "a positive count, or -1 for the broker's default", def.TopicPartitions},
		{"router.Config.TopicReplicationFactor", c.TopicReplicationFactor == 0, "a positive factor, or -1 for the broker's default", def.TopicReplicationFactor},
		{"router.Config.MaxInflightEvents", c.MaxInflightEvents <= 0, "a positive number", def.MaxInflightEvents},
		{"router.Config.MaxInflightBytes", c.MaxInflightBytes <= 0, "a positive size", def.MaxInflightBytes},
		{"router.Config.MaxRecordBytes", c.MaxRecordBytes <= 0, "a positive size", def.MaxRecordBytes},
		{"router.Config.TransactionTimeout", c.TransactionalID != "" && c.TransactionTimeout <= 0, "a positive duration", def.TransactionTimeout},
		{"router.Config.TxnProducers", c.TxnProducers < 0 || c.TxnProducers > 2, "1 or 2", def.TxnProducers},
	} {
		if f.bad {
			return fmt.Errorf("%s is %v: give it %s (the default is %v)", f.field, fieldValue(c, f.field), f.want, f.def)
		}
	}
	for _, f := range []struct{ field, v, def string }{
		{"router.Config.TopicTemplate", c.TopicTemplate, def.TopicTemplate},
		{"router.Config.DeadLetterTopic", c.DeadLetterTopic, def.DeadLetterTopic},
		{"router.Config.OnInvalid", string(c.OnInvalid), string(def.OnInvalid)},
		{"router.Config.HeaderID", c.HeaderID, def.HeaderID},
		{"router.Config.HeaderType", c.HeaderType, def.HeaderType},
	} {
		if f.v == "" {
			return fmt.Errorf("%s is empty: name one (the default is %q)", f.field, f.def)
		}
	}
	if _, err := topics.ParseTemplate(c.TopicTemplate); err != nil {
		return err
	}
	if err := topics.ValidName(c.DeadLetterTopic); err != nil {
		return fmt.Errorf("dead-letter topic: %w", err)
	}
	switch c.OnInvalid {
	case InvalidDeadLetter, InvalidFail, InvalidSkip:
	default:
		return fmt.Errorf("on-invalid %q: want dlq, fail or skip", c.OnInvalid)
	}
	if _, err := topics.ParseAllow(c.TopicAllow); err != nil {
		return err
	}
	if c.TransactionalID != "" {
		if c.CheckpointTopic == "" {
			return fmt.Errorf("router.Config.CheckpointTopic is empty: name one (the default is %q)", def.CheckpointTopic)
		}
		if err := topics.ValidName(c.CheckpointTopic); err != nil {
			return fmt.Errorf("checkpoint topic: %w", err)
		}
	}
	return nil
}

// fieldValue is the value of c's numeric field of that name, for
// Validate's errors.
func fieldValue(c Config, name string) any {
	switch name {
	case "router.Config.MaxTopics":
		return c.MaxTopics
	case "router.Config.TopicPartitions":
		return c.TopicPartitions
	case "router.Config.TopicReplicationFactor":
		return c.TopicReplicationFactor
	case "router.Config.MaxInflightEvents":
		return c.MaxInflightEvents
	case "router.Config.MaxInflightBytes":
		return c.MaxInflightBytes
	case "router.Config.MaxRecordBytes":
		return c.MaxRecordBytes
	case "router.Config.TransactionTimeout":
		return c.TransactionTimeout
	case "router.Config.TxnProducers":
		return c.TxnProducers
	}
	return nil
}

// Router produces outbox events to Kafka. Send, Start and the methods of
// its Txn belong to one goroutine, the one that sends, or to one goroutine
// it waits for; Flush, Inflight, Failed, Err, Ping and Close are safe for
// concurrent use.
type Router struct {
	cfg       Config
	tmpl      topics.Template
	client    *kgo.Client
	admin     *kadm.Client
	prep      *topics.Admin // creates topics, reads their size limits
	log       *zap.Logger
	metrics   *metrics.Metrics
	fatal     func(error)
	gate      gate
	promise   func(*kgo.Record, error)
	byAggType map[string]*topic // key: aggregate_type value
	byName    map[string]*topic
	allow     *regexp.Regexp // Config.TopicAllow, anchored; nil allows all
	topics    *topics.Set
	dlq       *topic
	failed    atomic.Bool
	failErr   atomic.Pointer[error]
	// deniedOnce: a record was refused for an authorization failure
	// (counted and logged for the first one only).
	deniedOnce atomic.Bool
	limits     sync.Map // topic name → max.message.bytes, for batchLimit

	// Topic preparations run in the background (bg) until done or until
	// Close cancels closing.
	closing context.Context
	close   context.CancelFunc
	bg      sync.WaitGroup
	// preparing counts the preparations under way: requests Kafka has
	// not answered, on which an event may wait with nothing in flight.
	preparing atomic.Int64

	connOpts []kgo.Opt // the caller's connection options, for the checkpoint reader
	// txn is the transactional producer's state (txn.go); nil with
	// at-least-once delivery.
	txn *Txn

	tracer    Tracer    // Config.Tracer (trace.go)
	traceRead time.Time // when Send was first handed the event it is sending
}

// New returns a Router and its producer, a franz-go client built from
// opts (seed brokers, TLS, SASL, compression, linger) and the options the
// router relies on: acks=all, idempotence (franz-go's default), murmur2 key
// partitioning as in Kafka's Java client, unlimited retries, batches no
// larger than each topic accepts, and a buffer larger than the router's own
// in-flight limit so that producing never blocks inside the client. fatal
// is called (on the promise goroutine, at most once) with the first error
// Kafka returns for a record after the producer's own retries; records sent
// after it may or may not be acknowledged, and the caller must restart from
// its last confirmed position.
func New(cfg Config, opts []kgo.Opt, log *zap.Logger, m *metrics.Metrics, fatal func(error)) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Topics == nil {
		cfg.Topics = topics.NewSet()
	}
	tmpl, _ := topics.ParseTemplate(cfg.TopicTemplate)
	allow, _ := topics.ParseAllow(cfg.TopicAllow)
	r := &Router{
		cfg:       cfg,
		tmpl:      tmpl,
		allow:     allow,
		topics:    cfg.Topics,
		log:       log,
		metrics:   m,
		fatal:     fatal,
		byAggType: make(map[string]*topic),
		byName:    make(map[string]*topic),
	}
	r.closing, r.close = context.WithCancel(context.Background())
	r.connOpts = opts
	all := append([]kgo.Opt{
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)),
		kgo.MaxBufferedRecords(int(cfg.MaxInflightEvents) + dlqSlack),
		// franz-go asks once per partition, before the first record to
		// it; the router learns each topic's limit before producing to it.
		kgo.ProducerBatchMaxBytesFn(r.batchLimit),
		// A record answered NOT_LEADER_FOR_PARTITION (a topic just
		// created, a leader election) waits for a metadata refresh, and
		// franz-go refreshes at most every MetadataMinAge: 5 s by default,
		// which Apache Kafka showed as 4 s stalls right after startup.
		// Kafka's Java producer retries after retry.backoff.ms (100 ms).
		kgo.MetadataMinAge(250 * time.Millisecond),
	}, opts...)
	var err error
	if cfg.TransactionalID == "" {
		if r.client, err = kgo.NewClient(all...); err != nil {
			return nil, fmt.Errorf("kafka client: %w", err)
		}
	} else {
		r.txn = &Txn{r: r, opts: all}
		for n := range max(cfg.TxnProducers, 1) {
			l := &lane{n: n, id: laneID(cfg.TransactionalID, n), first: firstWrites{}}
			l.client, err = kgo.NewClient(append(all[:len(all):len(all)], kgo.TransactionalID(l.id), kgo.TransactionTimeout(cfg.TransactionTimeout))...)
			if err != nil {
				for _, open := range r.txn.lanes {
					open.client.Close()
				}
				return nil, fmt.Errorf("kafka client: %w", err)
			}
			r.txn.lanes = append(r.txn.lanes, l)
		}
		r.client = r.txn.lanes[0].client
	}
	r.admin = kadm.NewClient(r.client)
	r.prep = topics.NewAdmin(r.admin, cfg.CreateTopics, cfg.TopicPartitions, cfg.TopicReplicationFactor, log)
	r.gate.init(cfg.MaxInflightEvents, cfg.MaxInflightBytes, m)
	for _, reason := range deadletter.Reasons() {
		m.EventsDeadLettered.WithLabelValues(string(reason)) // export zeros: alerts see the series
	}
	m.KafkaDenied.WithLabelValues(resourceTopic, "WRITE")
	m.KafkaDenied.WithLabelValues(resourceTopic, "DESCRIBE")
	if r.txn != nil {
		m.KafkaDenied.WithLabelValues(resourceTxnID, "WRITE")
	}
	r.promise = r.onPromise
	if r.tracer = cfg.Tracer; r.tracer != nil {
		r.promise = r.tracedPromise
	}
	r.dlq = r.topicNamed(cfg.DeadLetterTopic)
	return r, nil
}

// batchLimit is the producer's batch size limit for topic: the smaller of
// --max-record-bytes and the topic's max.message.bytes.
func (r *Router) batchLimit(topic string) int32 {
	limit := r.cfg.MaxRecordBytes
	if v, ok := r.limits.Load(topic); ok {
		limit = min(limit, v.(int))
	}
	return int32(max(limit, 512))
}

// dlqSlack is room in the client's buffer for dead-letter records, which
// bypass the in-flight gate because they replace an event already counted.
const dlqSlack = 1024

// Start prepares the dead-letter topic and the extra topics (such as the
// heartbeat topic): creates them when topic creation is on and reads their
// size limits; and counts the event topics that exist on the broker
// towards MaxTopics. It blocks until the broker answers or ctx ends.
func (r *Router) Start(ctx context.Context, extra ...string) error {
	if r.txn != nil {
		if err := r.txn.prepareCheckpointTopic(ctx); err != nil {
			return err
		}
	}
	if err := r.countExistingTopics(ctx, append([]string{r.dlq.name, r.cfg.CheckpointTopic}, extra...)); err != nil {
		return err
	}
	var names []string
	if r.cfg.OnInvalid == InvalidDeadLetter {
		names = append(names, r.dlq.name)
	}
	for _, name := range append(names, extra...) {
		t := r.topicNamed(name)
		r.startPrepare(ctx, t)
		select {
		case <-t.ready:
		case <-ctx.Done():
			return ctx.Err()
		}
		r.settle(t)
		switch {
		case t.state == topicRejected:
			return fmt.Errorf("topic %q: %w", name, t.rejectErr)
		case t.state == topicUnknown && t.deniedOp != "":
			// Nothing waits on the topic yet, so the relay stays
			// ready: the dead-letter topic is checked again when an
			// invalid event needs it (Send waits for it then), the
			// heartbeat topic belongs to the heartbeat's producer.
			log := r.log.Warn
			if r.topics.IsDenied(resourceTopic + " " + name) {
				log = r.log.Debug // an earlier router warned, and it waits for it
			}
			log("Kafka denies the relay a topic it may need: events that need it will wait until it is granted",
				zap.String("topic", name), zap.Error(r.topicDenied(t, t.deniedOp, t.lastErr)))
		case t.state == topicUnknown:
			return fmt.Errorf("prepare topic %q: %w", name, t.lastErr)
		}
	}
	if r.cfg.OnInvalid != InvalidDeadLetter {
		r.dlq.state = topicReady // not prepared: only redirect uses it
	}
	return nil
}

// Send hands ev, an event of the transaction acked by a, to the producer.
// lsn is the WAL position of the event's message, for dead-letter headers.
//
// If it returns a non-nil channel, nothing was sent: wait until the channel
// delivers (or a short timeout passes) and call Send again with the same
// event. An error means the relay must stop (an invalid event with
// on-invalid=fail).
func (r *Router) Send(ev *decoder.Event, lsn decoder.LSN, a Acker) (<-chan struct{}, error) {
	if r.tracer != nil {
		return r.sendTraced(ev, lsn, a)
	}
	return r.send(ev, lsn, a)
}

func (r *Router) send(ev *decoder.Event, lsn decoder.LSN, a Acker) (<-chan struct{}, error) {
	if wait := r.gate.wait(); wait != nil {
		return wait, nil
	}
	if r.txn != nil {
		if wait := r.txn.pending(); wait != nil {
			return wait, nil // the last Kafka transaction is completing
		}
	}
	if ev.Omitted > 0 {
		// A value was too large to be read into memory: the event could
		// never be produced, and it may lack its other fields.
		return nil, r.invalid(ev, lsn, a, deadletter.ReasonTooLarge, fmt.Sprintf("a value of %d bytes exceeds the record limit %d and was not read into memory", ev.Omitted, r.cfg.MaxRecordBytes))
	}
	reason, t, detail := r.route(ev)
	if t != nil && t.state != topicRejected && t.refused.Load() {
		// Kafka refused a record of this topic for good (see redirect).
		t.state, t.rejectErr = topicRejected, errors.New(r.topics.Refusal(t.name))
	}
	if t != nil {
		if wait := r.await(t); wait != nil {
			return wait, nil
		}
		if t.state == topicRejected {
			reason, detail = deadletter.ReasonTopicRejected, t.rejectErr.Error()
		}
	}
	if reason == "" {
		value := ev.Payload
		if r.cfg.Values != nil {
			v, wait, err := r.cfg.Values.Value(t.name, ev)
			if wait != nil {
				return wait, nil
			}
			if err != nil {
				return nil, r.invalidValue(ev, lsn, a, err)
			}
			value = v
		}
		o := r.newRecordValue(ev, t, a, value)
		o.table, o.lsn = ev.Table, lsn
		if r.tracer != nil {
			r.traceRecord(o, ev)
		}
		stamp(o)
		if o.size > t.maxBytes {
			reason, detail = deadletter.ReasonTooLarge, fmt.Sprintf("record of %d bytes exceeds %d, the limit of topic %s", o.size, t.maxBytes, t.name)
		} else {
			if err := r.produce(o); err != nil {
				return nil, err
			}
			return nil, nil
		}
	}
	if r.cfg.OnInvalid == InvalidDeadLetter {
		// The dead letter waits for its topic as an event waits for its
		// own: one the relay may not write to yet (see Start).
		if wait := r.await(r.dlq); wait != nil {
			return wait, nil
		}
	}
	return nil, r.invalid(ev, lsn, a, reason, detail)
}

// await readies topic t for a record: nil once it is ready or rejected,
// else a channel to wait on before asking again (its preparation running,
// or the pause before the next attempt after a failure or a denial).
func (r *Router) await(t *topic) <-chan struct{} {
	switch t.state {
	case topicUnknown:
		if time.Now().Before(t.retryAt) {
			return t.retryWait()
		}
		r.startPrepare(r.closing, t)
		return t.ready
	case topicCreating:
		select {
		case <-t.ready:
			r.settle(t)
			if t.deniedOp != "" {
				t.denied.Store(true)
				r.deny(r.topicDenied(t, t.deniedOp, t.lastErr))
			}
			return r.await(t)
		default:
			return t.ready
		}
	}
	return nil
}

// route finds the destination of ev, or why it has none.
func (r *Router) route(ev *decoder.Event) (reason deadletter.Reason, t *topic, detail string) {
	if reason, detail := letter.Check(ev, r.tmpl.Fixed()); reason != "" {
		return reason, nil, detail
	}
	// With a fixed template every aggregate type shares one entry: the
	// cache must not grow with the values writers choose.
	aggType := ev.AggregateType
	if r.tmpl.Fixed() {
		aggType = nil
	}
	if t = r.byAggType[string(aggType)]; t != nil {
		return "", t, ""
	}
	name := r.tmpl.Topic(aggType)
	if err := topics.ValidName(name); err != nil {
		return deadletter.ReasonInvalidTopic, nil, err.Error()
	}
	// Refused topics are not cached: the cache stays bounded by the
	// topics allowed.
	if reason, detail := r.checkNewTopic(name); reason != "" {
		return reason, nil, detail
	}
	t = r.topicNamed(name)
	r.byAggType[string(aggType)] = t
	return "", t, ""
}

// checkNewTopic says why events may not go to name, a topic not used yet:
// outside the allowlist, or one topic more than MaxTopics.
func (r *Router) checkNewTopic(name string) (deadletter.Reason, string) {
	if r.allow != nil && !r.allow.MatchString(name) {
		return deadletter.ReasonTopicNotAllowed, fmt.Sprintf("topic %q does not match the topic allowlist %q", name, r.cfg.TopicAllow)
	}
	if !r.topics.Use(name, r.cfg.MaxTopics) {
		return deadletter.ReasonTooManyTopics, fmt.Sprintf("topic %q would be one topic more than the limit of %d event topics (router.Config.MaxTopics)", name, r.cfg.MaxTopics)
	}
	return "", ""
}

// topicNamed is the cache entry of topic name, made on first use.
func (r *Router) topicNamed(name string) *topic {
	if t := r.byName[name]; t != nil {
		return t
	}
	label := r.topics.Label(name, r.cfg.MaxTopicSeries)
	t := &topic{name: name, published: r.metrics.EventsPublished.WithLabelValues(label), maxBytes: r.cfg.MaxRecordBytes}
	if why := r.topics.Refusal(name); why != "" {
		t.state, t.rejectErr = topicRejected, errors.New(why) // refused under an earlier router
	}
	t.produceTime.Store(r.topics.ProduceTime(name))               // a timestamp refused under an earlier router
	t.denied.Store(r.topics.IsDenied(resourceTopic + " " + name)) // denied under an earlier router
	r.byName[name] = t
	return t
}

// outRecord is a record and everything its promise needs, in one
// allocation. rec must stay the first field: the promise converts the
// *kgo.Record it is given back to the *outRecord it was allocated as.
type outRecord struct {
	rec   kgo.Record
	hdrs  [4]kgo.RecordHeader
	topic *topic
	ack   Acker
	size  int
	table *decoder.Table // for a dead letter, should Kafka refuse the topic
	lsn   decoder.LSN
	// aggType is the event's aggregate type, for the same dead letter's
	// walrelay.aggregate_type header (its aggregate id is the key).
	aggType []byte
	// lane is the transactional producer it went to (exactly-once), whose
	// open transaction it is in.
	lane *lane
}

func recordOf(r *kgo.Record) *outRecord { return (*outRecord)(unsafe.Pointer(r)) }

func (r *Router) newRecord(ev *decoder.Event, t *topic, a Acker) *outRecord {
	return r.newRecordValue(ev, t, a, ev.Payload)
}

// newRecordValue is newRecord with value, which Config.Values made from
// the payload, as the record's value.
func (r *Router) newRecordValue(ev *decoder.Event, t *topic, a Acker, value []byte) *outRecord {
	o := &outRecord{topic: t, ack: a, aggType: ev.AggregateType}
	o.rec.Topic = t.name
	o.rec.Key = ev.AggregateID
	o.rec.Value = value
	o.rec.Timestamp = ev.CommitTime
	h := o.hdrs[:0]
	h = append(h, kgo.RecordHeader{Key: r.cfg.HeaderID, Value: ev.ID})
	if ev.Type != nil {
		h = append(h, kgo.RecordHeader{Key: r.cfg.HeaderType, Value: ev.Type})
	}
	for _, x := range ev.Headers {
		if x.Value != nil {
			h = append(h, kgo.RecordHeader{Key: x.Key, Value: x.Value})
		}
	}
	o.rec.Headers = h
	o.size = topics.RecordSize(o.rec.Key, o.rec.Value, h)
	return o
}

// onPromise runs on the producer's promise goroutine, once per record.
func (r *Router) onPromise(rec *kgo.Record, err error) {
	o := recordOf(rec)
	r.gate.release(o.size)
	if err != nil {
		if o.lane != nil {
			if err = o.lane.fenceError(r.cfg.TransactionTimeout, err); errors.Is(err, ErrFenced) || errors.Is(err, ErrTxnTimedOut) {
				r.fail(fmt.Errorf("produce to %s: %w", rec.Topic, err))
				return
			}
		}
		if errors.Is(err, kerr.InvalidTimestamp) {
			r.refusedTimestamp(o, err)
			return
		}
		if d := r.denial(err, rec.Topic); d != nil {
			// Not the record's fault: never acked, so nothing is
			// confirmed past it; the next router finds the denial
			// before producing and waits (denied.go). Counted and
			// logged once per router: every record in flight fails
			// alike.
			if r.deniedOnce.CompareAndSwap(false, true) {
				if d.Resource == resourceTopic {
					o.topic.denied.Store(true)
				}
				r.deny(d)
			}
			r.fail(d)
			return
		}
		if topics.RefusedForGood(err) && o.topic != r.dlq && o.table != nil {
			r.redirect(o, err)
			return
		}
		if errors.Is(err, kerr.UnknownTopicOrPartition) && !r.cfg.CreateTopics {
			// A broker with auto.create.topics.enable=false: retrying
			// cannot help until someone creates the topic.
			err = fmt.Errorf("the topic does not exist: create it, or turn on router.Config.CreateTopics: %w", err)
		}
		r.fail(fmt.Errorf("produce to %s: %w", rec.Topic, err))
		return
	}
	o.topic.published.Inc()
	if o.topic.denied.Load() && o.topic.denied.CompareAndSwap(true, false) {
		r.granted(resourceTopic, o.topic.name) // Kafka took a record of it: allowed again
	}
	if r.cfg.OnPublished != nil {
		r.cfg.OnPublished(rec)
	}
	if r.txn == nil {
		o.ack.Ack() // exactly-once acks at the Kafka transaction's commit
		return
	}
	o.lane.first.note(o.topic, rec)
}

// fail records the first error Kafka returned for good and tells the
// fatal handler.
func (r *Router) fail(err error) {
	r.metrics.ProduceErrors.Inc()
	if r.failed.CompareAndSwap(false, true) {
		r.failErr.Store(&err)
		r.fatal(err)
	}
}

// produce hands a built record to the producer: one more in flight, one
// more pending on its transaction; with exactly-once delivery, inside the
// open Kafka transaction (begun here when none is).
func (r *Router) produce(o *outRecord) error {
	client := r.client
	if r.txn != nil {
		if err := r.txn.begin(); err != nil {
			return err
		}
		r.txn.track(o.ack)
		o.lane = r.txn.lane()
		if r.tracer != nil {
			o.lane.traced = append(o.lane.traced, &o.rec)
		}
		client = o.lane.client
	}
	r.gate.acquire(o.size)
	o.ack.Add()
	client.TryProduce(context.Background(), &o.rec, r.promise)
	return nil
}

// Failed reports whether Kafka refused a record for good, or (exactly-once)
// a transactional call failed; the router should then be closed and
// replaced: franz-go keeps a transactional producer whose commit or abort
// failed in an error state that only a new producer ID clears.
func (r *Router) Failed() bool { return r.failed.Load() || r.txn != nil && r.txn.broken.Load() }

// Txn is the transactional producer of a router made with a
// TransactionalID (exactly-once delivery), nil otherwise.
func (r *Router) Txn() *Txn { return r.txn }

// Err returns the error Kafka refused a record with for good (what made
// Failed true), or nil.
func (r *Router) Err() error {
	if p := r.failErr.Load(); p != nil {
		return *p
	}
	return nil
}

// Flush waits until every record sent so far is acknowledged or failed, or
// ctx ends.
func (r *Router) Flush(ctx context.Context) error {
	if r.txn == nil {
		return r.client.Flush(ctx)
	}
	for _, l := range r.txn.lanes {
		if err := l.client.Flush(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Inflight returns how many records are produced and not yet acknowledged.
func (r *Router) Inflight() int64 { return r.gate.events.Load() }

// Preparing returns how many topic preparations (metadata, creation,
// configuration) are under way: the first event for a topic waits on one
// with no record in flight.
func (r *Router) Preparing() int64 { return r.preparing.Load() }

// Answered returns how many records, and topic preparations, Kafka has
// answered for since the router was made, acknowledged or refused: while
// records are in flight or topics prepared, a count that stops moving is
// a broker that does not answer.
func (r *Router) Answered() uint64 { return r.gate.answered.Load() }

// Ping reaches a broker with the producer's connection settings: an
// unreachable broker, a wrong SASL password or an untrusted certificate
// fails here rather than later, in a produce.
func (r *Router) Ping(ctx context.Context) error { return classify(r.client.Ping(ctx)) }

// Close ends the topic preparations in progress and waits for them, then
// closes the Kafka clients; records not yet acknowledged fail.
func (r *Router) Close() {
	r.close()
	r.bg.Wait()
	if r.txn == nil {
		r.client.Close()
		return
	}
	for _, l := range r.txn.lanes {
		l.client.Close()
	}
}
