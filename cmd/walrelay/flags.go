package main

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/plugin/kzap"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/kafkaauth"
	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// LogFlags configure logging for every command.
type LogFlags struct {
	LogLevel  string `default:"info" enum:"debug,info,warn,error" help:"Log level: debug, info, warn, error."`
	LogFormat string `default:"json" enum:"json,console" help:"Log format: json (one object per line) or console."`
}

// logger builds the zap logger the flags describe. Logs go to stderr so
// that stdout stays free for what a command prints (dev's records).
func (f *LogFlags) logger() (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(f.LogLevel)
	if err != nil {
		return nil, err
	}
	var cfg zap.Config
	if f.LogFormat == "console" {
		cfg = zap.NewDevelopmentConfig()
		cfg.DisableStacktrace = true
	} else {
		cfg = zap.NewProductionConfig()
		cfg.EncoderConfig.TimeKey = "time"
		cfg.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	}
	cfg.Level = zap.NewAtomicLevelAt(lvl)
	cfg.OutputPaths = []string{"stderr"}
	cfg.ErrorOutputPaths = []string{"stderr"}
	// The libraries log configuration field names; the log speaks flags.
	return cfg.Build(zap.WrapCore(func(c zapcore.Core) zapcore.Core { return flagCore{c} }))
}

// SourceFlags say where the events come from.
type SourceFlags struct {
	Publication       string   `default:"${publication}" help:"Publication the slot streams (created FOR TABLE <tables> WITH (publish = 'insert', publish_via_partition_root = true) when missing)."`
	Slot              string   `default:"${slot}" help:"Logical replication slot (pgoutput)."`
	Table             []string `default:"${table}" help:"Outbox table, schema.table; repeat the flag (or separate with commas) for several."`
	CreatePublication bool     `default:"${create_publication}" negatable:"" help:"Create the publication when missing, and add outbox tables it lacks to a publication walrelay created."`
	AlterPublication  bool     `default:"${alter_publication}" help:"Add missing outbox tables to an existing publication walrelay did not create (it may be shared: every subscriber of it then receives them)."`
	AllowRowFilter    bool     `default:"${allow_row_filter}" help:"Accept a publication row filter (WHERE) on an outbox table; rows it filters out are never published. Logged at WARN at startup."`
	CreateSlot        bool     `default:"${create_slot}" negatable:"" help:"Create the replication slot when missing, at a first start: a slot walrelay streamed from that disappeared (a failover, a drop) is never recreated without walrelay setup --accept-gap."`
	FailoverSlot      bool     `default:"${failover_slot}" negatable:"" help:"PostgreSQL 17+: make the slot a failover slot (created so, or altered), which standbys with sync_replication_slots = on keep a copy of that survives their promotion."`
	RecordSchema      string   `default:"${record_schema}" help:"Schema of walrelay's record of what each slot streams from (table <schema>.slots, created when missing): with it walrelay refuses to replace a slot, publication or outbox table that changed under it."`
	Snapshot          string   `default:"${snapshot}" enum:"initial,never" help:"initial: when walrelay creates the slot, first publish the rows already in the outbox tables (at the slot's consistent point), then stream; never: publish only rows committed after the slot exists."`
	SnapshotWhere     string   `default:"${snapshot_where}" placeholder:"SQL" help:"SQL condition the rows of the initial snapshot must meet (e.g. 'sent_at IS NULL'); empty for every row."`
	SnapshotOrder     string   `default:"${snapshot_order}" placeholder:"SQL" help:"SQL ORDER BY list of the initial snapshot (e.g. 'created_at, id'); empty for the table's primary key."`
}

// validatePrimaryURL refuses a --primary-url that does not parse (empty
// is none: the source is not a standby).
func validatePrimaryURL(url string) error {
	if url == "" {
		return nil
	}
	if err := slot.CheckURL(url); err != nil {
		return fmt.Errorf("--primary-url: %w", err)
	}
	return nil
}

// validateSource checks the flags every command that touches the database
// shares. An empty URL or one that does not parse is refused (a malformed
// flag, exit 80); an empty URL is refused because pgx would dial a local Unix
// socket as the OS user; a slot name outside [a-z0-9_] is refused because
// it is spliced into replication commands (START_REPLICATION,
// CREATE_REPLICATION_SLOT), where 'x TEMPORARY' would change the command.
// Publication names are always quoted where they reach SQL or the
// replication protocol, so only an empty one is refused.
func validateSource(pgURL, slotName string, publication *string) error {
	if strings.TrimSpace(pgURL) == "" {
		return errors.New("--pg-url is empty: give the source database URL (postgres://user@host:5432/db?sslmode=verify-full) or set WALRELAY_PG_URL")
	}
	// A URL that does not parse is refused before any connection attempt,
	// without being quoted (a password may be anywhere in it).
	if err := slot.CheckURL(pgURL); err != nil {
		return err
	}
	if err := slot.ValidSlotName(slotName); err != nil {
		return fmt.Errorf("--slot: %w", err)
	}
	if publication != nil && *publication == "" {
		return errors.New("--publication is empty: name the publication the slot streams")
	}
	return nil
}

// ColumnFlags map outbox columns to the record.
type ColumnFlags struct {
	ColumnID            string   `default:"${column_id}" help:"Outbox column whose text becomes the id header."`
	ColumnAggregateType string   `default:"${column_aggregate_type}" help:"Outbox column that selects the topic."`
	ColumnAggregateID   string   `default:"${column_aggregate_id}" help:"Outbox column that becomes the record key."`
	ColumnType          string   `default:"${column_type}" help:"Outbox column that becomes the type header; empty for none."`
	ColumnPayload       string   `default:"${column_payload}" help:"Outbox column that becomes the record value (json/jsonb/text as is, bytea as raw bytes, NULL as a tombstone)."`
	HeaderColumn        []string `placeholder:"COLUMN[=HEADER]" help:"Extra outbox column to send as a header (named HEADER, default the column name); repeatable."`
	ColumnTraceparent   string   `default:"${column_traceparent}" help:"Outbox column whose text becomes the W3C traceparent header, when the table has it (outbox.Writer fills it from the writer's trace context); empty for none. A --header-column sending traceparent replaces it."`
	ColumnTracestate    string   `default:"${column_tracestate}" help:"Outbox column whose text becomes the W3C tracestate header, when the table has it; empty for none."`
	Preset              string   `default:"none" enum:"none,debezium" help:"debezium: the records of Debezium's Outbox Event Router with its defaults, for its outbox table (columns id, aggregatetype, aggregateid, payload; no type header). It changes only the column flags left at walrelay's defaults."`
}

// presets are the column flags each --preset changes, from walrelay's
// default to the preset's. debezium: the Outbox Event Router's defaults
// (route.by.field aggregatetype, table.field.event.key aggregateid, no
// type header unless table.fields.additional.placement places one); its
// id and payload columns, its topic (outbox.event.<aggregatetype>) and its
// id header are walrelay's defaults already.
var presets = map[string]func(c *ColumnFlags){
	"debezium": func(c *ColumnFlags) {
		def := relay.DefaultConfig().Mapping
		preset(&c.ColumnAggregateType, def.AggregateType, "aggregatetype")
		preset(&c.ColumnAggregateID, def.AggregateID, "aggregateid")
		preset(&c.ColumnType, def.Type, "")
	},
}

// preset sets *flag to value when it holds walrelay's default def: a flag
// given another value explicitly wins over the preset.
func preset(flag *string, def, value string) {
	if *flag == def {
		*flag = value
	}
}

// mapping is the decoder's column mapping.
func (c ColumnFlags) mapping() (decoder.Mapping, error) {
	if apply, ok := presets[c.Preset]; ok {
		apply(&c)
	}
	m := decoder.Mapping{
		ID: c.ColumnID, AggregateType: c.ColumnAggregateType, AggregateID: c.ColumnAggregateID,
		Type: c.ColumnType, Payload: c.ColumnPayload,
		TraceParent: c.ColumnTraceparent, TraceState: c.ColumnTracestate,
	}
	for _, h := range c.HeaderColumn {
		col, hdr, ok := strings.Cut(h, "=")
		if !ok {
			hdr = col
		}
		if col == "" || hdr == "" {
			return decoder.Mapping{}, fmt.Errorf("--header-column %q: want COLUMN or COLUMN=HEADER", h)
		}
		m.Headers = append(m.Headers, decoder.HeaderColumn{Column: col, Header: hdr})
	}
	return m, nil
}

// parseTables parses --table values.
func parseTables(names []string) ([]decoder.Table, error) {
	var ts []decoder.Table
	for _, s := range names {
		t, err := slot.ParseTable(strings.TrimSpace(s))
		if err != nil {
			return nil, fmt.Errorf("--table: %w", err)
		}
		ts = append(ts, t)
	}
	return ts, nil
}

// RecordFlags say what the Kafka records look like.
type RecordFlags struct {
	TopicTemplate          string `default:"${topic_template}" help:"Topic of each event; {aggregate_type} is replaced by the row's aggregate type."`
	TopicAllow             string `default:"${topic_allow}" help:"Regular expression (anchored at both ends) every event topic must match, e.g. 'outbox\\.event\\.(order|payment)'; events of other topics are dead-lettered (topic_not_allowed). Empty allows all."`
	MaxTopics              int    `default:"${max_topics}" help:"Most distinct event topics produced to (and created); events of further topics are dead-lettered (too_many_topics). The topics on the broker that the template makes (and --topic-allow allows) count, read at every start, so the bound holds across restarts; an outbox has tens of aggregate types, the bound stops a writer that invents them. Negative: no limit."`
	MaxTopicSeries         int    `default:"${max_topic_series}" help:"Most topics with their own walrelay_events_published_total series; the rest count under topic=\"other\". Negative: no limit."`
	CreateTopics           bool   `default:"${create_topics}" negatable:"" help:"Create missing topics (and the dead-letter topic) before producing to them."`
	TopicPartitions        int32  `default:"${topic_partitions}" help:"Partitions of created topics; -1 means the broker's default."`
	TopicReplicationFactor int16  `default:"${topic_replication_factor}" help:"Replication factor of created topics; -1 means the broker's default."`
	DeadLetterTopic        string `default:"${dead_letter_topic}" help:"Topic for invalid events (no aggregate type or id, a topic name Kafka rejects, too large)."`
	OnInvalid              string `default:"${on_invalid}" enum:"dlq,fail,skip" help:"What happens to an invalid event: dlq, fail (stop the relay), skip (log and drop)."`
	ColumnFlags            `embed:""`
	HeaderID               string        `default:"${header_id}" help:"Name of the id header."`
	HeaderType             string        `default:"${header_type}" help:"Name of the type header."`
	MaxRecordBytes         int           `default:"${max_record_bytes}" help:"Largest record the broker accepts (its message.max.bytes); larger events are invalid."`
	Compression            string        `default:"${compression}" enum:"none,gzip,snappy,lz4,zstd" help:"Producer compression: none, gzip, snappy, lz4, zstd."`
	Linger                 time.Duration `default:"${linger}" help:"How long the producer waits to fill a batch; 0 sends at once."`
	ValueFlags             `embed:""`
}

// TuningFlags trade latency, memory and load.
type TuningFlags struct {
	StatusInterval    time.Duration `default:"${status_interval}" help:"Longest time between standby status updates; shortened to a third of the replication connection's wal_sender_timeout when that is less, since the relay does not read the stream while it waits for Kafka."`
	ConfirmDelay      time.Duration `default:"${confirm_delay}" help:"Shortest time between status updates that only advance the confirmed position."`
	ShutdownTimeout   time.Duration `default:"${shutdown_timeout}" help:"On SIGINT/SIGTERM, how long to wait for outstanding acks before exiting (with exactly-once delivery, for the final Kafka commit too: the whole stop)."`
	MaxInflightEvents int64         `default:"${max_inflight_events}" help:"Events produced and not yet acknowledged, at most; bounds memory."`
	MaxInflightBytes  int64         `default:"${max_inflight_bytes}" help:"Approximate bytes produced and not yet acknowledged, at most; bounds memory."`
	BackoffMax        time.Duration `default:"${backoff_max}" help:"Longest wait between reconnection attempts (exponential with jitter, from ${backoff_min})."`
	ReceiveTimeout    time.Duration `default:"${receive_timeout}" help:"End a replication connection that carried nothing for this long, not even the reply to a request for one sent at half of it (like PostgreSQL's wal_receiver_timeout); then reconnect."`
	StartupTimeout    time.Duration `default:"${startup_timeout}" help:"How long to keep retrying unreachable PostgreSQL or Kafka, and to let creating the slot wait for open and prepared transactions to end, before the first stream; then exit 4, naming what it waited for (0: wait forever). An initial snapshot under way is not cut short. Once streaming, walrelay retries forever."`
	Binary            bool          `default:"${binary}" help:"Ask pgoutput for binary values (PostgreSQL 14+): less work for the walsender. Mapped columns must then be text-like, bytea, json/jsonb, uuid or integers (checked at start; rows of a column changed to another type later are dead-lettered as undecodable)."`
	ReadBufferBytes   int           `default:"${read_buffer_bytes}" help:"Largest read from the replication socket; larger reads mean fewer system calls."`
	SocketRecvBytes   int           `name:"socket-receive-buffer-bytes" default:"${socket_receive_bytes}" help:"SO_RCVBUF of the replication socket; 0 keeps the kernel's autotuning (better over high-latency links: 512 KiB carries about 50 MB/s at 10 ms round trip)."`
	MaxMessageBytes   int           `default:"${max_message_bytes}" help:"Largest replication message read into memory; a larger one (a huge outbox row) is read as a stream, its values over this size left out, and the row dead-lettered as too large. Must exceed --max-record-bytes."`
	ReadCoalesce      time.Duration `default:"${read_coalesce}" help:"After a small read, wait this long before the next so the stream arrives in larger pieces (less work for the walsender); adds at most this much latency."`
}

// HealthFlags keep the slot moving and visible.
type HealthFlags struct {
	HeartbeatInterval time.Duration `default:"${heartbeat_interval}" help:"Time between heartbeats (a WAL nudge in the source database, and a record on --heartbeat-topic when set); 0 disables."`
	HeartbeatQuery    string        `default:"${heartbeat_query}" help:"SQL run as the WAL nudge instead of pg_logical_emit_message(false, 'walrelay.heartbeat', now()::text) (like Debezium's heartbeat.action.query); '-' runs none. It runs with the relay's role: treat it as privileged configuration."`
	HeartbeatTopic    string        `default:"${heartbeat_topic}" help:"Topic receiving a heartbeat record (key: slot name, value: JSON with the slot, the time, whether it streams, the confirmed and the received LSN) every heartbeat interval; empty disables."`
	IdleAdvance       bool          `default:"${idle_advance}" negatable:"" help:"Confirm a keepalive's WAL position once everything received before it is acknowledged, so a quiet outbox in a busy database does not pin WAL. Turn off only to diagnose."`
	SlotPollInterval  time.Duration `default:"${slot_poll_interval}" help:"How often pg_replication_slots is read for the slot metrics and to detect an invalidated slot, and how often a WARN names the transactions creating the slot waits for."`
	ReadyMaxLag       time.Duration `default:"${ready_max_lag}" help:"Replication lag, and the replay lag of a standby decoded on, above which /readyz reports not ready; 0 disables the lag check."`
	PlannedOutage     time.Duration `default:"${planned_outage}" help:"The relay outage to plan for: walrelay warns at startup when idle_replication_slot_timeout, or max_slot_wal_keep_size at the server's WAL rate, would invalidate the slot during one this long; 0 disables the warning."`
	StandbyURL        []string      `name:"standby-url" placeholder:"URL" help:"URL of a standby of the primary (repeat the flag, or separate with commas; every node may be listed, a server that accepts writes is skipped): walrelay reads the slot's copy there, which the primary cannot see, and counts the failover as protected only when every standby's copy is synchronized and current. Give it as WALRELAY_STANDBY_URL, passwords in a passfile or PGPASSWORD: arguments are visible to every user in ps."`
}

// DeliveryFlags choose at-least-once or exactly-once delivery.
type DeliveryFlags struct {
	Delivery        string        `default:"${delivery}" enum:"at-least-once,exactly-once" help:"at-least-once (duplicates possible after a crash, each with the same id header) or exactly-once (Kafka transactions with a checkpoint; read_committed consumers see each row once)."`
	TransactionalID string        `default:"${transactional_id}" help:"Kafka transactional id for exactly-once delivery; default walrelay-<slot>, so that two relays of one slot share it (one streams, the other waits as a standby) and relays of different slots do not."`
	CheckpointTopic string        `default:"${checkpoint_topic}" help:"Compacted one-partition topic of exactly-once checkpoints (key: slot name); created when --create-topics."`
	TxnMaxEvents    int           `default:"${txn_max_events}" help:"Exactly-once: commit the Kafka transaction once it holds this many events (large PostgreSQL transactions are split)."`
	TxnMaxInterval  time.Duration `default:"${txn_max_interval}" help:"Exactly-once: commit the Kafka transaction at least this often, for a stream that never runs dry (it commits as soon as it does)."`
	TxnMinInterval  time.Duration `default:"${txn_min_interval}" help:"Exactly-once: when the stream runs dry, commit the Kafka transaction only once it is this old; raise it to trade latency for fewer Kafka transactions."`
	TxnTimeout      time.Duration `default:"${txn_timeout}" help:"Exactly-once: how long the broker keeps a Kafka transaction open before aborting it; at least twice --txn-max-interval (refused at startup otherwise)."`
	TxnProducers    int           `default:"${txn_producers}" help:"Exactly-once: transactional producers taking turns; 2 produces the next Kafka transaction's records, as <transactional-id>-1, while the last one commits (needs WRITE on that id too: a prefixed ACL covers both)."`
}

// flagGroup is a group of flags that sets its part of a relay.Config.
type flagGroup interface {
	apply(cfg *relay.Config) error
}

// relayConfig is relay.DefaultConfig with pgURL, the brokers and what the
// flag groups set: a flag left at its default (which is DefaultConfig's)
// changes nothing.
func relayConfig(pgURL string, brokers []string, log *zap.Logger, groups ...flagGroup) (relay.Config, error) {
	// A URL that does not parse is refused before any connection attempt,
	// without being quoted (a password may be anywhere in it).
	if err := slot.CheckURL(pgURL); err != nil {
		return relay.Config{}, err
	}
	cfg := relay.DefaultConfig()
	cfg.PGURL = pgURL
	if len(brokers) > 0 {
		cfg.KafkaOptions = append(cfg.KafkaOptions, kgo.SeedBrokers(brokers...))
	}
	// The daemon's log carries the Kafka client's warnings; an embedder
	// chooses its own (KafkaOptions).
	// A credential source that fails says so once; the client's line at
	// each connection attempt is dropped (kafkaauth.QuietLogger).
	cfg.KafkaOptions = append(cfg.KafkaOptions, kgo.WithLogger(kafkaauth.QuietLogger(kzap.New(log.Named("kafka"), kzap.Level(kgo.LogLevelWarn)))))
	for _, g := range groups {
		if err := g.apply(&cfg); err != nil {
			return relay.Config{}, err
		}
	}
	return cfg, nil
}

func (f SourceFlags) apply(cfg *relay.Config) error {
	tables, err := parseTables(f.Table)
	if err != nil {
		return err
	}
	cfg.Slot, cfg.Publication, cfg.Tables = f.Slot, f.Publication, tables
	cfg.CreatePublication, cfg.CreateSlot = f.CreatePublication, f.CreateSlot
	cfg.AlterPublication, cfg.AllowRowFilter = f.AlterPublication, f.AllowRowFilter
	cfg.NoFailoverSlot = !f.FailoverSlot
	cfg.RecordSchema = f.RecordSchema
	cfg.InitialSnapshot = f.Snapshot != "never"
	cfg.SnapshotWhere, cfg.SnapshotOrder = f.SnapshotWhere, f.SnapshotOrder
	return nil
}

func (f RecordFlags) apply(cfg *relay.Config) error {
	mapping, err := f.mapping()
	if err != nil {
		return err
	}
	codec, err := compression(f.Compression)
	if err != nil {
		return err
	}
	cfg.Mapping = mapping
	cfg.Compression, cfg.Linger = codec, f.Linger
	r := &cfg.Router
	r.TopicTemplate, r.TopicAllow = f.TopicTemplate, f.TopicAllow
	r.MaxTopics, r.MaxTopicSeries = f.MaxTopics, f.MaxTopicSeries
	r.DeadLetterTopic, r.OnInvalid = f.DeadLetterTopic, router.OnInvalid(f.OnInvalid)
	r.CreateTopics = f.CreateTopics
	r.TopicPartitions, r.TopicReplicationFactor = f.TopicPartitions, f.TopicReplicationFactor
	r.MaxRecordBytes = f.MaxRecordBytes
	r.HeaderID, r.HeaderType = f.HeaderID, f.HeaderType
	return f.ValueFlags.apply(cfg)
}

func (f TuningFlags) apply(cfg *relay.Config) error {
	cfg.StatusInterval, cfg.ConfirmDelay, cfg.ShutdownTimeout = f.StatusInterval, f.ConfirmDelay, f.ShutdownTimeout
	cfg.Router.MaxInflightEvents, cfg.Router.MaxInflightBytes = f.MaxInflightEvents, f.MaxInflightBytes
	cfg.BackoffMax = f.BackoffMax
	cfg.ReceiveTimeout, cfg.StartupTimeout = f.ReceiveTimeout, f.StartupTimeout
	cfg.Binary = f.Binary
	cfg.Read = slot.ReadOptions{
		BufferBytes:        f.ReadBufferBytes,
		SocketReceiveBytes: f.SocketRecvBytes,
		Coalesce:           f.ReadCoalesce,
		MaxMessageBytes:    f.MaxMessageBytes,
	}
	return nil
}

func (f HealthFlags) apply(cfg *relay.Config) error {
	cfg.HeartbeatInterval, cfg.HeartbeatQuery, cfg.HeartbeatTopic = f.HeartbeatInterval, f.HeartbeatQuery, f.HeartbeatTopic
	cfg.NoIdleAdvance = !f.IdleAdvance
	cfg.SlotPollInterval = f.SlotPollInterval
	cfg.ReadyMaxLag = f.ReadyMaxLag
	cfg.PlannedOutage = f.PlannedOutage
	cfg.StandbyURLs = f.StandbyURL
	return nil
}

func (f DeliveryFlags) apply(cfg *relay.Config) error {
	cfg.ExactlyOnce = f.Delivery == "exactly-once"
	cfg.Router.TransactionalID, cfg.Router.CheckpointTopic = f.TransactionalID, f.CheckpointTopic
	cfg.Router.TransactionTimeout = f.TxnTimeout
	cfg.Router.TxnProducers = f.TxnProducers
	cfg.TxnMaxEvents, cfg.TxnMaxInterval, cfg.TxnMinInterval = f.TxnMaxEvents, f.TxnMaxInterval, f.TxnMinInterval
	return nil
}
