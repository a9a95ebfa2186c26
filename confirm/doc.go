// Package confirm owns the one WAL position walrelay confirms to
// PostgreSQL: the position sent in every standby status update, and the
// one walrelay's record and its metrics report as confirmed. Confirming a
// position lets PostgreSQL recycle the WAL before it and never send the
// transactions that end at or before it again, so the rule this package
// exists for is:
//
//	The slot is never confirmed past an outbox event Kafka has not
//	acknowledged, nor past a change to what the slot streams from that
//	the publication watch has not cleared.
//
// Anything short of that position is safe (the next stream resends from
// it: duplicates, never loss); anything past it may lose events for good.
//
// # Inputs, and what each promises
//
// The reader of a replication stream (one goroutine, the session) feeds a
// Confirmer:
//
//   - Begin and Commit bracket a PostgreSQL transaction, in commit order
//     (pgoutput sends only committed transactions). Commit carries the
//     transaction's end LSN, never its commit record's start. Each outbox
//     event is counted with Txn.Add before it is handed to Kafka and
//     acknowledged with Txn.Ack once Kafka has it, on any goroutine. With
//     exactly-once delivery the ack comes only when the Kafka transaction
//     holding the event committed (router.Txn.Commit), so the exactly-once
//     checkpoint gates the position through the same count.
//   - Marker queues a position the server reported with nothing for the
//     relay before it: a keepalive's WAL end (idle advance, which keeps a
//     quiet outbox from pinning WAL in a busy database) or a logical
//     decoding message (walrelay's heartbeat). A marker is confirmable
//     once everything received before it is; it never jumps a gap.
//   - Start: the position the stream started from is confirmed already.
//
// The publication watch (a goroutine of its own) feeds the process's
// Clearance with Vouch: a check found the publication and the outbox
// tables' membership intact up to that position. Past a change to them
// PostgreSQL skips outbox inserts without a word, so nothing is confirmed
// past the last position vouched for; the Confirmer asks the watch (Want)
// to look further when it has more to confirm.
//
// # Output
//
// Confirmer.Due says what to send and whether an update is due now (at
// once when the server asks for a reply, every status interval, and a
// minimum gap after the position moved: Schedule); Confirmer.Sent records
// what went out. Progress keeps, for the process, the newest position sent
// (Confirmed: the record, the metrics, refusals name it) and the newest
// one Kafka's acknowledgements and the clearance allowed (Resume: where a
// session after a broken connection starts, confirming at once what the
// slot never heard of).
package confirm
