package confirm_test

import (
	"fmt"
	"time"

	"github.com/walrelay/walrelay/confirm"
)

// The position confirmed to PostgreSQL moves past a transaction only once
// Kafka acknowledged all of its events, and past the transactions before
// it: acks arrive in any order, confirmation in commit order.
func ExampleWatermark() {
	tr := confirm.NewWatermark(0x1000)

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
