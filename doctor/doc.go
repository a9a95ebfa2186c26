// Package doctor owns what walrelay says about a slot's health, read from
// PostgreSQL's views so that it works from anywhere the database answers:
// what holds the slot's WAL and catalog rows, most to blame first, with the
// fix (explain.go: Facts, Explain), why PostgreSQL invalidated a slot and
// the refusal for one invalidated or gone (invalidation.go), what creating
// a slot waits for (creation.go), what a failover would do to the slot
// (failover.go), the time the slot has left before invalidation, and the
// health verdict that `walrelay status` prints (status.go: ReadStatus).
// The relay names its connections after what it does (RelayAppName), so
// that the doctor can tell a stopped relay from one waiting for Kafka.
//
// Like every library package it names configuration fields
// (source.SetupConfig.AcceptGap), never a command's flags.
package doctor
