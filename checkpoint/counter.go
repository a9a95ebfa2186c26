package checkpoint

import "sync/atomic"

// Counter is an acker for records that belong to no PostgreSQL transaction:
// the rows of a snapshot. It only counts, so that the snapshot can tell
// when Kafka has acknowledged everything it sent. Add belongs to the
// sending goroutine; Ack and Pending are safe for concurrent use.
type Counter struct {
	added atomic.Int64
	acked atomic.Int64
}

// Add records one more record handed to the producer.
func (c *Counter) Add() { c.added.Add(1) }

// Ack records one record acknowledged by Kafka.
func (c *Counter) Ack() { c.acked.Add(1) }

// Pending is how many records were added and not yet acknowledged.
func (c *Counter) Pending() int64 { return c.added.Load() - c.acked.Load() }

// Added is how many records were added.
func (c *Counter) Added() int64 { return c.added.Load() }
