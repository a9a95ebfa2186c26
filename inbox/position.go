package inbox

// The group's position in each partition is kept in the database (the
// offsets table), moved in the same transaction as the handler's effects,
// and is what the consumer starts from; Kafka's committed offsets follow
// it for the tools that read them. A database that fails over to a standby
// short of its newest transactions loses effects, inbox rows and position
// together: each transaction moves the position only from where this
// member left it, so the next one finds the position behind and the
// consumer re-reads the partition from there.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
)

// checkTables refuses to run without the offsets table (an inbox table
// made by an older DDL), retrying while the database cannot be asked.
func (c *Consumer) checkTables(ctx context.Context) error {
	pause := c.backoff()
	for {
		var found bool
		err := c.cfg.DB.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", c.offsets).Scan(&found)
		switch {
		case err == nil && found:
			return nil
		case err == nil:
			return fmt.Errorf("inbox: table %s is missing: run inbox.DDL(%q) again (it adds the offsets table and keeps the others)", c.offsets, c.cfg.Table)
		case ctx.Err() != nil:
			return ctx.Err()
		}
		c.m.dbErrors.WithLabelValues(c.cfg.Name).Inc()
		c.log.Warn("checking the inbox tables failed; retrying", zap.Error(err))
		if !pause.wait(ctx) {
			return ctx.Err()
		}
	}
}

// queueAdvance queues the move of r's partition's position past r: from
// the position this member knows, or, with none known, the row's
// creation. It affects no row when the database's position is elsewhere.
func (c *Consumer) queueAdvance(b *pgx.Batch, p *part, r *kgo.Record) {
	from, known := c.position(p)
	c.queueMove(b, p, from, known, r.Offset+1)
}

// queueMove queues the move of p's position from from (known: with none
// known, the row's creation) to next.
func (c *Consumer) queueMove(b *pgx.Batch, p *part, from int64, known bool, next int64) {
	if known {
		b.Queue("UPDATE "+c.offsets+" SET next_offset = $4, updated_at = now() WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND next_offset = $5",
			c.cfg.Group, p.topic, p.partition, next, from)
		return
	}
	b.Queue("INSERT INTO "+c.offsets+" (consumer_group, topic, partition, next_offset) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
		c.cfg.Group, p.topic, p.partition, next)
}

// setPosition records p's position as this member knows it (known false:
// no row in the database).
func (c *Consumer) setPosition(p *part, next int64, known bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p.pos, p.known = next, known
}

func (c *Consumer) position(p *part) (int64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return p.pos, p.known
}

// readPositions reads the database's positions of the topics' partitions,
// retrying while the database fails, until ctx ends.
func (c *Consumer) readPositions(ctx context.Context, topics []string) (map[string]map[int32]int64, error) {
	pause := c.backoff()
	for {
		kept, err := c.queryPositions(ctx, topics)
		if err == nil {
			return kept, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		c.m.dbErrors.WithLabelValues(c.cfg.Name).Inc()
		c.log.Warn("reading the consumed positions from the database failed; retrying", zap.Error(err))
		if !pause.wait(ctx) {
			return nil, ctx.Err()
		}
	}
}

func (c *Consumer) queryPositions(ctx context.Context, topics []string) (map[string]map[int32]int64, error) {
	rows, err := c.cfg.DB.Query(ctx, "SELECT topic, partition, next_offset FROM "+c.offsets+" WHERE consumer_group = $1 AND topic = ANY($2)", c.cfg.Group, topics)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	kept := map[string]map[int32]int64{}
	for rows.Next() {
		var t string
		var p int32
		var n int64
		if err := rows.Scan(&t, &p, &n); err != nil {
			return nil, err
		}
		if kept[t] == nil {
			kept[t] = map[int32]int64{}
		}
		kept[t][p] = n
	}
	return kept, rows.Err()
}

// adjust starts each assigned partition from the database's position
// where it has one (Kafka's committed offset may be ahead of it, after a
// failover of the database, or behind it, after a crash before the offset
// commit); a partition without one starts from Kafka's.
func (c *Consumer) adjust(ctx context.Context, offsets map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
	topics := make([]string, 0, len(offsets))
	for t := range offsets {
		topics = append(topics, t)
	}
	kept, err := c.readPositions(ctx, topics)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for t, ps := range offsets {
		for p, committed := range ps {
			n, ok := kept[t][p]
			pt := c.newPart(t, p, n, ok)
			if ok {
				ps[p] = kgo.NewOffset().At(n).WithEpoch(-1)
				if committed.EpochOffset().Offset != n {
					pt.follow, pt.following = n, true
					c.commitSoonLocked()
				}
			}
		}
	}
	return offsets, nil
}

// rewind moves the consumer to the database's position of p after a
// transaction or the check found it elsewhere than this member left it:
// behind (the database lost committed transactions, as a failover to a
// standby short of them does), or ahead (another member handled the
// partition meanwhile). With no row at all, the partition is read again
// from its start: the inbox skips what survived. It runs on the polling
// goroutine, before AllowRebalance, as SetOffsets needs, with no batch of
// p in flight. always seeks even when the position is found where this
// member left it (a transaction's worker has dropped the records read
// ahead); otherwise it reports whether it moved the consumer. Seeking
// drops what was read ahead for p: it was read from the position left
// behind.
func (c *Consumer) rewind(ctx context.Context, cl *kgo.Client, p *part, always bool) bool {
	was, wasKnown := c.position(p)
	kept, err := c.readPositions(ctx, []string{p.topic})
	if err != nil {
		return false // stopping: the next owner starts from the database's position
	}
	next, ok := kept[p.topic][p.partition]
	if !always && ok && wasKnown && next == was {
		return false // the check read the database before a commit, this member after it
	}
	seek := func(next int64, known bool) {
		c.mu.Lock()
		p.done = nil // its offset is not the database's
		p.pos, p.known = next, known
		c.dropLocked(p)
		c.mu.Unlock()
		cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{p.topic: {p.partition: {Epoch: -1, Offset: next}}})
	}
	if !ok {
		starts, err := kadm.NewClient(cl).ListStartOffsets(ctx, p.topic)
		if err == nil {
			err = starts.Error()
		}
		o, found := starts.Lookup(p.topic, p.partition)
		if err == nil && !found {
			err = errors.New("the broker did not list the partition")
		}
		if err != nil {
			if ctx.Err() == nil {
				c.log.Warn("rewind: could not list the partition's start offset; the partition is read again when it is next assigned", zap.String("topic", p.topic), zap.Int32("partition", p.partition), zap.Error(err))
				seek(0, false)
			}
			return true
		}
		next = o.Offset
	}
	c.m.rewinds.WithLabelValues(c.cfg.Name).Inc()
	fields := []zap.Field{zap.String("topic", p.topic), zap.Int32("partition", p.partition), zap.Int64("database_next_offset", next), zap.Bool("database_has_position", ok)}
	if wasKnown {
		fields = append(fields, zap.Int64("this_member_next_offset", was))
	}
	c.log.Warn("the partition's position in the database is not where this consumer left it (a database failover that lost committed transactions, or another member handled it): reading the partition again from the database's position", fields...)
	c.mu.Lock()
	p.follow, p.following = next, true
	c.commitSoonLocked()
	c.mu.Unlock()
	seek(next, ok)
	return true
}

// pollContext is the context of the next poll, which a worker or the
// position check ends to wake the polling goroutine; it has ended already
// when such work is pending.
func (c *Consumer) pollContext(ctx context.Context) context.Context {
	poll, cancel := context.WithCancel(ctx)
	c.mu.Lock()
	if c.wake != nil {
		c.wake() // the previous poll's, done with
	}
	c.wake = cancel
	if c.pendingLocked() {
		cancel()
	}
	c.mu.Unlock()
	return poll
}

// checkLoop compares, every Config.PositionCheckInterval, the database's
// position of each partition this member knows one of with its own, and
// hands the partitions found elsewhere to the polling goroutine.
func (c *Consumer) checkLoop(ctx context.Context) {
	t := time.NewTicker(c.cfg.PositionCheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		c.mu.Lock()
		known := map[topicPartition]int64{}
		var topics []string
		for tp, p := range c.parts {
			if p.known && !p.gone {
				known[tp] = p.pos
				if !slices.Contains(topics, tp.topic) {
					topics = append(topics, tp.topic)
				}
			}
		}
		c.mu.Unlock()
		if len(topics) == 0 {
			continue
		}
		kept, err := c.queryPositions(ctx, topics)
		if err != nil {
			continue // the handler's transactions meet the same database and retry
		}
		c.mu.Lock()
		var moved []topicPartition
		for tp, n := range known {
			// A partition this member moved meanwhile was read before or
			// after its commit: its next transaction checks it anyway.
			// The check is for those no record comes to.
			if m, ok := kept[tp.topic][tp.partition]; (!ok || m != n) && c.parts[tp] != nil && c.parts[tp].pos == n {
				moved = append(moved, tp)
			}
		}
		if len(moved) > 0 {
			c.suspects = append(c.suspects, moved...)
			c.kickLocked()
		}
		c.mu.Unlock()
	}
}

// rewinds, on the polling goroutine before AllowRebalance, rewinds the
// partitions whose transaction found their position moved, and checks
// those the position check suspects (holding their batches meanwhile);
// it returns the partitions it moved, whose records in the poll at hand
// were read from the position left behind.
func (c *Consumer) rewinds(ctx context.Context, cl *kgo.Client) map[topicPartition]bool {
	c.mu.Lock()
	var moved, checks []*part
	for _, p := range c.parts {
		if p.moved && !p.running {
			moved = append(moved, p)
		}
	}
	for _, tp := range c.suspects {
		if p := c.parts[tp]; p != nil && p.known && !p.moved && !p.hold {
			p.hold = true // revoked meanwhile, or found twice, otherwise
			checks = append(checks, p)
		}
	}
	c.suspects = nil
	for _, p := range checks {
		c.idleLocked(p) // its batch in flight moves its position
	}
	c.mu.Unlock()
	var rewound map[topicPartition]bool
	note := func(p *part) {
		if rewound == nil {
			rewound = map[topicPartition]bool{}
		}
		rewound[topicPartition{p.topic, p.partition}] = true
	}
	for _, p := range moved {
		c.rewind(ctx, cl, p, true)
		note(p)
		c.mu.Lock()
		p.moved = false
		c.schedule(p)
		c.mu.Unlock()
	}
	for _, p := range checks {
		if c.rewind(ctx, cl, p, false) {
			note(p)
		}
		c.mu.Lock()
		p.hold = false
		c.schedule(p)
		c.mu.Unlock()
	}
	return rewound
}
