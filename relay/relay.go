// Package relay wires walrelay's pipeline together and keeps it running:
//
//	slot (replication stream) → decoder → router (Kafka) → acks → checkpoint → slot (standby status)
//
// Run prepares the source database, then runs sessions: one replication
// stream each, from the last confirmed position. A session ends when the
// connection breaks, Kafka refuses a record for good, or Run's context ends;
// the next one starts after a capped, jittered backoff. Nothing carries over
// between sessions but the confirmed position, so every restart is the same
// simple, safe path: duplicates after it, never loss.
//
// A session (session.go, opened in start.go) reads the stream, decodes it
// and hands each PostgreSQL transaction to a delivery (delivery.go): Begin,
// Event per outbox insert, Commit, Tick between messages, Close at the end.
// The delivery decides when a transaction counts as acknowledged, which is
// all the session's checkpoint needs to know. atLeastOnce acks a
// transaction once Kafka has each of its records; exactlyOnce
// (exactlyonce.go) produces in Kafka transactions, each closed by a
// checkpoint record, acks at their commit, and after a restart skips what
// the newest checkpoint covers. The session never asks which one it has,
// and unit tests drive it with a fake stream and a fake producer.
//
// The pipeline lives here rather than in cmd/walrelay so that integration
// tests, `walrelay dev` and the benchmark run the very code the daemon runs.
//
// DefaultConfig is the one definition of walrelay's defaults: the flags of
// `walrelay run` and `walrelay dev` take theirs from it, so an embedder
// that starts from it runs with the daemon's configuration. It is a
// function rather than "zero means the default" because several defaults
// are on (the initial snapshot, creating the slot and the publication,
// creating topics) and several zeros mean something (no heartbeat, no
// readiness lag check, commit at once): with zero as the default each of
// those would need an inverted field or a negative stand-in, and a zero
// would mean two things. So a field holds what it means, and New refuses a
// zero where only a positive value works, naming the field and its
// default.
package relay

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/schema"
	"github.com/walrelay/walrelay/slot"
)

// Config configures a Relay. Start from DefaultConfig: a field holds the
// value it means, so a zero is zero (off, none, at once), never "the
// default"; New refuses a zero where only a positive value works. Each
// field's documentation names its default, the value DefaultConfig sets.
type Config struct {
	// PGURL is the source database; the replication connection is derived
	// from it. Required: no default.
	PGURL string
	// Slot is the logical replication slot (pgoutput); default "walrelay".
	Slot string
	// Publication is the publication the slot streams; default
	// "walrelay_outbox".
	Publication string
	// Tables are the outbox tables; default public.outbox.
	Tables []decoder.Table
	// Mapping maps outbox columns to the record; default
	// decoder.DefaultMapping().
	Mapping decoder.Mapping
	// CreatePublication and CreateSlot create what is missing at start
	// (default true, both).
	CreatePublication, CreateSlot bool
	// AlterPublication adds missing outbox tables to a publication walrelay
	// did not create; AllowRowFilter accepts a row filter on an outbox
	// table (see slot.SetupConfig). Default false, both.
	AlterPublication, AllowRowFilter bool
	// NoFailoverSlot keeps the slot walrelay creates from being a failover
	// slot (PostgreSQL 17+; by default, false, it is one, and an existing
	// slot is made one, so that a standby with sync_replication_slots
	// keeps it).
	NoFailoverSlot bool
	// StandbyURLs are connection URLs of the primary's standbys (default
	// none), on which the relay reads the slot's copy: the primary cannot
	// see whether a standby's copy is synchronized, so without them the
	// failover log line and walrelay_slot_failover_protected claim no
	// protection. A URL of a server that accepts writes is skipped, so the
	// list may name every node, the primary included.
	StandbyURLs []string
	// RecordSchema is the schema of walrelay's record, in the source
	// database, of what the slot streams from (default
	// slot.DefaultRecordSchema, "walrelay"): with it walrelay refuses to
	// replace a slot, publication or outbox table that changed under it.
	RecordSchema string
	// InitialSnapshot publishes the rows already in the outbox tables when
	// the relay creates the slot, before streaming (default true); false
	// publishes only what is committed later.
	InitialSnapshot bool
	// SnapshotWhere is an SQL condition the rows of a snapshot must meet
	// (default empty: every row); SnapshotOrder an SQL ORDER BY list
	// (default empty: the primary key).
	SnapshotWhere, SnapshotOrder string
	// Binary asks pgoutput for binary values (PostgreSQL 14+); default
	// false.
	Binary bool
	// Read tunes how the replication socket is read; its defaults: a read
	// buffer of slot.DefaultReadBufferBytes (1 MiB), a socket receive
	// buffer of 512 KiB (it carries about 50 MB/s at 10 ms round trip; 0
	// keeps the kernel's autotuning), reads coalesced for 200µs, and
	// messages capped at 64 MiB (MaxMessageBytes: far above the default
	// record limit, so a row whose record fits always arrives whole, and
	// low enough that one row cannot take a container's memory; 0: no
	// cap).
	Read slot.ReadOptions

	// Router configures records and topics. Its zero fields mean the
	// router's defaults (see router.Config), which DefaultConfig spells
	// out, with CreateTopics (default true) on.
	Router router.Config
	// Values makes the record values of topics and event types in a
	// schema registry's wire format, each payload checked against its
	// schema (package schema); its default, every value as is, needs no
	// registry. Ignored when Router.Values is set.
	Values schema.Config
	// Linger is how long the producer waits to fill a batch (default 5ms;
	// 0 sends at once), Compression its batch compression (default
	// kgo.NoCompression()).
	Linger      time.Duration
	Compression kgo.CompressionCodec
	// KafkaOptions connect the producer: seed brokers, TLS, SASL (default
	// none). They come after the client id "walrelay", Linger and
	// Compression, so an option here wins over those; Router.ClientOptions
	// are added to them.
	KafkaOptions []kgo.Opt

	// StatusInterval is the longest time between standby status updates
	// (default 10s). A stream whose wal_sender_timeout (default 60s; it
	// disconnects a silent client) is under three times it gets updates
	// every third of that timeout instead: while the relay waits for
	// Kafka it does not read the stream, and answers no request for a
	// reply.
	StatusInterval time.Duration
	// ConfirmDelay is the shortest time between two status updates that
	// only move the confirmed position forward (default 100ms; 0 confirms
	// at once): confirming promptly keeps slot lag low, without a message
	// per transaction.
	ConfirmDelay time.Duration
	// ShutdownTimeout bounds the stop when Run's context ends: the wait
	// for outstanding acks and, with exactly-once delivery, the final Kafka
	// commit before it, together (default 30s).
	ShutdownTimeout time.Duration
	// BackoffMin and BackoffMax bound the jittered exponential wait between
	// sessions (defaults 500ms and 30s).
	BackoffMin, BackoffMax time.Duration

	// NoIdleAdvance stops confirming keepalive positions (default false:
	// idle advance is on). Only for diagnosis: without it a quiet outbox
	// in a busy database pins WAL until the next outbox event.
	NoIdleAdvance bool
	// HeartbeatInterval is the time between WAL nudges and heartbeat
	// records (default 30s); 0 disables both.
	HeartbeatInterval time.Duration
	// HeartbeatQuery replaces the nudge (default empty:
	// heartbeat.DefaultQuery, pg_logical_emit_message(false,
	// 'walrelay.heartbeat', …)); "-" runs none.
	HeartbeatQuery string
	// HeartbeatTopic, when set, receives a heartbeat record every
	// HeartbeatInterval (default empty: none).
	HeartbeatTopic string
	// SlotPollInterval is how often pg_replication_slots is read for the
	// slot metrics and an invalidated slot (default 10s).
	SlotPollInterval time.Duration
	// ReadyMaxLag is the replication lag above which the relay reports not
	// ready (default 60s); 0 (or negative) disables the check.
	ReadyMaxLag time.Duration
	// PlannedOutage is the relay outage to plan for: the slot watch warns
	// once when idle_replication_slot_timeout, or max_slot_wal_keep_size
	// at the WAL rate it measures, would invalidate the slot during one
	// (default 24h, so that a relay that failed at night is back before
	// the slot is lost); 0 (or negative) disables the warning.
	PlannedOutage time.Duration
	// ExactlyOnce delivers through Kafka transactions with a checkpoint
	// record in each (default false: at-least-once). Router.TransactionalID
	// defaults to "walrelay-<slot>".
	ExactlyOnce bool
	// TxnMaxEvents and TxnMaxInterval commit a Kafka transaction once it
	// holds this many events or is this old (defaults 10000 and 100ms);
	// it commits earlier when the stream runs dry at a PostgreSQL
	// transaction boundary, once it is TxnMinInterval old (default 0: at
	// once; more trades latency for fewer Kafka transactions).
	TxnMaxEvents   int
	TxnMaxInterval time.Duration
	TxnMinInterval time.Duration
	// ReceiveTimeout ends a session whose connection carried nothing for
	// this long, not even the reply to a request for one sent at half of it
	// (default 60s, like PostgreSQL's wal_receiver_timeout).
	ReceiveTimeout time.Duration
	// StartupTimeout is how long the relay keeps retrying PostgreSQL and
	// Kafka before it has streamed once (default 2m; 0 or negative:
	// forever). After the first stream it retries forever.
	StartupTimeout time.Duration
}

// DefaultConfig returns the configuration walrelay runs with when nothing
// is set: `walrelay run` with no flag but --pg-url and --brokers, and
// `walrelay dev`, take their defaults from it. Set PGURL and the seed
// brokers (KafkaOptions), change what differs, and pass it to New.
func DefaultConfig() Config {
	return Config{
		Slot:              "walrelay",
		Publication:       "walrelay_outbox",
		Tables:            []decoder.Table{{Schema: "public", Name: "outbox"}},
		Mapping:           decoder.DefaultMapping(),
		CreatePublication: true,
		CreateSlot:        true,
		RecordSchema:      slot.DefaultRecordSchema,
		InitialSnapshot:   true,
		Read: slot.ReadOptions{
			BufferBytes:        slot.DefaultReadBufferBytes,
			SocketReceiveBytes: 512 << 10,
			Coalesce:           200 * time.Microsecond,
			MaxMessageBytes:    64 << 20,
		},
		Router:            defaultRouter(),
		Values:            schema.Config{}.WithDefaults(),
		Linger:            5 * time.Millisecond,
		Compression:       kgo.NoCompression(),
		StatusInterval:    10 * time.Second,
		ConfirmDelay:      100 * time.Millisecond,
		ShutdownTimeout:   30 * time.Second,
		BackoffMin:        500 * time.Millisecond,
		BackoffMax:        30 * time.Second,
		HeartbeatInterval: 30 * time.Second,
		SlotPollInterval:  10 * time.Second,
		ReadyMaxLag:       60 * time.Second,
		PlannedOutage:     24 * time.Hour,
		TxnMaxEvents:      10_000,
		TxnMaxInterval:    100 * time.Millisecond,
		ReceiveTimeout:    60 * time.Second,
		StartupTimeout:    2 * time.Minute,
	}
}

// defaultRouter is the router's own defaults (what its zero fields mean),
// spelled out so that DefaultConfig shows every value, with topic
// creation on: a relay that meets a new aggregate type creates its topic
// rather than stopping on it.
func defaultRouter() router.Config {
	c := router.Config{CreateTopics: true}.WithDefaults()
	c.Topics = nil // a set per relay, made by New: see setDefaults
	return c
}

// setDefaults fills in what derives from other fields: the transactional
// id from the slot, the router's zero fields from its defaults, and the
// Kafka client options Linger and Compression stand for.
func (c *Config) setDefaults() {
	if c.ExactlyOnce && c.Router.TransactionalID == "" {
		c.Router.TransactionalID = "walrelay-" + c.Slot
	}
	if !c.ExactlyOnce {
		c.Router.TransactionalID = ""
	}
	// The relay bounds commits by the transaction timeout, the decoder's
	// value limit follows the record limit, and errors name the
	// checkpoint topic: the router's defaults, from the router. Its topic
	// set, made here once, is shared by every router of this relay, so
	// the topic bounds hold for the process across producer replacements.
	c.Router = c.Router.WithDefaults()
	c.KafkaOptions = append([]kgo.Opt{
		kgo.ClientID("walrelay"),
		kgo.ProducerBatchCompression(c.Compression),
		kgo.ProducerLinger(c.Linger),
	}, c.KafkaOptions...)
}

// validate refuses what cannot work, naming the field and its default: a
// zero where only a positive value works means a Config not started from
// DefaultConfig.
func (c *Config) validate() error {
	def := DefaultConfig()
	type duration struct {
		field  string
		d, def time.Duration
	}
	positive := []duration{
		{"relay.Config.StatusInterval", c.StatusInterval, def.StatusInterval},
		{"relay.Config.ShutdownTimeout", c.ShutdownTimeout, def.ShutdownTimeout},
		{"relay.Config.BackoffMin", c.BackoffMin, def.BackoffMin},
		{"relay.Config.BackoffMax", c.BackoffMax, def.BackoffMax},
		{"relay.Config.SlotPollInterval", c.SlotPollInterval, def.SlotPollInterval},
		{"relay.Config.ReceiveTimeout", c.ReceiveTimeout, def.ReceiveTimeout},
	}
	if c.ExactlyOnce {
		positive = append(positive, duration{"relay.Config.TxnMaxInterval", c.TxnMaxInterval, def.TxnMaxInterval})
	}
	for _, f := range positive {
		if f.d <= 0 {
			return fmt.Errorf("%s is %s: give it a positive duration (the default is %s)", f.field, f.d, f.def)
		}
	}
	for _, f := range []duration{{"relay.Config.ConfirmDelay", c.ConfirmDelay, def.ConfirmDelay}, {"relay.Config.Linger", c.Linger, def.Linger}, {"relay.Config.TxnMinInterval", c.TxnMinInterval, def.TxnMinInterval}} {
		if f.d < 0 {
			return fmt.Errorf("%s is %s: it must not be negative (the default is %s)", f.field, f.d, f.def)
		}
	}
	if c.BackoffMax < c.BackoffMin {
		return fmt.Errorf("relay.Config.BackoffMax %s is shorter than relay.Config.BackoffMin %s: raise it", c.BackoffMax, c.BackoffMin)
	}
	if c.ExactlyOnce && c.TxnMaxEvents <= 0 {
		return fmt.Errorf("relay.Config.TxnMaxEvents is %d: give it a positive number (the default is %d)", c.TxnMaxEvents, def.TxnMaxEvents)
	}
	if c.RecordSchema == "" {
		return fmt.Errorf("relay.Config.RecordSchema is empty: name the schema of walrelay's record (the default is %s)", def.RecordSchema)
	}
	for i, u := range c.StandbyURLs {
		if err := slot.CheckURL(u); err != nil {
			return fmt.Errorf("relay.Config.StandbyURLs[%d]: %w", i, err)
		}
	}
	return nil
}

// Relay runs the pipeline. Create it with New, then call Run once.
type Relay struct {
	cfg     Config
	log     *zap.Logger
	metrics *metrics.Metrics
	backoff *backoff.ExponentialBackOff

	confirmed atomic.Uint64 // last position sent to PostgreSQL
	acked     atomic.Uint64 // newest confirmable position, sent or not
	received  atomic.Uint64 // newest WAL position received
	lag       atomic.Int64  // replication lag in nanoseconds
	streaming atomic.Bool
	current   atomic.Pointer[session]
	router    atomic.Pointer[router.Router]
	// slotSeen is set once a stream has started: from then on a missing
	// slot was dropped under us, and recreating it would skip data.
	slotSeen     bool
	everStreamed atomic.Bool
	// record is what the slot streams from, as prepare found and wrote it
	// down (slot.Record); the publication watch checks it still holds.
	record slot.Record
	// watch checks the publication still publishes what record says
	// (watch.go); watchMu serialises its checks.
	watch   *slot.Watch
	watchMu sync.Mutex
	// refused is set once the relay stopped on a change under it
	// (refuse): nothing more is confirmed or refused again.
	refused atomic.Bool
	// verified is the position up to which the publication watch found
	// the publication intact: the session confirms nothing past it.
	// verifyWanted wakes the watch when the session has more to confirm.
	verified     atomic.Uint64
	wantVerified atomic.Uint64
	verifyWanted chan struct{}
	// lastSure is the newest exactly-once checkpoint this process knows
	// Kafka committed, and commitUnsure says a commit's outcome was not
	// confirmed since (distrust); doubt is what that commit wrote, when
	// Kafka was asked to commit it. Only the session goroutine touches
	// them.
	lastSure     resumePoint
	commitUnsure bool
	doubt        *router.CommitUnconfirmed
	// timeline is the timeline of the last stream: a new one means a
	// failover, after which positions this process kept belong to the old
	// primary's history.
	timeline int32
	// failoverSaid is the failover line last logged, without its
	// figures (recordFailover).
	failoverMu   sync.Mutex
	failoverSaid string
	// resendWarned: the warning that the slot is behind walrelay's record
	// was logged (once a process).
	resendWarned bool
	begin        time.Time // when Run started, for StartupTimeout
	// now and sleep are retry's clock and wait (sleep returns false when
	// ctx ended first); unit tests replace them to check the waits.
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) bool
	// slotHolder tells a fenced relay whether it still holds the slot
	// (fence.go): holdsSlot, or a fake in unit tests.
	slotHolder slotHolder
	// coverage says how the publication covers a table the relay does not
	// map (session.go, unmapped): readCoverage, or a fake in unit tests.
	coverage func(ctx context.Context, oid uint32) (slot.Coverage, error)

	// unmapped holds the counter of each table whose inserts the
	// publication sends but no outbox maps; a table is logged when it is
	// added. Only the session goroutine (one at a time) touches it.
	unmapped map[decoder.Table]prometheus.Counter
}

// New checks cfg (start from DefaultConfig) and returns a Relay.
func New(cfg Config, log *zap.Logger, m *metrics.Metrics) (*Relay, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if err := slot.ValidSlotName(cfg.Slot); err != nil {
		return nil, err
	}
	if cfg.Publication == "" {
		return nil, errors.New("relay.Config.Publication is empty: name the publication the slot streams")
	}
	if len(cfg.Tables) == 0 {
		return nil, errors.New("relay.Config.Tables is empty: name at least one outbox table")
	}
	if m := cfg.Read.MaxMessageBytes; m > 0 && m <= cfg.Router.MaxRecordBytes {
		return nil, fmt.Errorf("relay.Config.Read.MaxMessageBytes %d must exceed relay.Config.Router.MaxRecordBytes %d: a row carrying a record of the largest size must fit in one message", m, cfg.Router.MaxRecordBytes)
	}
	if _, err := decoder.New(decoder.Config{Tables: cfg.Tables, Mapping: cfg.Mapping, Binary: cfg.Binary}); err != nil {
		return nil, err
	}
	if err := cfg.Router.Validate(); err != nil {
		return nil, err
	}
	if err := withValues(&cfg, log, m); err != nil {
		return nil, err
	}
	if cfg.ExactlyOnce && 2*cfg.TxnMaxInterval > cfg.Router.TransactionTimeout {
		// A transaction is committed TxnMaxInterval after it began at the
		// earliest; past the timeout the broker has aborted it, and every
		// quiet transaction would be retried forever.
		return nil, fmt.Errorf("exactly-once: the commit interval (relay.Config.TxnMaxInterval %s) must be at most half the Kafka transaction timeout (relay.Config.Router.TransactionTimeout %s)",
			cfg.TxnMaxInterval, cfg.Router.TransactionTimeout)
	}
	if cfg.StatusInterval < cfg.ConfirmDelay {
		return nil, fmt.Errorf("relay.Config.StatusInterval %s is shorter than the confirm delay, relay.Config.ConfirmDelay %s: raise it, or lower the delay", cfg.StatusInterval, cfg.ConfirmDelay)
	}
	for _, kind := range heartbeat.Kinds() {
		m.Heartbeats.WithLabelValues(string(kind))
	}
	for _, cause := range RestartCauses() {
		m.StreamRestarts.WithLabelValues(string(cause))
	}
	r := &Relay{
		cfg:     cfg,
		log:     log,
		metrics: m,
		backoff: &backoff.ExponentialBackOff{
			InitialInterval:     cfg.BackoffMin,
			RandomizationFactor: 0.5,
			Multiplier:          2,
			MaxInterval:         cfg.BackoffMax,
		},
		now:          time.Now,
		sleep:        sleepCtx,
		verifyWanted: make(chan struct{}, 1),
	}
	r.slotHolder = r.holdsSlot
	r.coverage = r.readCoverage
	m.SetReadiness(r.Ready)
	return r, nil
}

// sleepCtx waits d; false when ctx ends first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Confirmed returns the position last confirmed to PostgreSQL by this
// process (0 before the first status update).
func (r *Relay) Confirmed() decoder.LSN { return decoder.LSN(r.confirmed.Load()) }

// Streaming reports whether a replication stream is open.
func (r *Relay) Streaming() bool { return r.streaming.Load() }

// ReplicationLag is, while any transaction is in flight, now minus the
// commit time of the newest confirmable transaction (of the oldest one in
// flight when none is confirmable yet); 0 when nothing is in flight. It is
// how far behind PostgreSQL what Kafka has lies, as housekeep computes it.
func (r *Relay) ReplicationLag() time.Duration { return time.Duration(r.lag.Load()) }

// Ready returns nil when the relay is streaming and its replication lag is
// under ReadyMaxLag, else why not.
func (r *Relay) Ready() error {
	if !r.Streaming() {
		return errors.New("not streaming: connecting, waiting for the slot or backing off")
	}
	if lag := r.ReplicationLag(); r.cfg.ReadyMaxLag > 0 && lag > r.cfg.ReadyMaxLag {
		return fmt.Errorf("replication lag %s exceeds %s", lag.Round(time.Millisecond), r.cfg.ReadyMaxLag)
	}
	return nil
}

// Run prepares the database and relays until ctx ends, then waits (at most
// ShutdownTimeout) for outstanding acks, confirms them and returns nil.
// It returns an error only for what retrying cannot fix: a setup refusal,
// an invalidated or vanished slot, an invalid event with on-invalid=fail
// (such as a row written while its table lacked a mapped column).
func (r *Relay) Run(parent context.Context) error {
	r.begin = r.now()
	rt, err := r.prepare(parent)
	if err != nil {
		if parent.Err() != nil {
			return nil
		}
		return err
	}
	r.router.Store(rt)
	// Background work that may stop the relay (an invalidated slot)
	// cancels ctx with a cause; the parent's cancellation is a clean stop.
	ctx, stop := context.WithCancelCause(parent)
	var bg sync.WaitGroup
	// Deferred calls run last first: stop the background work, then wait
	// for it.
	defer bg.Wait()
	defer stop(nil)
	bg.Go(func() { r.watchSlot(ctx, stop) })
	bg.Go(func() { r.watchPublication(ctx, stop) })
	hb := &heartbeatProducer{opts: r.cfg.KafkaOptions}
	defer hb.close() // after the heartbeat stopped (deferred calls run last first)
	bg.Go(func() { r.beater(hb).Run(ctx) })
	// stopped is Run's result once it stops: err when retrying gave up
	// for good, else the cause background work stopped the relay with,
	// else nil (a clean stop).
	stopped := func(err error) error {
		if isFatal(err) {
			return err
		}
		if cause := context.Cause(ctx); parent.Err() == nil && cause != nil && !errors.Is(cause, context.Canceled) {
			return cause
		}
		return nil
	}

	defer func() {
		if rt != nil {
			r.router.Store(nil)
			rt.Close()
		}
	}()
	for {
		if rt == nil {
			var err error
			if rt, err = r.newRouter(ctx); err != nil {
				if ctx.Err() != nil {
					return stopped(nil)
				}
				if isFatal(err) {
					return err
				}
				if err := r.retry(ctx, CauseKafka, err); err != nil {
					return stopped(err)
				}
				continue
			}
			r.router.Store(rt)
		}
		err := r.session(ctx, rt)
		if rt.Failed() || rt.Txn() != nil && rt.Txn().TookID() {
			// A producer that lost a record is not reused: its
			// idempotence state and buffered records are suspect. Nor
			// is one that took the transactional id: another relay may
			// have taken it since, and the next session must take it
			// afresh, after the slot (initTransactions).
			r.router.Store(nil)
			rt.Close()
			rt = nil
		}
		if ctx.Err() != nil {
			return stopped(nil)
		}
		if isFatal(err) {
			return err
		}
		if err := r.retry(ctx, causeOf(err), err); err != nil {
			return stopped(err)
		}
	}
}

// prepare connects to Kafka, then runs the setup checks and creates what
// is missing (with the initial snapshot, published through the router it
// returns), retrying what may be transient. Kafka comes first: a slot
// created by a start that then fails on Kafka would hold WAL for nothing.
func (r *Relay) prepare(ctx context.Context) (*router.Router, error) {
	var rt *router.Router
	fail := func(err error) (*router.Router, error) {
		if rt != nil {
			rt.Close()
		}
		return nil, err
	}
	for {
		if rt == nil {
			var err error
			if rt, err = r.newRouter(ctx); err != nil {
				rt = nil
				if ctx.Err() != nil || isFatal(err) {
					return fail(err)
				}
				if err := r.retry(ctx, CauseKafka, err); err != nil {
					return fail(err)
				}
				continue
			}
		}
		setup := r.setupConfig()
		if r.cfg.InitialSnapshot {
			setup.Snapshot = r.initialSnapshot(rt)
		}
		rec, err := slot.Prepare(ctx, setup, r.log)
		if err == nil {
			r.record = rec
			r.backoff.Reset()
			r.logFailover(ctx)
			return rt, nil
		}
		cause := CauseSetup
		if rt.Failed() {
			// Kafka refused a snapshot record: a new producer for the
			// next attempt.
			cause = CauseKafka
			rt.Close()
			rt = nil
		}
		if slot.IsSetupError(err) || isFatal(err) || ctx.Err() != nil {
			return fail(err)
		}
		if certificateError(err) {
			// Retrying cannot make an untrusted certificate trusted.
			return fail(&fatalError{fmt.Errorf("postgresql: %w", err)})
		}
		if pgAuthError(err) {
			return fail(&fatalError{fmt.Errorf("postgresql refused the credentials (check the user and password of relay.Config.PGURL, PGPASSWORD or the passfile, and pg_hba.conf): %w", err)})
		}
		if err := r.retry(ctx, cause, err); err != nil {
			return fail(err)
		}
	}
}

// setupConfig is what the source database must provide, from the relay's
// configuration.
func (r *Relay) setupConfig() slot.SetupConfig {
	return slot.SetupConfig{
		URL: r.cfg.PGURL, Slot: r.cfg.Slot, Publication: r.cfg.Publication, Tables: r.cfg.Tables,
		Columns: r.cfg.Mapping.Columns(), CreatePublication: r.cfg.CreatePublication, CreateSlot: r.cfg.CreateSlot,
		AlterPublication: r.cfg.AlterPublication, AllowRowFilter: r.cfg.AllowRowFilter,
		Failover: !r.cfg.NoFailoverSlot, RecordSchema: r.cfg.RecordSchema,
		Binary: r.cfg.Binary, TopicTemplate: r.cfg.Router.TopicTemplate,
	}
}

// newRouter is the relay's router, started (startRouter) with the
// heartbeat topic among its extra topics. With exactly-once delivery the
// transactional id is taken only once the slot is held
// (initTransactions): a standby fences nobody.
func (r *Relay) newRouter(ctx context.Context) (*router.Router, error) {
	var extra []string
	if r.cfg.HeartbeatTopic != "" && r.cfg.HeartbeatInterval > 0 {
		extra = append(extra, r.cfg.HeartbeatTopic)
	}
	return startRouter(ctx, r.cfg, r.log, r.metrics, r.onProduceError, extra...)
}

// startRouter makes a router for cfg and readies it: a broker reached
// first (unreachable brokers, a wrong SASL password or an untrusted
// certificate say so, rather than time out creating topics; what retrying
// cannot fix is a *fatalError), then the dead-letter topic and the extra
// topics prepared (Router.Start). fatal is the router's fatal handler.
func startRouter(ctx context.Context, cfg Config, log *zap.Logger, m *metrics.Metrics, fatal func(error), extra ...string) (*router.Router, error) {
	rt, err := router.New(cfg.Router, cfg.KafkaOptions, log, m, fatal)
	if err != nil {
		return nil, &fatalError{err}
	}
	pingCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
	err = rt.Ping(pingCtx)
	cancel()
	if err != nil {
		rt.Close()
		if kafkaConfigError(err) {
			return nil, &fatalError{fmt.Errorf("kafka: %w", err)}
		}
		if notKafka(err) {
			return nil, &fatalError{fmt.Errorf("kafka: a seed broker (kgo.SeedBrokers) did not answer as a Kafka broker: check the host and port (another service's port, or TLS on one side only?): %w", err)}
		}
		return nil, fmt.Errorf("reach kafka brokers: %w", err)
	}
	if err := rt.Start(ctx, extra...); err != nil {
		rt.Close()
		return nil, err
	}
	return rt, nil
}

// kafkaConfigError reports errors that retrying cannot fix: wrong
// credentials, an unsupported mechanism, a certificate that is not trusted,
// a transaction timeout above the broker's transaction.max.timeout.ms.
func kafkaConfigError(err error) bool {
	return errors.Is(err, kerr.SaslAuthenticationFailed) || errors.Is(err, kerr.UnsupportedSaslMechanism) ||
		errors.Is(err, kerr.IllegalSaslState) || errors.Is(err, kerr.TransactionalIDAuthorizationFailed) ||
		errors.Is(err, kerr.InvalidTransactionTimeout) || certificateError(err)
}

// pgAuthError reports PostgreSQL refusing the login: a wrong password
// (28P01) or no pg_hba.conf entry allowing it (28000). Retrying cannot fix
// either.
func pgAuthError(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "28P01" || pgErr.Code == "28000")
}

// notKafka reports a peer that answered, but not in the Kafka protocol:
// its first bytes, read as a Kafka response size, are absurd (PostgreSQL's
// error reply reads as 1157627904). franz-go exports no error value for
// this, so its message is matched.
func notKafka(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "invalid large response size") || strings.Contains(msg, "invalid negative response size")
}

// certificateError reports a server certificate that does not verify.
func certificateError(err error) bool {
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var verify *tls.CertificateVerificationError
	return errors.As(err, &unknownCA) || errors.As(err, &hostname) || errors.As(err, &verify)
}

// retry logs err, counts it and sleeps a backoff (before the first stream
// at most until StartupTimeout runs out). It returns nil when the caller
// should try again, else why to stop instead: ctx's error when ctx ended,
// or a fatal error when the relay never streamed within StartupTimeout and
// err is not a standby's wait for a busy slot.
func (r *Relay) retry(ctx context.Context, cause RestartCause, err error) error {
	if cause != CauseSlotBusy && !r.everStreamed.Load() && r.cfg.StartupTimeout > 0 && r.now().Sub(r.begin) > r.cfg.StartupTimeout {
		return &fatalError{fmt.Errorf("gave up after relay.Config.StartupTimeout %s without streaming: %w", r.cfg.StartupTimeout, err)}
	}
	wait := min(r.backoff.NextBackOff(), r.cfg.BackoffMax)
	if cause != CauseSlotBusy && !r.everStreamed.Load() && r.cfg.StartupTimeout > 0 {
		// End the sleep at the deadline: one last attempt then, and the
		// next failure gives up on time instead of a backoff late.
		wait = max(min(wait, r.begin.Add(r.cfg.StartupTimeout).Sub(r.now())), 0)
	}
	r.metrics.StreamRestarts.WithLabelValues(string(cause)).Inc()
	if cause == CauseSlotBusy {
		r.log.Info("waiting as a standby: another client streams from the slot", zap.String("slot", r.cfg.Slot),
			zap.Error(err), zap.Duration("retry_in", wait))
	} else {
		r.log.Warn("relay restarting from the last confirmed position", zap.String("cause", string(cause)), zap.Error(err),
			zap.Duration("backoff", wait), zap.Stringer("confirmed_lsn", r.Confirmed()))
	}
	if !r.sleep(ctx, wait) {
		return ctx.Err()
	}
	return nil
}

// onProduceError is the router's fatal handler: it ends the current
// session, whose successor starts from the last confirmed position.
func (r *Relay) onProduceError(err error) {
	if s := r.current.Load(); s != nil {
		select {
		case s.failed <- &produceError{err}:
		default:
		}
		s.stream.Interrupt()
	}
}

// produceError wraps a record Kafka refused for good.
type produceError struct{ err error }

func (e *produceError) Error() string { return e.err.Error() }
func (e *produceError) Unwrap() error { return e.err }

// fatalError marks what restarting will not fix.
type fatalError struct{ err error }

func (e *fatalError) Error() string { return e.err.Error() }
func (e *fatalError) Unwrap() error { return e.err }

// Fatal is true: see fatalError.
func (e *fatalError) Fatal() bool { return true }

// fataler is an error that says whether restarting can fix it: fatalError,
// slot.SetupError, deadletter.InvalidEventError, decoder.Error.
type fataler interface{ Fatal() bool }

// isFatal reports whether any error in err's tree says restarting cannot
// fix it. Errors say so themselves: the relay knows no other package's
// sentinels for this.
func isFatal(err error) bool {
	if f, ok := err.(fataler); ok && f.Fatal() {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return isFatal(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if isFatal(e) {
				return true
			}
		}
	}
	return false
}

// RestartCause says why the relay restarted: the cause label of
// walrelay_stream_restarts_total.
type RestartCause string

const (
	// CauseKafka is a restart because Kafka refused a record for good, a Kafka transaction
	// failed, or no producer could be made.
	CauseKafka RestartCause = "kafka"
	// CauseFenced is a restart because another producer took the exactly-once transactional
	// id after another relay took the slot (this one waits as a standby).
	CauseFenced RestartCause = "fenced"
	// CauseSlotBusy is a wait because another client streams from the slot (a standby's
	// wait, not a fault).
	CauseSlotBusy RestartCause = "slot_busy"
	// CauseSilent is a restart because the server sent nothing for Config.ReceiveTimeout.
	CauseSilent RestartCause = "silent"
	// CauseDecode is a restart on a pgoutput message the decoder found malformed.
	CauseDecode RestartCause = "decode"
	// CausePostgres is a restart on an error PostgreSQL reported on the stream.
	CausePostgres RestartCause = "postgres"
	// CauseConnection is any other end of the stream (a broken connection).
	CauseConnection RestartCause = "connection"
	// CauseSetup is a retry because the setup checks at start failed in a way a retry may
	// fix (the database unreachable, say).
	CauseSetup RestartCause = "setup"
)

// RestartCauses lists every RestartCause (a new slice each call).
func RestartCauses() []RestartCause {
	return []RestartCause{CauseKafka, CauseFenced, CauseSlotBusy, CauseSilent, CauseDecode, CausePostgres, CauseConnection, CauseSetup}
}

// causeOf names a session's end for the restarts metric.
func causeOf(err error) RestartCause {
	var pgErr *pgconn.PgError
	var produceErr *produceError
	var txnErr *kafkaTxnFailure
	switch {
	case errors.Is(err, router.ErrFenced):
		return CauseFenced
	case errors.As(err, &produceErr), errors.As(err, &txnErr):
		return CauseKafka
	case errors.Is(err, errSlotBusy):
		return CauseSlotBusy
	case errors.Is(err, errServerSilent):
		return CauseSilent
	case errors.Is(err, decoder.ErrMalformed):
		return CauseDecode
	case errors.As(err, &pgErr):
		return CausePostgres
	default:
		return CauseConnection
	}
}
