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
	return cfg.Build()
}

// SourceFlags say where the events come from.
type SourceFlags struct {
	Publication       string   `default:"walrelay_outbox" help:"Publication the slot streams (created FOR TABLE <tables> WITH (publish = 'insert', publish_via_partition_root = true) when missing)."`
	Slot              string   `default:"walrelay" help:"Logical replication slot (pgoutput)."`
	Table             []string `default:"public.outbox" help:"Outbox table, schema.table; repeat the flag (or separate with commas) for several."`
	CreatePublication bool     `default:"true" negatable:"" help:"Create the publication when missing, and add outbox tables it lacks to a publication walrelay created."`
	AlterPublication  bool     `help:"Add missing outbox tables to an existing publication walrelay did not create (it may be shared: every subscriber of it then receives them)."`
	AllowRowFilter    bool     `help:"Accept a publication row filter (WHERE) on an outbox table; rows it filters out are never published. Logged at WARN at startup."`
	CreateSlot        bool     `default:"true" negatable:"" help:"Create the replication slot when missing, at a first start: a slot walrelay streamed from that disappeared (a failover, a drop) is never recreated without walrelay setup --accept-gap."`
	FailoverSlot      bool     `default:"true" negatable:"" help:"PostgreSQL 17+: make the slot a failover slot (created so, or altered), which standbys with sync_replication_slots = on keep a copy of that survives their promotion."`
	RecordSchema      string   `default:"walrelay" help:"Schema of walrelay's record of what each slot streams from (table <schema>.slots, created when missing): with it walrelay refuses to replace a slot, publication or outbox table that changed under it."`
	Snapshot          string   `default:"initial" enum:"initial,never" help:"initial: when walrelay creates the slot, first publish the rows already in the outbox tables (at the slot's consistent point), then stream; never: publish only rows committed after the slot exists."`
	SnapshotWhere     string   `placeholder:"SQL" help:"SQL condition the rows of the initial snapshot must meet (e.g. 'sent_at IS NULL'); empty for every row."`
	SnapshotOrder     string   `placeholder:"SQL" help:"SQL ORDER BY list of the initial snapshot (e.g. 'created_at, id'); empty for the table's primary key."`
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
	ColumnID            string   `default:"id" help:"Outbox column whose text becomes the id header."`
	ColumnAggregateType string   `default:"aggregate_type" help:"Outbox column that selects the topic."`
	ColumnAggregateID   string   `default:"aggregate_id" help:"Outbox column that becomes the record key."`
	ColumnType          string   `default:"type" help:"Outbox column that becomes the type header; empty for none."`
	ColumnPayload       string   `default:"payload" help:"Outbox column that becomes the record value (json/jsonb/text as is, bytea as raw bytes, NULL as a tombstone)."`
	HeaderColumn        []string `placeholder:"COLUMN[=HEADER]" help:"Extra outbox column to send as a header (named HEADER, default the column name); repeatable."`
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
		preset(&c.ColumnAggregateType, "aggregate_type", "aggregatetype")
		preset(&c.ColumnAggregateID, "aggregate_id", "aggregateid")
		preset(&c.ColumnType, "type", "")
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
	TopicTemplate          string `default:"outbox.event.{aggregate_type}" help:"Topic of each event; {aggregate_type} is replaced by the row's aggregate type."`
	TopicAllow             string `help:"Regular expression (anchored at both ends) every event topic must match, e.g. 'outbox\\.event\\.(order|payment)'; events of other topics are dead-lettered (topic_not_allowed). Empty allows all."`
	MaxTopics              int    `default:"1000" help:"Most distinct event topics produced to (and created); events of further topics are dead-lettered (too_many_topics). Negative: no limit."`
	MaxTopicSeries         int    `default:"100" help:"Most topics with their own walrelay_events_published_total series; the rest count under topic=\"other\". Negative: no limit."`
	CreateTopics           bool   `default:"true" negatable:"" help:"Create missing topics (and the dead-letter topic) before producing to them."`
	TopicPartitions        int32  `default:"-1" help:"Partitions of created topics; -1 means the broker's default."`
	TopicReplicationFactor int16  `default:"-1" help:"Replication factor of created topics; -1 means the broker's default."`
	DeadLetterTopic        string `default:"walrelay.dlq" help:"Topic for invalid events (no aggregate type or id, a topic name Kafka rejects, too large)."`
	OnInvalid              string `default:"dlq" enum:"dlq,fail,skip" help:"What happens to an invalid event: dlq, fail (stop the relay), skip (log and drop)."`
	ColumnFlags            `embed:""`
	HeaderID               string        `default:"id" help:"Name of the id header."`
	HeaderType             string        `default:"type" help:"Name of the type header."`
	MaxRecordBytes         int           `default:"1000012" help:"Largest record the broker accepts (its message.max.bytes); larger events are invalid."`
	Compression            string        `default:"none" enum:"none,gzip,snappy,lz4,zstd" help:"Producer compression: none, gzip, snappy, lz4, zstd."`
	Linger                 time.Duration `default:"5ms" help:"How long the producer waits to fill a batch; 0 sends at once."`
}

// TuningFlags trade latency, memory and load.
type TuningFlags struct {
	StatusInterval    time.Duration `default:"10s" help:"Longest time between standby status updates; keep it well under the server's wal_sender_timeout."`
	ConfirmDelay      time.Duration `default:"100ms" help:"Shortest time between status updates that only advance the confirmed position."`
	ShutdownTimeout   time.Duration `default:"30s" help:"On SIGINT/SIGTERM, how long to wait for outstanding acks before exiting."`
	MaxInflightEvents int64         `default:"50000" help:"Events produced and not yet acknowledged, at most; bounds memory."`
	MaxInflightBytes  int64         `default:"67108864" help:"Approximate bytes produced and not yet acknowledged, at most; bounds memory."`
	BackoffMax        time.Duration `default:"30s" help:"Longest wait between reconnection attempts (exponential with jitter, from 500ms)."`
	ReceiveTimeout    time.Duration `default:"60s" help:"End a replication connection that carried nothing for this long, not even the reply to a request for one sent at half of it (like PostgreSQL's wal_receiver_timeout); then reconnect."`
	StartupTimeout    time.Duration `default:"2m" help:"How long to keep retrying unreachable PostgreSQL or Kafka before the first stream; then exit with an error. Once streaming, walrelay retries forever."`
	Binary            bool          `help:"Ask pgoutput for binary values (PostgreSQL 14+): less work for the walsender."`
	ReadBufferBytes   int           `default:"1048576" help:"Largest read from the replication socket; larger reads mean fewer system calls."`
	SocketRecvBytes   int           `name:"socket-receive-buffer-bytes" default:"524288" help:"SO_RCVBUF of the replication socket; 0 keeps the kernel's autotuning (better over high-latency links: 512 KiB carries about 50 MB/s at 10 ms round trip)."`
	MaxMessageBytes   int           `default:"67108864" help:"Largest replication message read into memory; a larger one (a huge outbox row) is read as a stream, its values over this size left out, and the row dead-lettered as too large. Must exceed --max-record-bytes."`
	ReadCoalesce      time.Duration `default:"200us" help:"After a small read, wait this long before the next so the stream arrives in larger pieces (less work for the walsender); adds at most this much latency."`
}

// HealthFlags keep the slot moving and visible.
type HealthFlags struct {
	HeartbeatInterval time.Duration `default:"30s" help:"Time between heartbeats (a WAL nudge in the source database, and a record on --heartbeat-topic when set); 0 disables."`
	HeartbeatQuery    string        `help:"SQL run as the WAL nudge instead of pg_logical_emit_message(false, 'walrelay.heartbeat', now()::text) (like Debezium's heartbeat.action.query); '-' runs none."`
	HeartbeatTopic    string        `help:"Topic receiving a heartbeat record (key: slot name, value: JSON status) every heartbeat interval; empty disables."`
	IdleAdvance       bool          `default:"true" negatable:"" help:"Confirm a keepalive's WAL position once everything received before it is acknowledged, so a quiet outbox in a busy database does not pin WAL. Turn off only to diagnose."`
	SlotPollInterval  time.Duration `default:"10s" help:"How often pg_replication_slots is read for the slot metrics and to detect an invalidated slot."`
	ReadyMaxLag       time.Duration `default:"60s" help:"Replication lag above which /readyz reports not ready; 0 disables the lag check."`
	PlannedOutage     time.Duration `default:"24h" help:"The relay outage to plan for: walrelay warns at startup when idle_replication_slot_timeout, or max_slot_wal_keep_size at the server's WAL rate, would invalidate the slot during one this long; 0 disables the warning."`
}

// DeliveryFlags choose at-least-once or exactly-once delivery.
type DeliveryFlags struct {
	Delivery        string        `default:"at-least-once" enum:"at-least-once,exactly-once" help:"at-least-once (duplicates possible after a crash, each with the same id header) or exactly-once (Kafka transactions with a checkpoint; read_committed consumers see each row once)."`
	TransactionalID string        `help:"Kafka transactional id for exactly-once delivery; default walrelay-<slot>, so that two relays of one slot share it (one streams, the other waits as a standby) and relays of different slots do not."`
	CheckpointTopic string        `default:"walrelay.checkpoints" help:"Compacted one-partition topic of exactly-once checkpoints (key: slot name); created when --create-topics."`
	TxnMaxEvents    int           `default:"10000" help:"Exactly-once: commit the Kafka transaction once it holds this many events (large PostgreSQL transactions are split)."`
	TxnMaxInterval  time.Duration `default:"100ms" help:"Exactly-once: commit the Kafka transaction at least this often, for a stream that never runs dry (it commits as soon as it does)."`
	TxnMinInterval  time.Duration `default:"0s" help:"Exactly-once: when the stream runs dry, commit the Kafka transaction only once it is this old; raise it to trade latency for fewer Kafka transactions."`
	TxnTimeout      time.Duration `default:"60s" help:"Exactly-once: how long the broker keeps a Kafka transaction open before aborting it; at least twice --txn-max-interval."`
}

// relayConfig assembles the relay's configuration from the flag groups.
func relayConfig(pgURL string, brokers []string, src SourceFlags, rec RecordFlags, tun TuningFlags, hf HealthFlags, df DeliveryFlags, log *zap.Logger) (relay.Config, error) {
	// A URL that does not parse is refused before any connection attempt,
	// without being quoted (a password may be anywhere in it).
	if err := slot.CheckURL(pgURL); err != nil {
		return relay.Config{}, err
	}
	tables, err := parseTables(src.Table)
	if err != nil {
		return relay.Config{}, err
	}
	mapping, err := rec.mapping()
	if err != nil {
		return relay.Config{}, err
	}
	codec, err := compression(rec.Compression)
	if err != nil {
		return relay.Config{}, err
	}
	kopts := []kgo.Opt{
		kgo.ClientID("walrelay"),
		kgo.ProducerBatchCompression(codec),
		kgo.ProducerLinger(rec.Linger),
		kgo.WithLogger(kzap.New(log.Named("kafka"), kzap.Level(kgo.LogLevelWarn))),
	}
	if len(brokers) > 0 {
		kopts = append(kopts, kgo.SeedBrokers(brokers...))
	}
	return relay.Config{
		PGURL:             pgURL,
		Slot:              src.Slot,
		Publication:       src.Publication,
		Tables:            tables,
		Mapping:           mapping,
		CreatePublication: src.CreatePublication,
		CreateSlot:        src.CreateSlot,
		NoFailoverSlot:    !src.FailoverSlot,
		RecordSchema:      src.RecordSchema,
		AlterPublication:  src.AlterPublication,
		AllowRowFilter:    src.AllowRowFilter,
		InitialSnapshot:   src.Snapshot != "never",
		SnapshotWhere:     src.SnapshotWhere,
		SnapshotOrder:     src.SnapshotOrder,
		Binary:            tun.Binary,
		Read: slot.ReadOptions{
			BufferBytes:        tun.ReadBufferBytes,
			SocketReceiveBytes: tun.SocketRecvBytes,
			Coalesce:           tun.ReadCoalesce,
			MaxMessageBytes:    tun.MaxMessageBytes,
		},
		Router: router.Config{
			TopicTemplate:          rec.TopicTemplate,
			TopicAllow:             rec.TopicAllow,
			MaxTopics:              rec.MaxTopics,
			MaxTopicSeries:         rec.MaxTopicSeries,
			DeadLetterTopic:        rec.DeadLetterTopic,
			OnInvalid:              router.OnInvalid(rec.OnInvalid),
			CreateTopics:           rec.CreateTopics,
			TopicPartitions:        rec.TopicPartitions,
			TopicReplicationFactor: rec.TopicReplicationFactor,
			MaxInflightEvents:      tun.MaxInflightEvents,
			MaxInflightBytes:       tun.MaxInflightBytes,
			MaxRecordBytes:         rec.MaxRecordBytes,
			HeaderID:               rec.HeaderID,
			HeaderType:             rec.HeaderType,
			TransactionalID:        df.TransactionalID,
			CheckpointTopic:        df.CheckpointTopic,
			TransactionTimeout:     df.TxnTimeout,
		},
		ExactlyOnce:     df.Delivery == "exactly-once",
		TxnMaxEvents:    df.TxnMaxEvents,
		TxnMaxInterval:  df.TxnMaxInterval,
		TxnMinInterval:  df.TxnMinInterval,
		KafkaOptions:    kopts,
		StatusInterval:  tun.StatusInterval,
		ConfirmDelay:    tun.ConfirmDelay,
		ShutdownTimeout: tun.ShutdownTimeout,
		BackoffMax:      tun.BackoffMax,
		StartupTimeout:  tun.StartupTimeout,
		ReceiveTimeout:  tun.ReceiveTimeout,

		NoIdleAdvance:     !hf.IdleAdvance,
		HeartbeatInterval: hf.HeartbeatInterval,
		HeartbeatQuery:    hf.HeartbeatQuery,
		HeartbeatTopic:    hf.HeartbeatTopic,
		SlotPollInterval:  hf.SlotPollInterval,
		ReadyMaxLag:       readyMaxLag(hf.ReadyMaxLag),
		PlannedOutage:     readyMaxLag(hf.PlannedOutage),
	}, nil
}

// readyMaxLag maps a flag's "0 disables" to the relay's negative value.
func readyMaxLag(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

func compression(name string) (kgo.CompressionCodec, error) {
	switch name {
	case "none":
		return kgo.NoCompression(), nil
	case "gzip":
		return kgo.GzipCompression(), nil
	case "snappy":
		return kgo.SnappyCompression(), nil
	case "lz4":
		return kgo.Lz4Compression(), nil
	case "zstd":
		return kgo.ZstdCompression(), nil
	}
	return kgo.CompressionCodec{}, fmt.Errorf("--compression %q: want none, gzip, snappy, lz4 or zstd", name)
}
