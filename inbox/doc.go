// Package inbox consumes Kafka records with one effect per message id: for
// each record it runs the caller's Handler, records (consumer, message id)
// in an inbox table and moves the group's position in an offsets table, in
// one PostgreSQL transaction, and commits the Kafka offset only after that
// transaction committed. A transaction holds a batch of one partition's
// records, and the partitions of a member are handled in parallel (see
// Batches).
//
// walrelay, like any at-least-once producer, may deliver a record more
// than once (after a relay crash, a broker outage, two relays); each copy
// carries the same id header. A consumer may also see a record again while
// a rebalance hands its partition to another member of the group, or after
// a rewind (see Positions). In every case the second
// transaction's INSERT into the inbox conflicts with the first one's row
// (a primary key, INSERT ... ON CONFLICT DO NOTHING, never a
// check-then-insert: a concurrent copy waits for the first transaction and
// then finds the row), so the handler's database effects happen once.
//
// # Positions and database failovers
//
// The group's position in each partition (the next offset to handle) is a
// row of the offsets table, moved in the same transaction as the inbox row
// and the handler's effects, and each partition starts from it when
// assigned; the Kafka offset commit follows (at most every
// Config.CommitInterval) for the tools that read it. A
// database that fails over to a standby short of its newest transactions
// (asynchronous replication) loses effects, inbox rows and position
// together, while Kafka's committed offsets are past them: started from
// Kafka's, those records would never be handled again. Each transaction
// moves the position only from where this member left it (an UPDATE ...
// WHERE next_offset = the known one); finding it elsewhere, the consumer
// rolls back and re-reads the partition from the database's position (from
// the partition's start when the row itself was lost), counting
// inbox_rewinds_total. The same check catches another member that handled
// the partition meanwhile. The loss is found at the partition's next
// batch, when it is next assigned, or at the next periodic comparison of
// the database's positions with this member's
// (Config.PositionCheckInterval), whichever comes first.
//
// # Batches
//
// The records of one partition are handled in batches, a transaction
// each: the batch's inbox rows are inserted in one statement (the ids
// already there are duplicates, their handlers skipped), the position
// moved once past the batch, each handler run in offset order, and the
// transaction committed. A batch takes the records read for its
// partition when it starts and never waits for more: one record when the
// consumer keeps up, up to Config.MaxBatchRecords (and MaxBatchBytes)
// when it catches up. Config.MaxBatchTime bounds how long its handlers
// run: the batch then commits what they handled and the rest go to the
// next one. Config.Workers partitions are handled at once, each by one
// worker at a time; Config.MaxPollRecords bounds the records read ahead
// of them. The metric inbox_batch_records shows the batches' sizes.
//
// # Order and failures
//
// A partition's records are handled in offset order, one batch after the
// other, so the records of one key (one aggregate) are applied in the
// order they were produced; different partitions, and so different keys,
// are applied in parallel. A Handler error rolls its batch back: the
// records before it commit again in a new transaction without it (their
// handlers run again; their first effects were rolled back), and the
// record is tried again on its own (after a growing pause), in place, the
// records after it waiting; the attempt count is kept in a table so it
// survives restarts. After Config.MaxAttempts failures the record goes to
// the dead-letter topic with headers saying why (inbox.reason,
// inbox.error, inbox.attempts and where it came from), its id is recorded
// as dead-lettered, and the partition moves on. Database and broker
// errors are not the record's fault: they are retried without counting,
// for as long as they last; so are handler errors that are the
// database's (a lost connection, a serialization failure or deadlock).
//
// # Shutdown and rebalances
//
// The client blocks rebalances between a poll and the moment its records
// are queued for the workers (kgo.BlockRebalanceOnPoll), and the offset
// commits and rewinds happen in that window, so none runs beside a
// rebalance. A revoked partition's batch in flight is finished and
// committed before the revoke completes, with the offsets of everything
// handled; what was read ahead for it is dropped, and the next owner
// reads it from the database's position. A lost partition's batch in
// flight is cancelled. When Run's context ends, each batch in flight
// commits the records whose handlers returned before the stop, unless a
// handler was still running: its interrupted statement leaves the
// transaction unusable, and the batch is rolled back whole and handled
// again by whoever gets the partition. The offsets of what committed are
// committed, and the consumer leaves the group. A member that stalls past
// the group's rebalance timeout loses its partitions while still handling
// one; the new owner's copy then waits on the inbox row and is skipped if
// the first transaction commits.
//
// # Retention
//
// Inbox rows are what makes a late copy a duplicate, so they must outlive
// every way a copy can still arrive: keep them longer than the topic's
// retention (a group reset to the earliest offset replays everything still
// in the log) plus the longest the relay may be down or behind (after a
// relay crash it re-sends from its slot's confirmed position, however
// late). Config.Retention (default 14 days, for Kafka's default 7-day
// retention and a week of outage) is that window; Prune deletes older
// rows, and Run calls it every Config.PruneInterval.
//
// # Tracing
//
// Each handled message gets an OpenTelemetry consumer span, the child of
// the W3C trace context the record carries (walrelay's producer span,
// whose parent is the writer's), carried in the handler's ctx so that the
// effect's database calls join the trace. Duplicates, failed attempts, a
// dead letter and a rewind are marked on it. Config.TracerProvider and
// Config.Propagator default to the program's globals: without an SDK,
// nothing is recorded.
//
// # What an inbox cannot make atomic
//
// Only effects inside the handler's transaction happen exactly once. A
// call to another system (an HTTP request, an e-mail, a payment) cannot
// join a PostgreSQL transaction: if the process dies after the call and
// before the commit, or the commit fails, the record is handled again and
// the call is made again. Two honest ways out: make the other system
// deduplicate, by sending Message.IdempotencyKey (stable across every
// copy and every retry of the message) as its idempotency key; or do not
// call it from the handler at all, and write an outbox event in the
// handler's transaction instead, for a worker of its own to perform with
// the same idempotency key. A system that offers neither can only be
// called at least once (or at most once, by recording the attempt first).
package inbox
