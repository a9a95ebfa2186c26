package relay

// config.go: what a Relay is configured with, and the one definition of
// walrelay's defaults (DefaultConfig).

import (
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/schema"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// Config configures a Relay. Start from DefaultConfig: a field holds the
// value it means, so a zero is zero (off, none, at once), never "the
// default"; New refuses a zero where only a positive value works. Each
// field's documentation names its default, the value DefaultConfig sets.
type Config struct {
	// PGURL is the source database; the replication connection is derived
	// from it. Required: no default.
	PGURL string
	// PrimaryURL, when set, names the primary of PGURL, a hot standby
	// (PostgreSQL 16+) the relay decodes on; default none. The slot and
	// the replication connection are on the standby; the heartbeat, the
	// publication and walrelay's record are written on the primary (see
	// source.SetupConfig.PrimaryURL).
	PrimaryURL string
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
	// table (see source.SetupConfig). Default false, both.
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
	// source.DefaultRecordSchema, "walrelay"): with it walrelay refuses to
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

	// Router configures records and topics; default
	// router.DefaultConfig(), whose zero fields are zero as this
	// Config's are (router.Config.Validate refuses those that cannot be).
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
	// slot metrics and an invalidated slot, and how often the relay warns,
	// naming them, while creating the slot waits for transactions to end
	// (default 10s).
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
	// Holds is where the relay's parts report what holds delivery, which
	// readiness, Relay.Status and walrelay_delivery_held read (package
	// holds). Default nil: New makes a board of its own. Give one to have
	// parts made before the relay report into it too (the Kafka token
	// source of kafkaauth.OAuth.Holds).
	Holds *holds.Board
	// StartupTimeout is how long the relay keeps retrying PostgreSQL and
	// Kafka, and creating the slot waits for transactions to end, before
	// it has streamed once (default 2m; 0 or negative: forever); then Run
	// returns a *StartupTimeoutError. An initial snapshot under way is not
	// cut short. After the first stream it retries forever.
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
		RecordSchema:      source.DefaultRecordSchema,
		InitialSnapshot:   true,
		Read: slot.ReadOptions{
			BufferBytes:        slot.DefaultReadBufferBytes,
			SocketReceiveBytes: 512 << 10,
			Coalesce:           200 * time.Microsecond,
			MaxMessageBytes:    64 << 20,
		},
		Router:            router.DefaultConfig(),
		Values:            schema.DefaultConfig(),
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

// setDefaults fills in what derives from other fields: the transactional
// id from the slot, the router's topic set, and the Kafka client options
// Linger and Compression stand for.
func (c *Config) setDefaults() {
	if c.ExactlyOnce && c.Router.TransactionalID == "" {
		c.Router.TransactionalID = "walrelay-" + c.Slot
	}
	if !c.ExactlyOnce {
		c.Router.TransactionalID = ""
	}
	// The router's topic set, made here once, is shared by every router of
	// this relay, so the topic bounds hold for the process across
	// producer replacements.
	c.Router = c.Router.WithTopicSet()
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
	if c.Read.BufferBytes <= 0 {
		return fmt.Errorf("relay.Config.Read.BufferBytes is %d: give it a positive size (the default is %d)", c.Read.BufferBytes, def.Read.BufferBytes)
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
	if c.PrimaryURL != "" {
		if err := slot.CheckURL(c.PrimaryURL); err != nil {
			return fmt.Errorf("relay.Config.PrimaryURL: %w", err)
		}
	}
	for i, u := range c.StandbyURLs {
		if err := slot.CheckURL(u); err != nil {
			return fmt.Errorf("relay.Config.StandbyURLs[%d]: %w", i, err)
		}
	}
	return c.Values.Validate()
}

// setupConfig is what the source database must provide, as configured.
func (c *Config) setupConfig() source.SetupConfig {
	return source.SetupConfig{
		URL: c.PGURL, PrimaryURL: c.PrimaryURL, Slot: c.Slot, Publication: c.Publication, Tables: c.Tables,
		Columns: c.Mapping.Columns(), CreatePublication: c.CreatePublication, CreateSlot: c.CreateSlot,
		AlterPublication: c.AlterPublication, AllowRowFilter: c.AllowRowFilter,
		Failover: !c.NoFailoverSlot, RecordSchema: c.RecordSchema,
		Binary: c.Binary, TopicTemplate: c.Router.TopicTemplate,
		CreateWarnInterval: c.SlotPollInterval,
	}
}
