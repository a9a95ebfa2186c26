package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/walrelay/walrelay/internal/bench"
)

// benchCmd is `walrelay bench`: throughput against pg_recvlogical,
// latency, memory on a huge transaction, idle CPU. See BENCHMARKS.md.
type benchCmd struct {
	Scenario     []string      `default:"drain,latency,big,idle" help:"Scenarios to run: drain, latency, big, idle (peer: see --peer)."`
	Peer         string        `default:"none" enum:"none,debezium" help:"debezium: run only the peer scenario: walrelay --preset debezium, Debezium with its defaults and Debezium tuned, one after the other on one Apache Kafka node (needs Java and Maven; see make deps-debezium): drain rate per --txn-size, latency per --peer-rate, peak RSS, CPU per event, and a kill -9 under load."`
	PeerRate     []int         `default:"1000,5000" help:"peer: commits per second of the latency runs; one run per value."`
	PeerRun      []string      `default:"walrelay,debezium,debezium-tuned" help:"peer: which to run: walrelay, debezium (its defaults), debezium-tuned."`
	Events       int           `default:"200000" help:"drain: backlog size in events."`
	TxnSize      []int         `default:"1,100" help:"drain: rows per transaction; one run per value."`
	PayloadBytes int           `default:"200" help:"Approximate payload size of each event."`
	Broker       []string      `default:"discard,store" help:"drain: brokers, discard and store (in-process kfake that drops or keeps records) and apache (one Apache Kafka node: needs Java and Maven, see make deps-kafka; latency then runs on it too)."`
	Delivery     []string      `default:"at-least-once" help:"drain and latency: delivery modes to measure, at-least-once and/or exactly-once."`
	Rate         []int         `default:"2000,10000" help:"latency: commits per second; one run per value."`
	Duration     time.Duration `default:"20s" help:"latency: how long each rate runs (after a 2s warm-up)."`
	BigRows      []int         `default:"100000,1000000" help:"big: rows of the one transaction; one run per value."`
	Idle         time.Duration `default:"30s" help:"idle: how long to measure the idle relay's CPU."`
	Repeat       int           `default:"1" help:"Runs of each measurement."`
	RelayArg     []string      `help:"Extra flag for the relay under test (repeatable), e.g. --relay-arg=--binary."`
	PGURL        string        `name:"pg-url" help:"Use this PostgreSQL (a superuser URL) instead of a throwaway cluster."`
	Brokers      []string      `help:"Use these Kafka brokers instead of an in-process kfake."`
	JSON         bool          `name:"json" help:"Print JSON instead of a table."`
}

func (c *benchCmd) Run(ctx context.Context) error {
	if c.Peer == "debezium" {
		c.Scenario = []string{"peer"}
	}
	results, err := bench.Run(ctx, bench.Config{
		Scenarios: c.Scenario, Events: c.Events, TxnSizes: c.TxnSize, PayloadBytes: c.PayloadBytes,
		Brokers: c.Broker, Deliveries: c.Delivery, Rates: c.Rate, PeerRates: c.PeerRate, Peers: c.PeerRun, Duration: c.Duration, BigRows: c.BigRows, IdleFor: c.Idle,
		Repeat: c.Repeat, RelayArgs: c.RelayArg, PGURL: c.PGURL, KafkaBrokers: c.Brokers, Log: os.Stderr,
	})
	if c.JSON {
		if jerr := bench.PrintJSON(os.Stdout, results); jerr != nil {
			return jerr
		}
	} else {
		fmt.Printf("walrelay bench (%s)\n", strings.Join(c.Scenario, ", "))
		bench.PrintTable(os.Stdout, results)
	}
	return err
}
