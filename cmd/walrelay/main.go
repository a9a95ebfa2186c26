// Command walrelay relays committed outbox INSERTs from PostgreSQL logical
// replication to Kafka, in commit order, confirming the slot only after
// Kafka acknowledges.
//
//	walrelay run --pg-url postgres://… --brokers kafka:9092   the daemon
//	walrelay dev [--demo N]                                    embedded PostgreSQL + broker
//
// The benchmark is a command of its own, cmd/walrelay-bench, so that this
// binary carries only what the daemon and its operator commands run.
//
// Every flag has a WALRELAY_* environment variable (--pg-url is
// WALRELAY_PG_URL); a flag given on the command line wins.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/alecthomas/kong"
)

// version is set by the build (-ldflags "-X main.version=…").
var version = "dev"

// cli is the command line. Each command is a struct with a Run method.
type cli struct {
	LogFlags `embed:""`

	Run      runCmd      `cmd:"" help:"Relay outbox inserts from PostgreSQL to Kafka (the daemon)."`
	Dev      devCmd      `cmd:"" help:"Run the relay against a throwaway PostgreSQL cluster and an in-process Kafka-protocol broker."`
	Status   statusCmd   `cmd:"" help:"Show the slot's state and lag; exit 1 when unhealthy (lag over --max-lag-bytes, invalidated, or not streamed with --require-active), 2 when it cannot be read."`
	Setup    setupCmd    `cmd:"" help:"Print the outbox DDL, check the database and create the publication and slot."`
	Drop     dropCmd     `cmd:"" help:"Drop the slot (and with --drop-publication the publication); PostgreSQL stops keeping WAL for it. Refuses, unless --force, while it holds unpublished outbox rows."`
	Snapshot snapshotCmd `cmd:"" help:"Publish the current rows of outbox tables once (at-least-once: a row may also arrive through the stream), with the record and Kafka flags of run."`

	Version kong.VersionFlag `env:"-" help:"Print the version and exit."`
}

// Exit codes. docs/reference/exit-codes.md is generated from these
// comments: they speak to an operator or a supervisor deciding what to do.
//
// 0: done; run stopped by SIGINT or SIGTERM after confirming what Kafka
// acknowledged. An error of no kind below exits 1 as well.
const (
	// exitUnhealthy: the slot needs attention: status found it unhealthy (confirmed lag over
	// --max-lag-bytes, invalidated, wal_status = unreserved, or not
	// streamed with --require-active); dev --demo: events missing after
	// --timeout.
	exitUnhealthy = 1
	// exitFailed: the database or the broker refused or failed: a setup
	// refusal (one line naming the fix), wrong PostgreSQL or SASL
	// credentials, an untrusted certificate, a --brokers endpoint that is
	// not Kafka, an invalidated or vanished slot or something else that
	// changed under the relay (the way on is walrelay setup --accept-gap),
	// status unable to read the slot, drop refusing to discard pending
	// rows, snapshot refused (its query) or failed. Restarting does not
	// help until the cause is fixed.
	exitFailed = 2
	// exitFenced: exactly-once: another producer took the transactional id
	// while this relay still held its slot: a relay of another slot, or a
	// tool, uses the same --transactional-id. Give each relay its own;
	// restarting would fence the other in turn. (A relay fenced after
	// losing its slot to another relay of the same slot does not exit: it
	// becomes the standby.)
	exitFenced = 3
	// exitStartupTimeout: run gave up at --startup-timeout without having
	// streamed: PostgreSQL or Kafka stayed unreachable, or creating the
	// slot kept waiting for transactions to end (its last line names them,
	// with the fix; nothing of the slot is left behind). A restart tries
	// again from the start and helps once they are reachable or have
	// ended; on a host that may boot before them, a longer
	// --startup-timeout saves the restarts.
	exitStartupTimeout = 4
	// exitUsage: a malformed flag, WALRELAY_* variable or configuration,
	// found before anything is connected: an unknown flag or a bad value,
	// an empty or unparsable --pg-url, a slot name outside [a-z0-9_], a bad
	// --table, --header-column or --topic-template, --txn-max-interval over
	// half --txn-timeout, unreadable --kafka-tls-* files (kong's code for
	// usage errors).
	exitUsage = 80
)

// usageError marks err as a malformed flag or configuration.
func usageError(err error) error { return &exitError{code: exitUsage, err: err} }

// exitError carries a process exit code through kong.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func main() {
	var c cli
	parser := kong.Must(&c, parserOptions()...)
	kctx, err := parser.Parse(os.Args[1:])
	if err != nil {
		// kong exits 1 for some of these (a bad value in a WALRELAY_*
		// variable): every malformed flag or variable exits 80.
		parser.Errorf("%s", err)
		os.Exit(exitUsage)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	kctx.BindTo(ctx, (*context.Context)(nil))
	err = kctx.Run(&c.LogFlags)
	stop() // not deferred: os.Exit skips deferred calls
	if err != nil {
		// One line: pgconn lists each connection attempt on its own line.
		// The libraries name configuration fields; the command line
		// speaks flags.
		fmt.Fprintln(os.Stderr, "walrelay:", strings.Join(strings.Fields(speakFlags(err.Error())), " "))
		var ee *exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		os.Exit(1)
	}
}
