// Command walrelay-bench measures walrelay: drain throughput against
// pg_recvlogical, commit-to-consumer latency, memory on a huge transaction,
// idle CPU, what decoding on a hot standby saves the primary (--scenario
// standby), the inbox consumer against an earlier build and its floor
// (--scenario inbox), and (--peer debezium) Debezium side by side. See
// BENCHMARKS.md.
//
//	make build-bench && bin/walrelay-bench
//
// It is a command of its own so that the daemon does not link the
// benchmark, its Apache Kafka and Debezium harnesses or their JVM
// launchers. The relay under test is a walrelay binary run as a
// subprocess (`walrelay run`), so its CPU time and peak RSS are its own:
// by default the one next to this executable, else the first on PATH.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/alecthomas/kong"

	"github.com/walrelay/walrelay/test/bench"
)

// Exit codes, walrelay's where they mean the same.
const (
	// exitFailed: a measurement failed.
	exitFailed = 1
	// exitSetup: the relay binary cannot be found.
	exitSetup = 2
	// exitUsage: a malformed flag (kong's code for usage errors).
	exitUsage = 80
)

// benchCmd is the command line: which scenarios, at which sizes, against
// which relay, PostgreSQL and broker.
type benchCmd struct {
	Scenario        []string      `default:"drain,latency,big,idle" help:"Scenarios to run: drain, latency, big, idle, tracing (the drain with OpenTelemetry tracing off, on with every trace sampled and with 1%, per --txn-size on the first --broker; txnfloor: the broker alone, a minimal transactional producer at each --rate to a read_committed consumer, the floor of exactly-once latency, per --floor; standby: decoding on a hot standby, PostgreSQL 16+ (WALRELAY_TEST_PG picks the server): a standby of the throwaway cluster, the relay reading the primary then the standby (--primary-url), alternately, under one-row commits per --rate for --duration: the primary's and the standby's CPU per event (their process trees, walsenders apart) and commit-to-consumer latency; inbox: the inbox package's consumer, a process with a handler doing one UPDATE, draining --inbox-events on each of --inbox-partitions, in effects/s, beside the same consumer built from --inbox-compare-ref and beside the floor (its batches' database work with no Kafka, and with a savepoint per record), and the time from a record's produce call to its effect's commit at each --inbox-rate; it builds the consumer with the Go toolchain, so run it from the repository; peer: see --peer)."`
	Peer            string        `default:"none" enum:"none,debezium" help:"debezium: run only the peer scenario: walrelay --preset debezium, Debezium with its defaults and Debezium tuned, one after the other on one Apache Kafka node (needs Java and Maven; see make deps-debezium): drain rate per --txn-size, latency per --peer-rate, peak RSS, CPU per event, and a kill -9 under load."`
	PeerRate        []int         `default:"1000,5000" help:"peer: commits per second of the latency runs; one run per value."`
	PeerRun         []string      `default:"walrelay,debezium,debezium-tuned" help:"peer: which to run: walrelay, debezium (its defaults), debezium-tuned."`
	PeerMeasure     []string      `default:"drain,latency,kill" enum:"drain,latency,kill" help:"peer: what to measure: drain (per --txn-size), latency (per --peer-rate), kill."`
	Events          int           `default:"200000" help:"drain: backlog size in events."`
	TxnSize         []int         `default:"1,100" help:"drain: rows per transaction; one run per value."`
	PayloadBytes    int           `default:"200" help:"Approximate payload size of each event."`
	Broker          []string      `default:"discard,store" help:"drain: brokers, discard and store (in-process kfake that drops or keeps records) and apache (one Apache Kafka node: needs Java and Maven, see make deps-kafka; latency and standby then run on it too)."`
	Delivery        []string      `default:"at-least-once" help:"drain, latency and standby: delivery modes to measure, at-least-once and/or exactly-once."`
	ValueFormat     []string      `default:"asis" enum:"asis,json,avro,protobuf" help:"drain: value formats to measure (walrelay --value-format, against an in-process schema registry holding the events' schema), one run each, and each against asis: relay CPU per event and drain rate."`
	Floor           []string      `default:"1,1s,2,2s,1sc,2sc" help:"txnfloor: how the minimal producer commits, one run each: 1 or 2 transactional producers (two take turns: one fills its transaction while the other commits), s: each waits for its commit's markers before its next record (the relay's settle), c: each transaction also writes one record to a second topic (the relay's checkpoint), p: PostgreSQL works beside it as in the latency scenario (writers at the same --rate, pg_recvlogical streaming their slot)."`
	LatencyFloor    []string      `help:"latency: txnfloor variants (as --floor) to run in each round beside the relay's runs, on the same warmed broker, so that the relay's exactly-once latency can be read as a ratio to the broker's own floor measured in the same minutes; none by default."`
	Rate            []int         `default:"2000,10000" help:"latency and standby: commits per second; one run per value."`
	Duration        time.Duration `default:"20s" help:"latency and standby: how long each rate runs (after a 2s warm-up)."`
	BigRows         []int         `default:"100000,1000000" help:"big: rows of the one transaction; one run per value."`
	Idle            time.Duration `default:"30s" help:"idle: how long to measure the idle relay's CPU."`
	Tracing         []string      `default:"off,1.0,0.01" help:"tracing: the modes each round drains in, in this order: off, or the ratio of traces sampled (e.g. 1.0, 0.01); each ratio's row against off when off is among them."`
	TracingProtocol string        `default:"http/protobuf" enum:"http/protobuf,grpc" help:"tracing: the OTLP protocol the traced relays export to the bench's receiver with (OTEL_EXPORTER_OTLP_PROTOCOL): http/protobuf, walrelay's default, or grpc."`
	TracingEnv      []string      `placeholder:"NAME=VALUE" help:"tracing: an OpenTelemetry variable for the traced relays (repeatable), e.g. --tracing-env OTEL_BSP_MAX_QUEUE_SIZE=65536; by default the export queue is at walrelay's defaults."`
	Repeat          int           `default:"1" help:"Runs of each measurement."`
	RelayBinary     string        `help:"The walrelay binary under test (default: walrelay next to this executable, else the first on PATH)."`
	RelayArg        []string      `help:"Extra flag for the relay under test (repeatable), e.g. --relay-arg=--binary."`
	CompareBinary   string        `help:"drain, latency and tracing: a second walrelay binary, run in each round after the one under test on the same broker (rows marked relay=compare), to compare two builds in the same minutes."`
	CompareArg      []string      `help:"drain, latency and tracing: an extra flag for a second relay run in each round (repeatable; rows marked relay=compare), of --compare-binary when given, else of the binary under test: two settings in the same minutes, e.g. --compare-arg=--txn-producers=2."`
	ColdCkpt        bool          `name:"cold-checkpoints" help:"Leave the checkpoint topic to the relay, as on its first start on a new cluster (default: the broker's setup creates and uses it first, as on a cluster in service)."`
	InboxPartitions []int         `default:"1,8,32" help:"inbox: partitions of the drained topic; one measurement per value."`
	InboxEvents     int           `default:"50000" help:"inbox: records of each drain's backlog."`
	InboxRate       []int         `default:"2000" help:"inbox: records per second of the latency runs (each for --duration); one run per value."`
	InboxCompareRef string        `help:"inbox: a git ref (e.g. main) whose inbox package is measured beside the working tree's, in the same rounds (rows and metrics marked compare)."`
	InboxSet        []string      `help:"inbox: an inbox.Config field of the consumer under test, Name=value (repeatable), e.g. --inbox-set Workers=8."`
	PGURL           string        `name:"pg-url" help:"Use this PostgreSQL (a superuser URL) instead of a throwaway cluster."`
	Brokers         []string      `help:"Use these Kafka brokers instead of an in-process kfake."`
	JSON            bool          `name:"json" help:"Print JSON instead of a table."`
}

func main() {
	var c benchCmd
	parser := kong.Must(&c, parserOptions()...)
	if _, err := parser.Parse(os.Args[1:]); err != nil {
		parser.Errorf("%s", err)
		os.Exit(exitUsage)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := c.run(ctx)
	stop() // not deferred: os.Exit skips deferred calls
	os.Exit(code)
}

// parserOptions are the options of the command line's parser, the
// binary's and docs/reference/walrelay-bench.md's (TestReference).
func parserOptions() []kong.Option {
	return []kong.Option{
		kong.Name("walrelay-bench"),
		kong.Description("Measure walrelay against PostgreSQL's decoding limit and pg_recvlogical (throughput), and its latency, memory and idle CPU, on throwaway PostgreSQL and kfake (see BENCHMARKS.md)."),
		// The variables walrelay bench read when it was a walrelay
		// command (WALRELAY_PG_URL, WALRELAY_BROKERS, …).
		kong.DefaultEnvars("WALRELAY"),
	}
}

func (c *benchCmd) run(ctx context.Context) int {
	bin, err := relayBinary(c.RelayBinary)
	if err != nil {
		fmt.Fprintln(os.Stderr, "walrelay-bench:", err)
		return exitSetup
	}
	if err := bench.CheckFloorVariants(append(slices.Clone(c.Floor), c.LatencyFloor...)); err != nil {
		fmt.Fprintln(os.Stderr, "walrelay-bench:", err)
		return exitSetup
	}
	if c.Peer == "debezium" {
		c.Scenario = []string{"peer"}
	}
	results, err := bench.Run(ctx, bench.Config{
		Scenarios: c.Scenario, Events: c.Events, TxnSizes: c.TxnSize, PayloadBytes: c.PayloadBytes,
		Brokers: c.Broker, Deliveries: c.Delivery, ValueFormats: c.ValueFormat, Rates: c.Rate, PeerRates: c.PeerRate, Peers: c.PeerRun, PeerMeasures: c.PeerMeasure, FloorVariants: c.Floor, LatencyFloor: c.LatencyFloor, Duration: c.Duration, BigRows: c.BigRows, IdleFor: c.Idle, TracingModes: c.Tracing, TracingProtocol: c.TracingProtocol, TracingEnv: c.TracingEnv,
		InboxPartitions: c.InboxPartitions, InboxEvents: c.InboxEvents, InboxRates: c.InboxRate, InboxCompareRef: c.InboxCompareRef, InboxSet: c.InboxSet,
		Repeat: c.Repeat, RelayArgs: c.RelayArg, CompareBinary: c.CompareBinary, CompareArgs: c.CompareArg, ColdCheckpoints: c.ColdCkpt, Binary: bin, PGURL: c.PGURL, KafkaBrokers: c.Brokers, Log: os.Stderr,
	})
	if c.JSON {
		if jerr := bench.PrintJSON(os.Stdout, results); jerr != nil && err == nil {
			err = jerr
		}
	} else {
		fmt.Printf("walrelay-bench (%s)\n", strings.Join(c.Scenario, ", "))
		bench.PrintTable(os.Stdout, results)
	}
	if err != nil {
		// One line: pgconn lists each connection attempt on its own line.
		fmt.Fprintln(os.Stderr, "walrelay-bench:", strings.Join(strings.Fields(err.Error()), " "))
		return exitFailed
	}
	return 0
}

// relayBinary returns the walrelay binary to measure: flag when given,
// else walrelay in this executable's directory (make build-bench puts both
// in bin/), else walrelay on PATH.
func relayBinary(flag string) (string, error) {
	if flag != "" {
		if _, err := os.Stat(flag); err != nil {
			return "", fmt.Errorf("--relay-binary: %w", err)
		}
		return flag, nil
	}
	var next string
	if exe, err := os.Executable(); err == nil {
		next = filepath.Join(filepath.Dir(exe), "walrelay")
		if st, err := os.Stat(next); err == nil && !st.IsDir() {
			return next, nil
		}
	}
	if p, err := exec.LookPath("walrelay"); err == nil {
		return p, nil
	} else if !errors.Is(err, exec.ErrNotFound) {
		return "", err
	}
	return "", fmt.Errorf("no walrelay binary at %s nor on PATH: build it (make build-bench builds both into bin/) or pass --relay-binary", next)
}
