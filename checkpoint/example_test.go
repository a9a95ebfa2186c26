package checkpoint_test

import (
	"fmt"
	"time"

	"github.com/walrelay/walrelay/checkpoint"
)

// The position confirmed to PostgreSQL moves past a transaction only once
// Kafka acknowledged all of its events, and past the transactions before
// it: acks arrive in any order, confirmation in commit order.
func ExampleTracker() {
	tr := checkpoint.New(0x1000)

	first := tr.Begin(time.Now())
	first.Add() // one event handed to the producer
	tr.Commit(first, 0x1100)

	second := tr.Begin(time.Now())
	second.Add()
	tr.Commit(second, 0x1200)

	second.Ack() // Kafka acknowledged the later transaction first
	fmt.Println(tr.Advance().LSN)
	first.Ack()
	fmt.Println(tr.Advance().LSN)

	// A keepalive's WAL end is confirmable once nothing is in flight.
	tr.Marker(0x1300)
	fmt.Println(tr.Advance().LSN)
	// Output:
	// 0/1000
	// 0/1200
	// 0/1300
}

// With exactly-once delivery a checkpoint record travels in each Kafka
// transaction; after a restart, Skip says which resent events it covers.
func ExampleSkip() {
	d := checkpoint.Durable{
		Slot: "walrelay", SystemID: "7713984148484868534", LSN: 0x2000,
		// The transaction committing at 0x3000 was split: 2 events are in.
		Partial: &checkpoint.Partial{CommitLSN: 0x3000, Events: 2},
	}
	d, err := checkpoint.UnmarshalDurable(d.Marshal())
	if err != nil {
		panic(err)
	}
	skip := checkpoint.NewSkip(d, true)

	skip.Begin(0x1f00) // committed before the checkpoint: all in Kafka
	fmt.Println(skip.Event(), skip.Event())
	skip.Begin(0x3000) // the split one: the first two are in Kafka
	fmt.Println(skip.Event(), skip.Event(), skip.Event())
	skip.Begin(0x4000) // after the checkpoint: nothing skipped
	fmt.Println(skip.Event())
	// Output:
	// true true
	// true true false
	// false
}
