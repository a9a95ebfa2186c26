package inbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
)

// Message is a record being handled.
type Message struct {
	// ID is the record's id header: the outbox event id.
	ID string
	// Record is the Kafka record (topic, key, value, headers, offset).
	Record *kgo.Record
	// Attempt is 1 on the first try, and counts tries across restarts.
	Attempt int

	consumer string
}

// IdempotencyKey is a key for an effect outside the database (step names
// it, e.g. "email" or "charge"): the same for every copy and every retry
// of this message in this consumer, different for other messages,
// consumers and steps. Send it as the other system's idempotency key.
func (m *Message) IdempotencyKey(step string) string {
	return IdempotencyKey(m.consumer, m.ID, step)
}

// IdempotencyKey is Message.IdempotencyKey for a consumer and message id
// known outside a handler (a worker performing the effect later): 32 hex
// digits of a SHA-256 of the three parts.
func IdempotencyKey(consumer, messageID, step string) string {
	h := sha256.New()
	for _, s := range []string{consumer, messageID, step} {
		h.Write([]byte(strconv.Itoa(len(s)) + ":" + s))
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// Handler applies one message inside tx, the transaction that also
// records it in the inbox. Its database effects must go through tx (and
// may include outbox events); it must not commit or roll back tx itself.
// The transaction is shared by a batch of messages of one partition
// (Config.MaxBatchRecords), handled one after the other in offset order.
// An error rolls the batch back: the messages before this one are applied
// again, in a new transaction, without it (their handlers run again), and
// this one is tried again on its own after a pause.
type Handler func(ctx context.Context, tx pgx.Tx, m *Message) error

// Config configures a Consumer.
type Config struct {
	// Group is the Kafka consumer group (required).
	Group string
	// Name identifies this consumer's effects in the inbox table (default
	// Group). Two services applying their own effects of the same events
	// need different names; instances of one service share one.
	Name string
	// Topics to consume (required).
	Topics []string
	// KafkaOptions connect the client: seed brokers, TLS, SASL, and
	// kgo.FetchIsolationLevel(kgo.ReadCommitted()) behind an exactly-once
	// relay. Group, topic and commit options are set by the Consumer.
	KafkaOptions []kgo.Opt
	// DB is the database of the inbox table and of the handler's effects
	// (required).
	DB *pgxpool.Pool
	// Table is the inbox table (default "inbox"); see DDL.
	Table string
	// MaxAttempts is how often a record's handler may fail before the
	// record is dead-lettered (default 5).
	MaxAttempts int
	// DeadLetterTopic receives records that failed MaxAttempts times or
	// have no id header (default Group + ".dlq"). It must exist, or the
	// brokers must create topics on produce.
	DeadLetterTopic string
	// RetryBackoff is the pause after a first failure; it doubles up to
	// MaxRetryBackoff (defaults 100ms and 5s). Retries happen in place, so
	// MaxAttempts pauses should stay well under the group's rebalance
	// timeout (kgo default 60s).
	RetryBackoff, MaxRetryBackoff time.Duration
	// Retention is how long inbox rows are kept (default 14 days; see the
	// package documentation for the rule); negative disables pruning.
	Retention time.Duration
	// PruneInterval is the time between prunes in Run (default 1h).
	PruneInterval time.Duration
	// MaxBatchRecords bounds the records of one partition handled in one
	// transaction (default 500; 1 gives each record a transaction of its
	// own). A batch takes what was read for its partition when it starts,
	// never waiting for more, so batches are as large as the consumer is
	// behind: one record each when it keeps up, and up to this bound when
	// it catches up. Larger batches spread the transaction's cost (its
	// commit, the inbox rows in one statement, the position moved once)
	// over more records; a handler error rolls its batch back and the
	// records before it are handled again, and a batch's row locks are
	// held until it commits.
	MaxBatchRecords int
	// MaxBatchBytes bounds the keys and values of a batch's records
	// (default 1 MiB; a record larger than it is a batch of its own).
	MaxBatchBytes int
	// MaxBatchTime bounds the time a batch's handlers run: once it is
	// spent, the batch commits what it handled and the rest of its
	// records go to the next batch (default 100ms; negative: no bound).
	// It bounds how long a record's effect waits for the records handled
	// after it in the same transaction, and how long a rebalance or a
	// stop waits for the batch in flight, when handlers are slow.
	MaxBatchTime time.Duration
	// Workers is how many partitions are handled at once, each in a
	// transaction of its own on a connection of DB (default 4). A
	// partition is handled by one worker at a time, in offset order.
	// More workers than DB's connections (pgxpool's MaxConns) only wait
	// for them.
	Workers int
	// MaxPollRecords bounds the records read ahead of the handlers, all
	// partitions together (default 5000): the consumer fetches again once
	// fewer are waiting. One fetch may bring more than that (the client's
	// kgo.FetchMaxBytes bounds it); a partition whose handler is retrying
	// a record holds the others back once that many of its records wait.
	// A revoked partition's waiting records are dropped, not handled: the
	// next owner reads them from the database's position.
	MaxPollRecords int
	// CommitInterval is the shortest time between two Kafka offset
	// commits (default 1s). The consumer starts each partition from the
	// position in its database, so Kafka's committed offsets only inform
	// the tools that read them (group lag); a rebalance and a stop commit
	// at once.
	CommitInterval time.Duration
	// PositionCheckInterval is how often the consumer compares the
	// positions in the database with its own (default 10s; negative
	// disables), so that a database failover that lost the newest
	// transactions is noticed on a partition no new record comes to: a
	// partition's next record finds it anyway (see Positions).
	PositionCheckInterval time.Duration
	// Logger (default none).
	Logger *zap.Logger
	// Registerer receives the inbox_* metrics (default none); several
	// consumers may share one.
	Registerer prometheus.Registerer
	// TracerProvider makes a consumer span per handled message, the child
	// of the trace context the record carries, in the handler's ctx
	// (default: the program's global provider, otel.GetTracerProvider,
	// which records nothing until the program installs an SDK).
	TracerProvider trace.TracerProvider
	// Propagator reads a record's trace context (default: the program's
	// global propagator, or W3C trace context, what walrelay's records
	// carry, when it set none).
	Propagator propagation.TextMapPropagator
}

// Consumer is a consumer group member that handles each message once.
// Create it with New and call Run once.
type Consumer struct {
	cfg     Config
	handle  Handler
	tracer  trace.Tracer
	log     *zap.Logger
	m       *metrics
	inbox   string // quoted table names
	attempt string
	offsets string
	runCtx  context.Context // Run's

	mu   sync.Mutex
	cond *sync.Cond // on mu: a partition's queue, batch or state changed
	// parts are the partitions this member consumes (parts.go); ready,
	// those waiting for a worker, in line; held, the records read ahead of
	// the handlers, all queues together.
	parts    map[topicPartition]*part
	ready    []*part
	held     int
	stopping bool // the workers return
	// suspects are partitions whose database position the check found
	// elsewhere than this member's; wake ends the poll in progress so that
	// the polling goroutine rewinds them, or commits (commitDue).
	suspects    []topicPartition
	wake        context.CancelFunc
	commitDue   bool
	commitTimer *time.Timer
	lastCommit  time.Time
}

// New checks cfg and returns a Consumer; errors name the missing field.
func New(cfg Config, h Handler) (*Consumer, error) {
	switch {
	case h == nil:
		return nil, errors.New("inbox: New needs a Handler")
	case cfg.Group == "":
		return nil, errors.New("inbox: Config.Group is required")
	case len(cfg.Topics) == 0:
		return nil, errors.New("inbox: Config.Topics is required")
	case cfg.DB == nil:
		return nil, errors.New("inbox: Config.DB is required (a pgxpool.Pool)")
	}
	cfg = cfg.WithDefaults()
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	c := &Consumer{cfg: cfg, handle: h, log: log.With(zap.String("consumer", cfg.Name)), m: newMetrics(cfg.Registerer),
		parts: map[topicPartition]*part{}}
	c.cond = sync.NewCond(&c.mu)
	c.inbox, c.attempt, c.offsets = tableNames(cfg.Table)
	c.tracer = c.newTracer()
	return c, nil
}

// WithDefaults returns cfg with each field left zero (unset, for the
// fields where a negative value disables) at its default: the one place
// the defaults named in Config's docs are set. New applies it; a program
// may call it to show or log the configuration a Consumer runs with.
func (cfg Config) WithDefaults() Config {
	if cfg.Name == "" {
		cfg.Name = cfg.Group
	}
	if cfg.Table == "" {
		cfg.Table = "inbox"
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 5
	}
	if cfg.DeadLetterTopic == "" {
		cfg.DeadLetterTopic = cfg.Group + ".dlq"
	}
	if cfg.RetryBackoff <= 0 {
		cfg.RetryBackoff = 100 * time.Millisecond
	}
	if cfg.MaxRetryBackoff <= 0 {
		cfg.MaxRetryBackoff = 5 * time.Second
	}
	if cfg.Retention == 0 {
		cfg.Retention = 14 * 24 * time.Hour
	}
	if cfg.PruneInterval <= 0 {
		cfg.PruneInterval = time.Hour
	}
	if cfg.MaxBatchRecords <= 0 {
		cfg.MaxBatchRecords = 500
	}
	if cfg.MaxBatchBytes <= 0 {
		cfg.MaxBatchBytes = 1 << 20
	}
	if cfg.MaxBatchTime == 0 {
		cfg.MaxBatchTime = 100 * time.Millisecond
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 4
	}
	if cfg.MaxPollRecords <= 0 {
		cfg.MaxPollRecords = 5000
	}
	if cfg.CommitInterval <= 0 {
		cfg.CommitInterval = time.Second
	}
	if cfg.PositionCheckInterval == 0 {
		cfg.PositionCheckInterval = 10 * time.Second
	}
	return cfg
}

// Run consumes until ctx ends, then commits the offsets of what was
// handled, leaves the group and returns nil. When ctx ends, each batch in
// flight commits the records whose handlers returned before the stop,
// unless a handler was still running: its statements, interrupted, leave
// the transaction unusable, and the batch is rolled back whole. What was
// rolled back comes again to the next consumer. It returns an error when
// the offsets table is missing (run DDL again) or the Kafka client cannot
// be created.
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.checkTables(ctx); err != nil {
		return err
	}
	c.runCtx = ctx
	opts := append(append([]kgo.Opt(nil), c.cfg.KafkaOptions...),
		kgo.ConsumerGroup(c.cfg.Group),
		kgo.ConsumeTopics(c.cfg.Topics...),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.AdjustFetchOffsetsFn(c.adjust),
		kgo.OnPartitionsRevoked(c.revoked),
		kgo.OnPartitionsLost(c.lost),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("inbox: kafka client: %w", err)
	}
	defer cl.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	pctx, stopPrune := context.WithCancel(ctx)
	defer stopPrune()
	if c.cfg.Retention > 0 {
		wg.Go(func() { c.pruneLoop(pctx) })
	}
	if c.cfg.PositionCheckInterval > 0 {
		wg.Go(func() { c.checkLoop(pctx) })
	}
	// Waits on c.cond end with ctx.
	defer context.AfterFunc(ctx, func() {
		c.mu.Lock()
		c.cond.Broadcast()
		c.mu.Unlock()
	})()
	var workers sync.WaitGroup
	for range c.cfg.Workers {
		workers.Go(func() {
			c.work(func(p *part, recs []*kgo.Record) []*kgo.Record { return c.handlePart(cl, p, recs) })
		})
	}

	c.poll(ctx, cl)

	// Rebalances blocked (a poll with an ended context blocks them
	// without taking records), the workers done (the batches in flight
	// end with ctx): the offsets of what committed in the database.
	cl.PollRecords(ended, 0)
	c.stopWorkers()
	workers.Wait()
	c.mu.Lock()
	if c.commitTimer != nil {
		c.commitTimer.Stop()
	}
	c.mu.Unlock()
	cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c.commit(cctx, cl, nil)
	cl.AllowRebalance()
	return nil
}

// ended is a context that has ended: a poll with it returns at once,
// blocking rebalances until AllowRebalance.
var ended = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// poll is the polling goroutine's loop, until ctx ends: it reads records
// ahead of the workers (up to Config.MaxPollRecords waiting), and, while
// rebalances are blocked (between a poll and AllowRebalance), does what
// must not run beside a rebalance: rewinds and Kafka offset commits.
func (c *Consumer) poll(ctx context.Context, cl *kgo.Client) {
	for {
		pollCtx := ended // no room: block rebalances only, for pending work
		if c.waitRoom(ctx) {
			pollCtx = c.pollContext(ctx)
		}
		if ctx.Err() != nil {
			return
		}
		fs := cl.PollRecords(pollCtx, 0)
		if ctx.Err() != nil || fs.IsClientClosed() {
			return
		}
		woken := pollCtx.Err() != nil // to commit or rewind
		rewound := c.rewinds(ctx, cl)
		fs.EachError(func(t string, p int32, err error) {
			if !woken || !errors.Is(err, context.Canceled) {
				c.log.Warn("fetch error (the client retries)", zap.String("topic", t), zap.Int32("partition", p), zap.Error(err))
			}
		})
		if fs.NumRecords() == 0 && len(fs.Errors()) > 0 && !woken {
			// Errors that come back at once (authorization, an unknown
			// group) must not spin the loop.
			cl.AllowRebalance()
			select {
			case <-ctx.Done():
			case <-time.After(c.cfg.MaxRetryBackoff):
			}
			continue
		}
		c.dispatch(fs, rewound)
		c.mu.Lock()
		due := c.commitDue
		c.mu.Unlock()
		if due {
			c.commit(ctx, cl, nil)
		}
		cl.AllowRebalance()
	}
}

// commit commits the offsets after the handled records of the partitions
// (all when nil, which also starts the next Config.CommitInterval), and
// the database's positions Kafka must follow. It runs while no rebalance
// can: on the polling goroutine before AllowRebalance, or in a rebalance
// callback. A failure is logged: Kafka's offsets only inform the tools
// that read them (lag), the consumer starts from the database's.
func (c *Consumer) commit(ctx context.Context, cl *kgo.Client, parts []*part) {
	offsets := map[string]map[int32]kgo.EpochOffset{}
	type taken struct {
		p         *part
		done      *kgo.Record
		follow    int64
		following bool
	}
	var took []taken
	c.mu.Lock()
	if parts == nil {
		for _, p := range c.parts {
			parts = append(parts, p)
		}
		c.commitDue = false
		c.lastCommit = time.Now()
	}
	for _, p := range parts {
		o := kgo.EpochOffset{Epoch: -1, Offset: p.follow}
		switch {
		case p.lost || p.done == nil && !p.following:
			continue
		case p.done != nil:
			o = kgo.EpochOffset{Epoch: p.done.LeaderEpoch, Offset: p.done.Offset + 1}
		}
		if offsets[p.topic] == nil {
			offsets[p.topic] = map[int32]kgo.EpochOffset{}
		}
		offsets[p.topic][p.partition] = o
		took = append(took, taken{p, p.done, p.follow, p.following})
		p.done, p.following = nil, false
	}
	c.mu.Unlock()
	if len(offsets) == 0 {
		return
	}
	var err error
	cl.CommitOffsetsSync(ctx, offsets, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, cerr error) {
		if err = cerr; err != nil {
			return
		}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				if err == nil {
					err = kerr.ErrorForCode(p.ErrorCode)
				}
			}
		}
	})
	if err != nil {
		// The next commit (the last one at a stop) tries them again,
		// unless a later record or position replaced them meanwhile.
		c.mu.Lock()
		for _, t := range took {
			if t.p.done == nil && !t.p.following {
				t.p.done, t.p.follow, t.p.following = t.done, t.follow, t.following
			}
		}
		c.mu.Unlock()
		c.log.Warn("Kafka offset commit failed: consumer-group lag tools show this group behind until the next one (the consumer itself starts from the positions in its database)", zap.Error(err))
	}
}

// revoked commits what was handled in the partitions being taken away,
// after their batches in flight; what was read ahead for them is dropped.
// Polls and this callback exclude each other (BlockRebalanceOnPoll), so
// no commit or rewind of the polling goroutine runs meanwhile.
func (c *Consumer) revoked(ctx context.Context, cl *kgo.Client, ps map[string][]int32) {
	if parts := c.giveUp(ps, false); len(parts) > 0 {
		c.commit(ctx, cl, parts)
	}
	c.dropLag(ps)
}

// lost forgets the partitions: another member owns them now, and
// committing for them could move its offsets back. Their batches in
// flight are cancelled (rolled back unless committing already).
func (c *Consumer) lost(_ context.Context, _ *kgo.Client, ps map[string][]int32) {
	c.giveUp(ps, true)
	c.dropLag(ps)
}

func (c *Consumer) dropLag(ps map[string][]int32) {
	for t, parts := range ps {
		for _, p := range parts {
			c.m.lag.DeleteLabelValues(c.cfg.Name, t, strconv.Itoa(int(p)))
		}
	}
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// processed is how process left a record.
type processed int

const (
	done    processed = iota // committed, duplicate or dead-lettered: the partition moves on
	stopped                  // ctx ended first
	moved                    // the database's position of the partition is not this member's: rewind
)

// process handles r on its own, one transaction per try, until it is
// done (committed, duplicate or dead-lettered), ctx ends, or its
// transaction finds the partition's position in the database elsewhere
// than this member left it: the way of a record without an id, of one
// whose handler failed in a batch (pause: after a pause, as between two
// tries), and of one whose attempts are used up. ctx carries r's span.
func (c *Consumer) process(ctx context.Context, cl *kgo.Client, p *part, r *kgo.Record, id string, pause bool) processed {
	if id == "" {
		return c.deadLetter(ctx, cl, p, r, "", "no-id", "the record has no id header, so its copies cannot be recognised", 0)
	}
	wait := c.backoff()
	if pause && !wait.wait(ctx) {
		return stopped
	}
	for {
		out, err := c.try(ctx, p, r, id)
		// A record whose transaction committed is done even when the
		// stop came meanwhile: its offset must be committed with the
		// others, or the next consumer meets it again.
		if out.duplicate {
			c.m.duplicates.WithLabelValues(c.cfg.Name).Inc()
			markDuplicate(ctx)
		}
		switch out.kind {
		case handled:
			c.m.processed.WithLabelValues(c.cfg.Name).Inc()
			return done
		case duplicate:
			return done
		case positionMoved:
			return moved
		}
		if ctx.Err() != nil {
			return stopped
		}
		switch out.kind {
		case exhausted:
			return c.deadLetter(ctx, cl, p, r, id, "handler-failed", out.lastError, out.attempts)
		case dbError:
			c.dbFailed(id, err)
		case failed:
			if n, ok := c.failed(ctx, id, err); ok && n >= c.cfg.MaxAttempts {
				return c.deadLetter(ctx, cl, p, r, id, "handler-failed", err.Error(), n)
			}
		}
		if !wait.wait(ctx) {
			return stopped
		}
	}
}

// dbFailed counts and logs a transaction that failed for the database's
// reason, retried without counting an attempt.
func (c *Consumer) dbFailed(id string, err error) {
	c.m.dbErrors.WithLabelValues(c.cfg.Name).Inc()
	c.log.Warn("inbox transaction failed; retrying without counting an attempt", zap.String("id", id), zap.Error(err))
}

// failed counts a handler's failure of message id as an attempt (ctx
// carries the message's span) and returns the attempts so far; ok is
// false when the count could not be recorded.
func (c *Consumer) failed(ctx context.Context, id string, err error) (n int, ok bool) {
	c.m.failures.WithLabelValues(c.cfg.Name).Inc()
	n, ferr := c.countFailure(ctx, id, err)
	if ferr != nil {
		c.m.dbErrors.WithLabelValues(c.cfg.Name).Inc()
		c.log.Warn("handler failed and its attempt could not be recorded; retrying", zap.String("id", id), zap.NamedError("handler_error", err), zap.Error(ferr))
		return 0, false
	}
	c.log.Warn("handler failed", zap.String("id", id), zap.Int("attempt", n), zap.Int("max_attempts", c.cfg.MaxAttempts), zap.Error(err))
	markFailure(ctx, err, n)
	return n, true
}

type outcomeKind int

const (
	handled outcomeKind = iota
	duplicate
	exhausted     // earlier runs used up the attempts (and died before dead-lettering)
	failed        // the handler returned an error
	dbError       // the database failed: try again
	positionMoved // the partition's position in the database is not where this member left it
)

type outcome struct {
	kind      outcomeKind
	duplicate bool // the id was in the inbox already
	attempts  int
	lastError string
}

// try runs one attempt: the inbox INSERT, the move of the partition's
// position and the handler in one transaction.
func (c *Consumer) try(ctx context.Context, p *part, r *kgo.Record, id string) (outcome, error) {
	tx, err := c.cfg.DB.Begin(ctx)
	if err != nil {
		return outcome{kind: dbError}, err
	}
	defer tx.Rollback(context.Background())
	b := &pgx.Batch{}
	// The inbox INSERT first: a concurrent copy of the message waits on
	// the first one's row and then finds it.
	b.Queue("INSERT INTO "+c.inbox+" (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING", c.cfg.Name, id)
	b.Queue("SELECT attempts, last_error FROM "+c.attempt+" WHERE consumer = $1 AND message_id = $2", c.cfg.Name, id)
	c.queueAdvance(b, p, r)
	br := tx.SendBatch(ctx, b)
	tag, err := br.Exec()
	if err != nil {
		br.Close()
		return outcome{kind: dbError}, err
	}
	var prior int
	var lastError string
	if err := br.QueryRow().Scan(&prior, &lastError); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		br.Close()
		return outcome{kind: dbError}, err
	}
	adv, err := br.Exec()
	if err != nil {
		br.Close()
		return outcome{kind: dbError}, err
	}
	if err := br.Close(); err != nil {
		return outcome{kind: dbError}, err
	}
	dup := tag.RowsAffected() == 0
	if adv.RowsAffected() == 0 {
		return outcome{kind: positionMoved, duplicate: dup}, nil
	}
	if dup {
		// Only the position moves; it must commit, or the next record's
		// transaction would find the database's position behind.
		if err := c.commitTx(ctx, tx, p, r); err != nil {
			return outcome{kind: dbError}, err
		}
		return outcome{kind: duplicate, duplicate: true}, nil
	}
	if prior >= c.cfg.MaxAttempts {
		return outcome{kind: exhausted, attempts: prior, lastError: lastError}, nil
	}
	m := &Message{ID: id, Record: r, Attempt: prior + 1, consumer: c.cfg.Name}
	if err := c.call(ctx, tx, m); err != nil {
		if transient(tx, err) {
			return outcome{kind: dbError}, err
		}
		return outcome{kind: failed}, err
	}
	if prior > 0 {
		if _, err := tx.Exec(ctx, "DELETE FROM "+c.attempt+" WHERE consumer = $1 AND message_id = $2", c.cfg.Name, id); err != nil {
			return outcome{kind: dbError}, err
		}
	}
	if err := c.commitTx(ctx, tx, p, r); err != nil {
		return outcome{kind: dbError}, err
	}
	return outcome{kind: handled}, nil
}

// commitTx commits a transaction that moved r's partition's position past
// r, and then moves this member's position with it. The handler returned
// nil: the transaction commits whole even when a stop lands now (a commit
// cancelled half-way would leave whether it committed unknown to this
// consumer). Committed or not after an error, the next try finds out: the
// position moved in the database (a rewind past r) or it did not.
func (c *Consumer) commitTx(ctx context.Context, tx pgx.Tx, p *part, r *kgo.Record) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if err := tx.Commit(cctx); err != nil {
		return err
	}
	c.setPosition(p, r.Offset+1, true)
	return nil
}

// commitTimeout bounds the commit of a handled record's transaction, which
// a stop does not cancel: a database that stopped answering cannot hold
// the consumer's exit for longer.
const commitTimeout = 10 * time.Second

// transient reports whether a handler error is the database's rather than
// the record's: a lost connection, a serialization failure or deadlock
// (class 40), an operator intervention such as a shutdown (class 57).
// Those are retried without counting an attempt, so that an outage does
// not dead-letter good records.
func transient(tx pgx.Tx, err error) bool {
	if tx.Conn().IsClosed() {
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return strings.HasPrefix(pe.Code, "40") || strings.HasPrefix(pe.Code, "08") || strings.HasPrefix(pe.Code, "57")
	}
	return pgconn.Timeout(err)
}

// call runs the handler, turning a panic into an error so that one bad
// record is dead-lettered instead of crashing every member in turn.
func (c *Consumer) call(ctx context.Context, tx pgx.Tx, m *Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("handler panicked: %v", p)
		}
	}()
	return c.handle(ctx, tx, m)
}

// countFailure records a failed attempt outside the rolled-back
// transaction and returns the count so far.
func (c *Consumer) countFailure(ctx context.Context, id string, herr error) (int, error) {
	var n int
	err := c.cfg.DB.QueryRow(ctx, "INSERT INTO "+c.attempt+` AS a (consumer, message_id, attempts, last_error) VALUES ($1, $2, 1, $3)
		ON CONFLICT (consumer, message_id) DO UPDATE SET attempts = a.attempts + 1, last_error = excluded.last_error, updated_at = now()
		RETURNING attempts`, c.cfg.Name, id, herr.Error()).Scan(&n)
	return n, err
}

// deadLetter produces r to the dead-letter topic and then records id as
// dead-lettered and moves the partition's position past r, retrying until
// they succeed, ctx ends, or the position is found moved. A crash between
// the two sends the record to the dead-letter topic again on redelivery,
// with the same id header.
func (c *Consumer) deadLetter(ctx context.Context, cl *kgo.Client, p *part, r *kgo.Record, id, reason, why string, attempts int) processed {
	dl := &kgo.Record{Topic: c.cfg.DeadLetterTopic, Key: r.Key, Value: r.Value, Timestamp: r.Timestamp}
	dl.Headers = append(append(dl.Headers, r.Headers...),
		kgo.RecordHeader{Key: "inbox.reason", Value: []byte(reason)},
		kgo.RecordHeader{Key: "inbox.error", Value: []byte(why)},
		kgo.RecordHeader{Key: "inbox.attempts", Value: []byte(strconv.Itoa(attempts))},
		kgo.RecordHeader{Key: "inbox.consumer", Value: []byte(c.cfg.Name)},
		kgo.RecordHeader{Key: "inbox.topic", Value: []byte(r.Topic)},
		kgo.RecordHeader{Key: "inbox.partition", Value: []byte(strconv.Itoa(int(r.Partition)))},
		kgo.RecordHeader{Key: "inbox.offset", Value: []byte(strconv.FormatInt(r.Offset, 10))},
	)
	pause := c.backoff()
	for {
		err := cl.ProduceSync(ctx, dl).FirstErr()
		if err == nil {
			var ok bool
			ok, err = c.recordDeadLetter(ctx, p, r, id)
			if err == nil && !ok {
				return moved
			}
		}
		if err == nil {
			c.m.deadLettered.WithLabelValues(c.cfg.Name, reason).Inc()
			markDeadLettered(ctx, reason, why)
			c.log.Error("record dead-lettered; the partition moves on", zap.String("id", id), zap.String("reason", reason),
				zap.String("error", why), zap.Int("attempts", attempts), zap.String("topic", r.Topic), zap.Int32("partition", r.Partition),
				zap.Int64("offset", r.Offset), zap.String("dead_letter_topic", c.cfg.DeadLetterTopic))
			return done
		}
		c.log.Warn("dead-lettering failed; retrying (if the topic is missing, create it or let the brokers create topics)", zap.String("id", id), zap.String("dead_letter_topic", c.cfg.DeadLetterTopic), zap.Error(err))
		if !pause.wait(ctx) {
			return stopped
		}
	}
}

// backoff is the pause between retries of what the database or the broker
// failed: Config.RetryBackoff, doubling up to Config.MaxRetryBackoff.
type backoff struct{ next, max time.Duration }

func (c *Consumer) backoff() *backoff {
	return &backoff{next: c.cfg.RetryBackoff, max: c.cfg.MaxRetryBackoff}
}

// wait pauses; false when ctx ended first.
func (b *backoff) wait(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(b.next):
	}
	b.next = min(2*b.next, b.max)
	return true
}

// recordDeadLetter records id (when r has one) as dead-lettered and moves
// the partition's position past r, in one transaction; ok is false when
// the position was found moved.
func (c *Consumer) recordDeadLetter(ctx context.Context, p *part, r *kgo.Record, id string) (ok bool, err error) {
	tx, err := c.cfg.DB.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(context.Background())
	b := &pgx.Batch{}
	c.queueAdvance(b, p, r)
	if id != "" {
		b.Queue("WITH d AS (DELETE FROM "+c.attempt+" WHERE consumer = $1 AND message_id = $2) INSERT INTO "+c.inbox+
			" (consumer, message_id, outcome) VALUES ($1, $2, 'dead-lettered') ON CONFLICT DO NOTHING", c.cfg.Name, id)
	}
	br := tx.SendBatch(ctx, b)
	adv, err := br.Exec()
	if err == nil && id != "" {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil || adv.RowsAffected() == 0 {
		return false, err
	}
	return true, c.commitTx(ctx, tx, p, r)
}

// Prune deletes this consumer's inbox rows (and stale attempt counts)
// older than Config.Retention, in batches, and returns how many inbox rows
// it deleted.
func (c *Consumer) Prune(ctx context.Context) (int64, error) {
	if c.cfg.Retention <= 0 {
		return 0, nil
	}
	before := time.Now().Add(-c.cfg.Retention)
	var total int64
	for {
		tag, err := c.cfg.DB.Exec(ctx, "DELETE FROM "+c.inbox+" WHERE ctid IN (SELECT ctid FROM "+c.inbox+
			" WHERE consumer = $1 AND processed_at < $2 LIMIT 10000)", c.cfg.Name, before)
		if err != nil {
			return total, fmt.Errorf("inbox: prune %s: %w", c.cfg.Table, err)
		}
		total += tag.RowsAffected()
		c.m.pruned.WithLabelValues(c.cfg.Name).Add(float64(tag.RowsAffected()))
		if tag.RowsAffected() < 10000 {
			break
		}
	}
	if _, err := c.cfg.DB.Exec(ctx, "DELETE FROM "+c.attempt+" WHERE consumer = $1 AND updated_at < $2", c.cfg.Name, before); err != nil {
		return total, fmt.Errorf("inbox: prune %s_attempts: %w", c.cfg.Table, err)
	}
	return total, nil
}

func (c *Consumer) pruneLoop(ctx context.Context) {
	t := time.NewTicker(c.cfg.PruneInterval)
	defer t.Stop()
	for {
		if n, err := c.Prune(ctx); err != nil && ctx.Err() == nil {
			c.log.Warn("inbox retention failed; it runs again next interval", zap.Error(err))
		} else if n > 0 {
			c.log.Info("inbox rows pruned", zap.Int64("rows", n), zap.Duration("retention", c.cfg.Retention))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
