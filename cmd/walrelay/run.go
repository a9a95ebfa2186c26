package main

import (
	"context"
	"errors"
	"io"
	"os"
	"runtime/pprof"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
)

// runCmd is `walrelay run`, the daemon.
type runCmd struct {
	PGURL         string   `name:"pg-url" required:"" help:"Source database URL (postgres://user@host:5432/db?sslrootcert=…; sslmode defaults to verify-full, sslcert and sslkey for a client certificate): the primary, or a hot standby of it (PostgreSQL 16+) with --primary-url, never a connection pooler such as pgbouncer (refused at start); the replication connection is derived from it. Give it as WALRELAY_PG_URL and the password in a passfile or PGPASSWORD: arguments are visible to every user in ps."`
	PrimaryURL    string   `name:"primary-url" placeholder:"URL" help:"Decode on a hot standby (PostgreSQL 16+): --pg-url names the standby, which holds the slot and the replication connection, and this URL its primary (for a standby of a standby, the primary at the top of the chain), where walrelay writes its heartbeat, publication and record (and asks for pg_log_standby_snapshot() while creating the slot). The standby needs hot_standby_feedback = on and primary_slot_name (a physical slot on its upstream; an intermediate standby the same); the primary wal_level = logical. Give it as WALRELAY_PRIMARY_URL, the password in a passfile or PGPASSWORD."`
	Brokers       []string `required:"" help:"Kafka bootstrap brokers, host:port, comma-separated."`
	MetricsAddr   string   `default:":9187" help:"Address serving /metrics, /healthz and /readyz (all interfaces by default: bind to one, e.g. 127.0.0.1:9187, or protect it with --web-config-file); empty disables."`
	WebConfigFile string   `name:"web-config-file" aliases:"web.config.file" placeholder:"FILE" help:"Prometheus exporter web configuration (TLS, basic auth) for the --metrics-addr listener, the format exporters read with --web.config.file."`
	CPUProfile    string   `placeholder:"FILE" help:"Write a CPU profile (go tool pprof) to FILE until exit, for diagnosing performance."`

	KafkaFlags    `embed:""`
	PGAuthFlags   `embed:""`
	SourceFlags   `embed:""`
	RecordFlags   `embed:""`
	TuningFlags   `embed:""`
	HealthFlags   `embed:""`
	DeliveryFlags `embed:""`
}

// Validate refuses malformed flags before anything is connected (kong
// calls it; its errors exit 80).
func (c *runCmd) Validate() error {
	if err := validateSource(c.PGURL, c.Slot, &c.Publication); err != nil {
		return err
	}
	return validatePrimaryURL(c.PrimaryURL)
}

func (c *runCmd) Run(ctx context.Context, lf *LogFlags) error {
	log, err := lf.logger()
	if err != nil {
		return err
	}
	defer log.Sync()
	if err := c.PGAuthFlags.install(ctx, log); err != nil {
		return err
	}
	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			return &exitError{code: 2, err: err}
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return &exitError{code: 2, err: err}
		}
		defer pprof.StopCPUProfile()
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m := metrics.New(reg)

	// Everything up to relay.New checks the configuration alone: its
	// errors are malformed flags. The board of what holds delivery is
	// made first, so that the Kafka token source reports into it too.
	cfg, err := c.config(ctx, log, holds.New(log, m))
	if err != nil {
		return usageError(err)
	}
	tracer, stopTracing, err := startTracing(ctx, m, log)
	if err != nil {
		return usageError(err)
	}
	defer stopTracing()
	if tracer != nil {
		cfg.Router.Tracer = tracer
	}
	r, err := relay.New(cfg, log, m)
	if err != nil {
		return usageError(err)
	}
	if c.MetricsAddr != "" {
		_, stop, err := serveHTTP(httpOptions{Addr: c.MetricsAddr, WebConfigFile: c.WebConfigFile}, reg, r.Ready, r.Status, log)
		if err != nil {
			return &exitError{code: exitFailed, err: err}
		}
		defer stop()
	}
	sslMode, _ := slot.SSLMode(c.PGURL)
	log.Info("walrelay starting", zap.String("version", version), zap.String("postgres", slot.Redact(c.PGURL)), zap.String("pg_sslmode", sslMode),
		zap.Strings("brokers", c.Brokers), zap.String("slot", c.Slot), zap.String("publication", c.Publication),
		zap.Strings("tables", c.Table), zap.String("kafka_sasl", c.KafkaSASLMechanism), zap.Bool("kafka_tls", c.KafkaFlags.tlsEnabled()))
	// What the operator relaxed, loudly, once at startup.
	warnPGTLS(log, c.PGURL)
	if c.PrimaryURL != "" {
		log.Info("decoding on a hot standby: writing the heartbeat, publication and record on its primary", zap.String("primary", slot.Redact(c.PrimaryURL)))
		warnPGTLS(log, c.PrimaryURL)
	}
	for _, w := range c.KafkaFlags.warnings() {
		log.Warn(w)
	}
	if err := r.Run(ctx); err != nil {
		err = c.KafkaFlags.explain(err)
		log.Error("walrelay stopped", zap.Error(err))
		if errors.Is(err, router.ErrFenced) {
			return &exitError{code: exitFenced, err: err}
		}
		var timeout *relay.StartupTimeoutError
		if errors.As(err, &timeout) {
			return &exitError{code: exitStartupTimeout, err: err}
		}
		return &exitError{code: exitFailed, err: err}
	}
	return nil
}

// config is the daemon's relay configuration: relay.DefaultConfig with
// what the flags change, reporting what holds delivery into board.
func (c *runCmd) config(ctx context.Context, log *zap.Logger, board *holds.Board) (relay.Config, error) {
	cfg, err := relayConfig(c.PGURL, c.Brokers, log, c.SourceFlags, c.RecordFlags, c.TuningFlags, c.HealthFlags, c.DeliveryFlags)
	if err != nil {
		return relay.Config{}, err
	}
	cfg.Holds = board
	kopts, err := c.KafkaFlags.options(ctx, log, board)
	if err != nil {
		return relay.Config{}, err
	}
	cfg.KafkaOptions = append(cfg.KafkaOptions, kopts...)
	cfg.Router.Principal = c.KafkaFlags.principal()
	cfg.PrimaryURL = c.PrimaryURL
	return cfg, nil
}

// closedByBroker reports a broker that closed the connection instead of
// answering: franz-go's guess for a first read (ErrFirstReadEOF) or a
// plain end of stream wrapped in the error.
func closedByBroker(err error) bool {
	var first *kgo.ErrFirstReadEOF
	return errors.As(err, &first) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// warnPGTLS logs, at WARN, what the PostgreSQL URL's sslmode leaves open
// (nothing when it verifies the server or the connection is a Unix
// socket). Every command that connects says it, not only run: an operator
// trying status or setup first meets it there.
func warnPGTLS(log *zap.Logger, url string) {
	if w := slot.TLSWarning(url); w != "" {
		log.Warn(w)
	}
}
