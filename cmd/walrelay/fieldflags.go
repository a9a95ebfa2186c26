package main

import (
	"errors"
	"sort"
	"strings"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// The libraries (relay, router, source, doctor, …) name the configuration
// field to change in their errors and logs, as go doc spells it
// (package.Type.Field, e.g. relay.Config.StartupTimeout), or a setting of
// one (source.SetupConfig.Snapshot=nil), and the function to run where
// walrelay runs a command (relay.PublishSnapshot): an embedder has no
// flags. The command line speaks flags, so every message walrelay prints
// or logs goes through speakFlags, which puts each field's flag (each
// function's command) in its place. This table is the one place that
// knows which flag sets which field; TestFieldFlags checks that every field
// and function in it exists, that every flag and command in it is one of
// walrelay's, and that the libraries name none it lacks.
var fieldFlags = map[string]string{
	"relay.Config.PGURL":                     "--pg-url",
	"relay.Config.PrimaryURL":                "--primary-url",
	"source.SetupConfig.PrimaryURL":          "--primary-url",
	"relay.Config.Tables":                    "--table",
	"relay.Config.Publication":               "--publication",
	"relay.Config.StartupTimeout":            "--startup-timeout",
	"relay.Config.StatusInterval":            "--status-interval",
	"relay.Config.ConfirmDelay":              "--confirm-delay",
	"relay.Config.ShutdownTimeout":           "--shutdown-timeout",
	"relay.Config.BackoffMax":                "--backoff-max",
	"relay.Config.SlotPollInterval":          "--slot-poll-interval",
	"relay.Config.StandbyURLs":               "--standby-url",
	"relay.Config.ReceiveTimeout":            "--receive-timeout",
	"relay.Config.Linger":                    "--linger",
	"relay.Config.RecordSchema":              "--record-schema",
	"relay.Config.TxnMaxEvents":              "--txn-max-events",
	"relay.Config.TxnMaxInterval":            "--txn-max-interval",
	"relay.Config.PlannedOutage":             "--planned-outage",
	"relay.Config.ReadyMaxLag":               "--ready-max-lag",
	"relay.Config.HeartbeatInterval":         "--heartbeat-interval",
	"relay.Config.HeartbeatQuery":            "--heartbeat-query",
	"relay.Config.NoIdleAdvance=false":       "--idle-advance",
	"relay.Config.Router.MaxInflightEvents":  "--max-inflight-events",
	"relay.Config.Router.MaxInflightBytes":   "--max-inflight-bytes",
	"router.Config.MaxRecordBytes":           "--max-record-bytes",
	"relay.Config.TxnMinInterval":            "--txn-min-interval",
	"relay.Config.Read.MaxMessageBytes":      "--max-message-bytes",
	"relay.Config.Read.BufferBytes":          "--read-buffer-bytes",
	"relay.Config.Router.MaxRecordBytes":     "--max-record-bytes",
	"relay.Config.Router.TransactionTimeout": "--txn-timeout",
	"relay.Config.Router.TransactionalID":    "--transactional-id",
	"router.Config.MaxTopics":                "--max-topics",
	"router.Config.TopicPartitions":          "--topic-partitions",
	"router.Config.TopicReplicationFactor":   "--topic-replication-factor",
	"router.Config.MaxInflightEvents":        "--max-inflight-events",
	"router.Config.MaxInflightBytes":         "--max-inflight-bytes",
	"router.Config.TopicTemplate":            "--topic-template",
	"router.Config.DeadLetterTopic":          "--dead-letter-topic",
	"router.Config.OnInvalid":                "--on-invalid",
	"router.Config.HeaderID":                 "--header-id",
	"router.Config.HeaderType":               "--header-type",
	"router.Config.CreateTopics":             "--create-topics",
	"router.Config.TransactionTimeout":       "--txn-timeout",
	"router.Config.TxnProducers":             "--txn-producers",
	"router.Config.CheckpointTopic":          "--checkpoint-topic",
	"source.SetupConfig.URL":                 "--pg-url",
	"source.SetupConfig.Slot":                "--slot",
	"source.SetupConfig.Snapshot=nil":        "--snapshot never",
	"source.SetupConfig.Publication":         "--publication",
	"source.SetupConfig.Tables":              "--table",
	"source.SetupConfig.CreatePublication":   "--create-publication",
	"source.SetupConfig.AlterPublication":    "--alter-publication",
	"source.SetupConfig.AllowRowFilter":      "--allow-row-filter",
	"source.SetupConfig.CreateSlot":          "--create-slot",
	"source.SetupConfig.Failover":            "--failover-slot",
	"source.SetupConfig.RecordSchema":        "--record-schema",
	"source.SetupConfig.Binary":              "--binary",
	"source.SetupConfig.TopicTemplate":       "--topic-template",
	"source.SetupConfig.AcceptGap":           "walrelay setup --accept-gap",
	"source.Prepare":                         "walrelay setup",
	"relay.Relay.Run":                        "walrelay run",
	"relay.PublishSnapshot":                  "walrelay snapshot",
	"doctor.StatusOptions.MaxLagBytes":       "--max-lag-bytes",
	"doctor.StatusOptions.PlannedOutage":     "--planned-outage",
	"doctor.StatusOptions.Explain":           "walrelay status --explain",
	"router.Config.MaxTopicSeries":           "--max-topic-series",
	"slot.ReadOptions.MaxMessageBytes":       "--max-message-bytes",
	"snapshot.Config.Order":                  "--snapshot-order (walrelay snapshot: --order)",
	"decoder.Mapping":                        "the matching --column-* or --header-column flag",
	"kgo.SeedBrokers":                        "--brokers",
	"kafkaauth.OAuth.TokenURL":               "--kafka-oauth-token-url",
	"kafkaauth.OAuth.ClientID":               "--kafka-oauth-client-id",
	"kafkaauth.OAuth.ClientSecret":           "--kafka-oauth-client-secret (or --kafka-oauth-client-secret-file)",
	"kafkaauth.OAuth.ClientSecretFile":       "--kafka-oauth-client-secret-file",
	"kafkaauth.OAuth.Scopes":                 "--kafka-oauth-scope",
	"kafkaauth.OAuth.Audience":               "--kafka-oauth-audience",
	"kafkaauth.OAuth.Extensions":             "--kafka-oauth-extension",
	"kafkaauth.OAuth.TokenFile":              "--kafka-oauth-token-file",
	"kafkaauth.TLSFiles.CA":                  "--kafka-tls-ca",
	"kafkaauth.TLSFiles.Cert":                "--kafka-tls-cert",
	"kafkaauth.TLSFiles.Key":                 "--kafka-tls-key",
	"pgauth.Command.Argv":                    "--pg-password-command",
	"pgauth.RDSIAM.Region":                   "--pg-aws-region",
	"pgauth.RDSIAM":                          "--pg-aws-iam",
	"schema.Config.URLs":                     "--schema-registry-url",
	"relay.Config.Values":                    "--value-format",
	"schema.Config.Default":                  "--value-format",
	"schema.Config.Topics":                   "--value-format TOPIC=",
	"schema.Config.Types":                    "--value-format type:TYPE=",
	"schema.Config.Strategy":                 "--subject-strategy",
	"schema.Config.Refresh":                  "--schema-refresh",
}

// flagSpeaker rewrites field names into flags, the longest name first so
// that relay.Config.Router.TransactionalID is not read as a shorter one.
var flagSpeaker = func() *strings.Replacer {
	fields := make([]string, 0, len(fieldFlags))
	for f := range fieldFlags {
		fields = append(fields, f)
	}
	sort.Slice(fields, func(i, j int) bool { return len(fields[i]) > len(fields[j]) })
	var pairs []string
	for _, f := range fields {
		pairs = append(pairs, f, fieldFlags[f])
	}
	return strings.NewReplacer(pairs...)
}()

// speakFlags is s with each configuration field a library named replaced
// by its flag.
func speakFlags(s string) string { return flagSpeaker.Replace(s) }

// flagError is an error whose message speaks flags; errors.Is and As
// still see the library's error under it.
type flagError struct{ err error }

func (e flagError) Error() string { return speakFlags(e.err.Error()) }
func (e flagError) Unwrap() error { return e.err }

// speakingFlags wraps err so that its message speaks flags (nil stays nil).
func speakingFlags(err error) error {
	var fe flagError
	if err == nil || errors.As(err, &fe) {
		return err
	}
	return flagError{err}
}

// flagCore is a zap core whose messages and string and error fields speak
// flags: the libraries' log lines name fields too.
type flagCore struct{ zapcore.Core }

func (c flagCore) With(fields []zapcore.Field) zapcore.Core {
	return flagCore{c.Core.With(flagFields(fields))}
}

func (c flagCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c flagCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	e.Message = speakFlags(e.Message)
	return c.Core.Write(e, flagFields(fields))
}

// flagFields rewrites the string and error fields; the others carry no
// field name.
func flagFields(fields []zapcore.Field) []zapcore.Field {
	var out []zapcore.Field
	for i, f := range fields {
		var g zapcore.Field
		switch {
		case f.Type == zapcore.StringType && speakFlags(f.String) != f.String:
			g = zap.String(f.Key, speakFlags(f.String))
		case f.Type == zapcore.ErrorType:
			err, _ := f.Interface.(error)
			if err == nil || speakFlags(err.Error()) == err.Error() {
				continue
			}
			g = zap.NamedError(f.Key, speakingFlags(err))
		default:
			continue
		}
		if out == nil {
			out = append([]zapcore.Field(nil), fields...)
		}
		out[i] = g
	}
	if out == nil {
		return fields
	}
	return out
}
