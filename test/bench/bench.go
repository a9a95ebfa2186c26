// Package bench measures walrelay against PostgreSQL's own speed: it
// decodes a backlog inside PostgreSQL (pg_logical_slot_peek_binary_changes,
// the decoding limit), drains it with pg_recvlogical (PostgreSQL's client)
// and with the relay, side by side in one run, and measures commit-to-
// consumer latency, memory on a huge transaction, idle CPU, and what
// decoding on a hot standby saves the primary (standby.go).
//
// The relay runs as a separate process (a walrelay binary, `run`; see
// Config.Binary) so that its CPU time and peak RSS are its own. PostgreSQL and the broker
// are a throwaway cluster and an in-process kfake unless flags name real
// ones.
package bench

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/slot"
)

// Config says what to run.
type Config struct {
	Scenarios    []string // drain, latency, big, idle, tracing, txnfloor, peer, standby, inbox
	Events       int      // drain backlog size
	TxnSizes     []int    // rows per transaction, one drain run each
	PayloadBytes int
	Brokers      []string // "discard", "store" (in-process kfake modes), "apache" (Apache Kafka; latency too)
	Deliveries   []string // "at-least-once", "exactly-once"
	ValueFormats []string // drain: "asis", "json", "avro", "protobuf" (--value-format); empty: asis
	Rates        []int    // latency: commits per second
	PeerRates    []int    // peer: commits per second of its latency runs
	Peers        []string // peer: walrelay, debezium, debezium-tuned; empty: all
	PeerMeasures []string // peer: drain, latency, kill; empty: all
	// FloorVariants: txnfloor, how its producer commits (floorVariant):
	// "1", "2", with "s" and/or "c" appended; empty: all of the defaults.
	FloorVariants []string
	// LatencyFloor: latency, txnfloor variants run in each round beside
	// the relay's runs, on the same broker; empty: none.
	LatencyFloor []string
	Duration     time.Duration
	BigRows      []int
	IdleFor      time.Duration
	// TracingModes: tracing, the modes each round drains in, in order:
	// "off", or a sampling ratio ("1.0", "0.01"); empty: off, 1.0, 0.01.
	TracingModes []string
	// TracingProtocol: tracing, the OTLP protocol to the bench's receiver:
	// "http/protobuf" (walrelay's default) or "grpc"; empty: http/protobuf.
	TracingProtocol string
	// TracingEnv: tracing, more OpenTelemetry variables (NAME=value) for
	// the traced relays, e.g. the export queue's OTEL_BSP_MAX_QUEUE_SIZE.
	TracingEnv []string
	Repeat     int
	RelayArgs  []string // extra flags for walrelay run
	// ColdCheckpoints leaves the checkpoint topic to the relay (a first
	// start on a new cluster); by default the broker's setup creates and
	// uses it first, as on a cluster in service (see warmTransactions).
	ColdCheckpoints bool
	Binary          string // the walrelay binary under test (required: cmd/walrelay-bench finds it)
	// CompareBinary: drain, latency and tracing, a second walrelay binary run in
	// each round after Binary's runs, on the same broker (rows marked
	// relay=compare), so that two builds are compared in the same
	// minutes; empty: none.
	CompareBinary string
	// CompareArgs: drain, latency and tracing, extra walrelay flags for a second
	// run in each round (rows marked relay=compare), of CompareBinary when
	// set, else of Binary: two settings compared in the same minutes;
	// empty: none.
	CompareArgs []string
	// InboxPartitions: inbox, the partitions of each drain's topic, one
	// measurement each; InboxEvents, its backlog; InboxRates, the
	// latency runs' records per second; InboxCompareRef, a git ref whose
	// inbox package is measured beside the working tree's (empty: none);
	// InboxSet, inbox.Config fields (Name=value) of the consumer under
	// test.
	InboxPartitions []int
	InboxEvents     int
	InboxRates      []int
	InboxCompareRef string
	InboxSet        []string
	PGURL           string   // external PostgreSQL (superuser); empty: throwaway cluster
	KafkaBrokers    []string // external Kafka; empty: in-process kfake
	Log             io.Writer
}

// relayRun is one relay a round measures: the build under test, or the
// one compared with it (--compare-binary, --compare-arg), whose rows'
// parameters end in label.
type relayRun struct {
	bin, label string
	args       []string
}

// relayRuns lists the relays each round runs, the build under test first.
func (b *bencher) relayRuns() []relayRun {
	relays := []relayRun{{bin: b.cfg.Binary}}
	if b.cfg.CompareBinary != "" || len(b.cfg.CompareArgs) > 0 {
		bin := cmp.Or(b.cfg.CompareBinary, b.cfg.Binary)
		relays = append(relays, relayRun{bin: bin, label: " relay=compare", args: b.cfg.CompareArgs})
	}
	return relays
}

// Result is one measured row.
type Result struct {
	Scenario string             `json:"scenario"`
	Params   string             `json:"params"`
	Metrics  map[string]float64 `json:"metrics"`
	Notes    string             `json:"notes,omitempty"`
}

// Run runs the scenarios and returns their results.
func Run(ctx context.Context, cfg Config) ([]Result, error) {
	if cfg.Binary == "" {
		return nil, fmt.Errorf("bench: Config.Binary is empty: name the walrelay binary to measure")
	}
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	if cfg.Repeat <= 0 {
		cfg.Repeat = 1
	}
	if len(cfg.Deliveries) == 0 {
		cfg.Deliveries = []string{"at-least-once"}
	}
	if len(cfg.ValueFormats) == 0 {
		cfg.ValueFormats = []string{"asis"}
	}
	if _, err := exec.LookPath("pg_recvlogical"); err != nil && has(cfg.Scenarios, "drain") {
		return nil, fmt.Errorf("the drain scenario needs pg_recvlogical (PostgreSQL client tools): %w", err)
	}
	b := &bencher{cfg: cfg}
	if err := b.startPostgres(ctx); err != nil {
		return nil, err
	}
	defer b.close()
	if has(cfg.Scenarios, "standby") {
		// Refused before the other scenarios run, not after.
		if err := b.checkStandbyVersion(ctx); err != nil {
			return nil, fmt.Errorf("standby: %w", err)
		}
	}
	var results []Result
	for _, sc := range cfg.Scenarios {
		var rs []Result
		var err error
		switch sc {
		case "drain":
			rs, err = b.drainAll(ctx)
		case "latency":
			rs, err = b.latencyAll(ctx)
		case "big":
			rs, err = b.bigAll(ctx)
		case "idle":
			rs, err = b.idle(ctx)
		case "peer":
			rs, err = b.peerAll(ctx)
		case "tracing":
			rs, err = b.tracingAll(ctx)
		case "txnfloor":
			rs, err = b.txnFloorAll(ctx)
		case "standby":
			rs, err = b.standbyAll(ctx)
		case "inbox":
			rs, err = b.inboxAll(ctx)
		default:
			err = fmt.Errorf("unknown scenario %q: want drain, latency, big, idle, tracing, txnfloor, peer, standby or inbox", sc)
		}
		if err != nil {
			return results, fmt.Errorf("%s: %w", sc, err)
		}
		results = append(results, rs...)
	}
	return results, nil
}

func has(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// bencher holds the infrastructure shared by the scenarios.
type bencher struct {
	cfg   Config
	pg    *devcluster.Postgres
	admin string // superuser URL of the cluster
	seq   int
	// relayEnv is added to the environment of the relay started next
	// (the tracing scenario's OpenTelemetry variables).
	relayEnv []string
}

func (b *bencher) logf(format string, args ...any) {
	fmt.Fprintf(b.cfg.Log, "bench: "+format+"\n", args...)
}

func (b *bencher) startPostgres(ctx context.Context) error {
	if b.cfg.PGURL != "" {
		b.admin = b.cfg.PGURL
		return nil
	}
	// WALRELAY_TEST_PG picks the server as for the tests: a version of the
	// matrix (make deps-pg-versions), or by default the one on PATH or the
	// newest installed.
	bin, err := devcluster.TestBinDir()
	if err != nil {
		return err
	}
	settings := map[string]string{
		"shared_buffers":     "'512MB'",
		"max_wal_size":       "'8GB'",
		"checkpoint_timeout": "'30min'",
		"synchronous_commit": "off", // only speeds up writing the backlog
		"wal_writer_delay":   "'10ms'",
		"autovacuum":         "off",
	}
	if has(b.cfg.Scenarios, "inbox") {
		settings["track_commit_timestamp"] = "on" // when each effect committed (inbox.go)
	}
	pg, err := devcluster.StartPostgres(ctx, devcluster.PostgresOptions{BinDir: bin, Settings: settings})
	if err != nil {
		return err
	}
	b.pg = pg
	b.admin = pg.URL("postgres")
	b.logf("PostgreSQL at %s", b.admin)
	return nil
}

func (b *bencher) close() {
	if b.pg != nil {
		b.pg.Close()
	}
}

// database creates a fresh database with an outbox table and a publication
// for one measurement, and returns its URL.
func (b *bencher) database(ctx context.Context) (string, error) {
	b.seq++
	name := fmt.Sprintf("bench_%d_%d", os.Getpid(), b.seq)
	url, err := devcluster.CreateDatabase(ctx, b.admin, name)
	if err != nil {
		return "", err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS outbox (
			id bigserial PRIMARY KEY,
			aggregate_type text NOT NULL,
			aggregate_id text NOT NULL,
			type text NOT NULL,
			payload jsonb
		);
		DROP PUBLICATION IF EXISTS bench;
		CREATE PUBLICATION bench FOR TABLE outbox WITH (publish = 'insert');`)
	return url, err
}

// createSlot creates a pgoutput slot.
func createSlot(ctx context.Context, conn *pgx.Conn, name string) error {
	_, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", name)
	return err
}

func currentLSN(ctx context.Context, conn *pgx.Conn) (decoder.LSN, error) {
	var l decoder.LSN
	err := conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&l)
	return l, err
}

// writeBacklog commits events rows in transactions of txnSize rows with
// payloads of about payloadBytes, in one server-side loop.
func writeBacklog(ctx context.Context, conn *pgx.Conn, events, txnSize, payloadBytes int) error {
	pad := max(payloadBytes-20, 0)
	_, err := conn.Exec(ctx, fmt.Sprintf(`
		DO $$
		DECLARE i int := 0;
		BEGIN
			WHILE i < %d LOOP
				INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
				SELECT 'bench', 'key-' || ((i + g) %% 1000), 'BenchEvent',
				       jsonb_build_object('n', i + g, 'pad', repeat('x', %d))
				FROM generate_series(0, least(%d, %d - i) - 1) g;
				COMMIT;
				i := i + %d;
			END LOOP;
		END $$`, events, pad, txnSize, events, txnSize))
	return err
}

// relay is a walrelay run subprocess.
type relay struct {
	cmd *exec.Cmd
	out *strings.Builder
}

func (b *bencher) startRelay(url, slotName string, brokers []string, delivery string, extra ...string) (*relay, error) {
	if delivery == "" {
		delivery = "at-least-once"
	}
	args := append([]string{"run", "--delivery", delivery, "--pg-url", url, "--brokers", strings.Join(brokers, ","),
		"--slot", slotName, "--publication", "bench", "--no-create-slot", "--no-create-publication",
		"--topic-partitions", "3", "--metrics-addr", "", "--log-level", "warn"}, b.cfg.RelayArgs...)
	args = append(args, extra...)
	cmd := exec.Command(b.cfg.Binary, args...)
	if b.relayEnv != nil {
		cmd.Env = append(os.Environ(), b.relayEnv...)
	}
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &relay{cmd: cmd, out: out}, nil
}

func (r *relay) stop() {
	_ = r.cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { _ = r.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = r.cmd.Process.Kill()
		<-done
	}
}

// waitConfirmed polls the slot until its confirmed_flush_lsn reaches end.
func waitConfirmed(ctx context.Context, conn *pgx.Conn, slotName string, end decoder.LSN, timeout time.Duration, alive func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		info, err := slot.ReadInfo(ctx, conn, slotName)
		if err != nil {
			return err
		}
		if info.ConfirmedLSN >= end {
			return nil
		}
		if err := alive(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("slot %s confirmed %s, not %s, after %s", slotName, info.ConfirmedLSN, end, timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// walsenderPID finds the walsender serving slotName.
func walsenderPID(ctx context.Context, conn *pgx.Conn, slotName string, timeout time.Duration) (int, error) {
	deadline := time.Now().Add(timeout)
	for {
		var pid *int32
		err := conn.QueryRow(ctx, "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1", slotName).Scan(&pid)
		if err != nil {
			return 0, err
		}
		if pid != nil {
			return int(*pid), nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("no walsender for slot %s after %s", slotName, timeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// PrintTable writes results as an aligned table.
func PrintTable(w io.Writer, rs []Result) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "scenario\tparameters\tresult\t")
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t\n", r.Scenario, r.Params, formatMetrics(r))
	}
	tw.Flush()
}

// PrintJSON writes results as JSON.
func PrintJSON(w io.Writer, rs []Result) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rs)
}

func formatMetrics(r Result) string {
	var parts []string
	for _, k := range metricOrder {
		if v, ok := r.Metrics[k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%s", k, formatValue(k, v)))
		}
	}
	if r.Notes != "" {
		parts = append(parts, r.Notes)
	}
	return strings.Join(parts, " ")
}

var metricOrder = []string{
	"decode_events_per_s", "recv_events_per_s", "relay_events_per_s", "relay_decode_ratio", "ratio", "recv_mb_per_s", "relay_mb_per_s",
	"decode_backend_us_per_event", "recv_walsender_us_per_event", "relay_walsender_us_per_event", "relay_cpu_us_per_event", "relay_cpu_total_us_per_event", "broker_cpu_us_per_event",
	"alo_events_per_s", "eos_events_per_s", "eos_ratio",
	"value_events_per_s", "asis_events_per_s", "value_rate_ratio", "value_cpu_us_per_event", "asis_cpu_us_per_event", "value_cpu_us_added",
	"primary_cpu_us_per_event", "primary_walsender_us_per_event", "primary_rest_us_per_event", "standby_cpu_us_per_event", "standby_walsender_us_per_event",
	"primary_cpu_ratio", "primary_cpu_us_saved", "both_cpu_ratio", "added_p50_ms", "added_p99_ms",
	"kafka_txns", "p50_ms", "p99_ms", "max_ms", "achieved_rate", "events", "kafka_txns_per_s", "broker_cpu_percent",
	"commit_ms_per_txn", "marker_wait_ms_per_txn", "commits_over_16ms", "marker_waits_over_16ms", "relay_cpu_percent", "flush_ms_per_txn", "endtxn_ms_per_txn", "settle_ms_per_txn",
	"first_record_s", "drain_s", "peak_rss_mb", "cpu_percent",
	"first_new_record_s", "delivered_twice",
	"spans_per_event", "tracing_cpu_us_per_event", "rate_ratio",
	"effects_per_s", "compare_effects_per_s", "speedup", "floor_effects_per_s", "floor_ratio", "floor_savepoint_effects_per_s", "cpu_us_per_effect", "compare_cpu_us_per_effect",
	"load1",
}

func formatValue(k string, v float64) string {
	switch {
	case k == "ratio" || k == "relay_decode_ratio" || k == "eos_ratio" || k == "rate_ratio" || k == "spans_per_event" || k == "value_rate_ratio" || k == "primary_cpu_ratio" || k == "both_cpu_ratio" ||
		k == "speedup" || k == "floor_ratio":
		return fmt.Sprintf("%.2f", v)
	case v >= 1000:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}
