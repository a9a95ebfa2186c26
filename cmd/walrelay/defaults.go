package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/alecthomas/kong"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/relay"
)

// parserOptions are the options every parser of the command line is built
// with, the binary's and the tests': the flags' defaults are variables
// (${slot}, …) only these define.
func parserOptions() []kong.Option {
	return []kong.Option{
		kong.Name("walrelay"),
		kong.Description("PostgreSQL outbox to Kafka relay: committed outbox INSERTs, in commit order, confirmed only after Kafka acknowledges."),
		kong.DefaultEnvars("WALRELAY"),
		kong.Vars{"version": version},
		defaultVars(),
	}
}

// defaultVars are the defaults of the flags that set a relay.Config field,
// from relay.DefaultConfig: the flags restate none of them, so `walrelay
// run` and `walrelay dev` without flags run with the configuration an
// embedder starting from DefaultConfig gets (TestDaemonDevAndEmbedder…).
func defaultVars() kong.Vars {
	d := relay.DefaultConfig()
	tables := make([]string, len(d.Tables))
	for i, t := range d.Tables {
		tables[i] = t.String()
	}
	snapshot := "never"
	if d.InitialSnapshot {
		snapshot = "initial"
	}
	delivery := "at-least-once"
	if d.ExactlyOnce {
		delivery = "exactly-once"
	}
	b, n, dur := strconv.FormatBool, strconv.Itoa, flagDuration
	return kong.Vars{
		"publication":              d.Publication,
		"slot":                     d.Slot,
		"table":                    strings.Join(tables, ","),
		"create_publication":       b(d.CreatePublication),
		"alter_publication":        b(d.AlterPublication),
		"allow_row_filter":         b(d.AllowRowFilter),
		"create_slot":              b(d.CreateSlot),
		"failover_slot":            b(!d.NoFailoverSlot),
		"record_schema":            d.RecordSchema,
		"snapshot":                 snapshot,
		"snapshot_where":           d.SnapshotWhere,
		"snapshot_order":           d.SnapshotOrder,
		"column_id":                d.Mapping.ID,
		"column_aggregate_type":    d.Mapping.AggregateType,
		"column_aggregate_id":      d.Mapping.AggregateID,
		"column_type":              d.Mapping.Type,
		"column_payload":           d.Mapping.Payload,
		"column_traceparent":       d.Mapping.TraceParent,
		"column_tracestate":        d.Mapping.TraceState,
		"topic_template":           d.Router.TopicTemplate,
		"subject_strategy":         string(d.Values.Strategy),
		"schema_refresh":           dur(d.Values.Refresh),
		"topic_allow":              d.Router.TopicAllow,
		"max_topics":               n(d.Router.MaxTopics),
		"max_topic_series":         n(d.Router.MaxTopicSeries),
		"create_topics":            b(d.Router.CreateTopics),
		"topic_partitions":         strconv.Itoa(int(d.Router.TopicPartitions)),
		"topic_replication_factor": strconv.Itoa(int(d.Router.TopicReplicationFactor)),
		"dead_letter_topic":        d.Router.DeadLetterTopic,
		"on_invalid":               string(d.Router.OnInvalid),
		"header_id":                d.Router.HeaderID,
		"header_type":              d.Router.HeaderType,
		"max_record_bytes":         n(d.Router.MaxRecordBytes),
		"compression":              codecName(d.Compression),
		"linger":                   dur(d.Linger),
		"status_interval":          dur(d.StatusInterval),
		"confirm_delay":            dur(d.ConfirmDelay),
		"shutdown_timeout":         dur(d.ShutdownTimeout),
		"max_inflight_events":      strconv.FormatInt(d.Router.MaxInflightEvents, 10),
		"max_inflight_bytes":       strconv.FormatInt(d.Router.MaxInflightBytes, 10),
		"backoff_min":              dur(d.BackoffMin),
		"backoff_max":              dur(d.BackoffMax),
		"receive_timeout":          dur(d.ReceiveTimeout),
		"startup_timeout":          dur(d.StartupTimeout),
		"binary":                   b(d.Binary),
		"read_buffer_bytes":        n(d.Read.BufferBytes),
		"socket_receive_bytes":     n(d.Read.SocketReceiveBytes),
		"max_message_bytes":        n(d.Read.MaxMessageBytes),
		"read_coalesce":            dur(d.Read.Coalesce),
		"heartbeat_interval":       dur(d.HeartbeatInterval),
		"heartbeat_query":          d.HeartbeatQuery,
		"heartbeat_topic":          d.HeartbeatTopic,
		"idle_advance":             b(!d.NoIdleAdvance),
		"slot_poll_interval":       dur(d.SlotPollInterval),
		"ready_max_lag":            dur(d.ReadyMaxLag),
		"planned_outage":           dur(d.PlannedOutage),
		"delivery":                 delivery,
		"transactional_id":         d.Router.TransactionalID,
		"checkpoint_topic":         d.Router.CheckpointTopic,
		"txn_max_events":           n(d.TxnMaxEvents),
		"txn_max_interval":         dur(d.TxnMaxInterval),
		"txn_min_interval":         dur(d.TxnMinInterval),
		"txn_timeout":              dur(d.Router.TransactionTimeout),
		"txn_producers":            n(d.Router.TxnProducers),
	}
}

// flagDuration writes d the way a person types it: 2m rather than 2m0s,
// 200us rather than 200µs. time.ParseDuration reads both.
func flagDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return strings.ReplaceAll(s, "µs", "us")
}

// codecs are the producer compressions --compression names.
var codecs = map[string]kgo.CompressionCodec{
	"none":   kgo.NoCompression(),
	"gzip":   kgo.GzipCompression(),
	"snappy": kgo.SnappyCompression(),
	"lz4":    kgo.Lz4Compression(),
	"zstd":   kgo.ZstdCompression(),
}

// codecName is the --compression name of c.
func codecName(c kgo.CompressionCodec) string {
	for name, codec := range codecs {
		if codec == c {
			return name
		}
	}
	panic(fmt.Sprintf("relay.DefaultConfig's compression %v has no --compression name", c))
}

// compression is the codec --compression names.
func compression(name string) (kgo.CompressionCodec, error) {
	if c, ok := codecs[name]; ok {
		return c, nil
	}
	return kgo.CompressionCodec{}, fmt.Errorf("--compression %q: want none, gzip, snappy, lz4 or zstd", name)
}
