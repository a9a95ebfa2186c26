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
	"maps"
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
func (c *Consumer) queueAdvance(b *pgx.Batch, r *kgo.Record) {
	next := r.Offset + 1
	if at, ok := c.position(r.Topic, r.Partition); ok {
		b.Queue("UPDATE "+c.offsets+" SET next_offset = $4, updated_at = now() WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND next_offset = $5",
			c.cfg.Group, r.Topic, r.Partition, next, at)
		return
	}
	b.Queue("INSERT INTO "+c.offsets+" (consumer_group, topic, partition, next_offset) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
		c.cfg.Group, r.Topic, r.Partition, next)
}

// setPosition records the partition's position as this member knows it
// (known false: no row in the database).
func (c *Consumer) setPosition(topic string, partition int32, next int64, known bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !known {
		delete(c.pos[topic], partition)
		return
	}
	ps := c.pos[topic]
	if ps == nil {
		ps = map[int32]int64{}
		c.pos[topic] = ps
	}
	ps[partition] = next
}

// followPosition has the next offset commit move Kafka's committed offset
// of the partition to next.
func (c *Consumer) followPosition(topic string, partition int32, next int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.follow[topic] == nil {
		c.follow[topic] = map[int32]int64{}
	}
	c.follow[topic][partition] = next
}

func (c *Consumer) position(topic string, partition int32) (int64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n, ok := c.pos[topic][partition]
	return n, ok
}

func (c *Consumer) forgetPositions(ps map[string][]int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for t, parts := range ps {
		for _, p := range parts {
			delete(c.pos[t], p)
		}
	}
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
	for t, ps := range offsets {
		for p, committed := range ps {
			n, ok := kept[t][p]
			if ok {
				ps[p] = kgo.NewOffset().At(n).WithEpoch(-1)
				if committed.EpochOffset().Offset != n {
					c.followPosition(t, p, n)
				}
			}
			c.setPosition(t, p, n, ok)
		}
	}
	return offsets, nil
}

// rewind moves the consumer to the database's position of the partition
// after a transaction or the check found it elsewhere than this member
// left it: behind (the database lost committed transactions, as a failover
// to a standby short of them does), or ahead (another member handled the
// partition meanwhile). With no row at all, the partition is read again
// from its start: the inbox skips what survived. It runs on the polling
// goroutine, before AllowRebalance, as SetOffsets needs. always seeks
// even when the position is found where this member left it (a
// transaction's caller has dropped the poll's later records); otherwise
// it reports whether it moved the consumer.
func (c *Consumer) rewind(ctx context.Context, cl *kgo.Client, topic string, partition int32, always bool) bool {
	was, wasKnown := c.position(topic, partition)
	kept, err := c.readPositions(ctx, []string{topic})
	if err != nil {
		return false // stopping: the next owner starts from the database's position
	}
	next, ok := kept[topic][partition]
	if !always && ok && wasKnown && next == was {
		return false // the check read the database before a commit, this member after it
	}
	if !ok {
		starts, err := kadm.NewClient(cl).ListStartOffsets(ctx, topic)
		if err == nil {
			err = starts.Error()
		}
		o, found := starts.Lookup(topic, partition)
		if err == nil && !found {
			err = errors.New("the broker did not list the partition")
		}
		if err != nil {
			if ctx.Err() == nil {
				c.log.Warn("rewind: could not list the partition's start offset; the partition is read again when it is next assigned", zap.String("topic", topic), zap.Int32("partition", partition), zap.Error(err))
				cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{topic: {partition: {Epoch: -1, Offset: 0}}})
			}
			c.setPosition(topic, partition, 0, false)
			return true
		}
		next = o.Offset
	}
	c.m.rewinds.WithLabelValues(c.cfg.Name).Inc()
	fields := []zap.Field{zap.String("topic", topic), zap.Int32("partition", partition), zap.Int64("database_next_offset", next), zap.Bool("database_has_position", ok)}
	if wasKnown {
		fields = append(fields, zap.Int64("this_member_next_offset", was))
	}
	c.log.Warn("the partition's position in the database is not where this consumer left it (a database failover that lost committed transactions, or another member handled it): reading the partition again from the database's position", fields...)
	c.mu.Lock()
	delete(c.done[topic], partition) // its offset is not the database's
	c.mu.Unlock()
	c.followPosition(topic, partition, next)
	c.setPosition(topic, partition, next, ok)
	cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{topic: {partition: {Epoch: -1, Offset: next}}})
	return true
}

// pollContext is the context of the next poll, which the position check
// ends to wake the polling goroutine.
func (c *Consumer) pollContext(ctx context.Context) context.Context {
	poll, cancel := context.WithCancel(ctx)
	c.mu.Lock()
	if c.wake != nil {
		c.wake() // the previous poll's, done with
	}
	c.wake = cancel
	if len(c.suspects) > 0 {
		cancel() // found while the last poll's records were handled
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
		known := make(map[string]map[int32]int64, len(c.pos))
		topics := make([]string, 0, len(c.pos))
		for tp, ps := range c.pos {
			if len(ps) > 0 {
				known[tp] = maps.Clone(ps)
				topics = append(topics, tp)
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
		var moved []topicPartition
		for tp, ps := range known {
			for p, n := range ps {
				if m, ok := kept[tp][p]; !ok || m != n {
					moved = append(moved, topicPartition{tp, p})
				}
			}
		}
		if len(moved) > 0 {
			c.mu.Lock()
			c.suspects = append(c.suspects, moved...)
			if c.wake != nil {
				c.wake()
			}
			c.mu.Unlock()
		}
	}
}

// rewindSuspects rewinds the partitions the check found moved that this
// member still knows a position of, and returns those it moved.
func (c *Consumer) rewindSuspects(ctx context.Context, cl *kgo.Client) map[topicPartition]bool {
	c.mu.Lock()
	suspects := c.suspects
	c.suspects = nil
	c.mu.Unlock()
	var rewound map[topicPartition]bool
	for _, tp := range suspects {
		if _, known := c.position(tp.topic, tp.partition); !known || rewound[tp] {
			continue // revoked meanwhile, or found twice
		}
		if c.rewind(ctx, cl, tp.topic, tp.partition, false) {
			if rewound == nil {
				rewound = map[topicPartition]bool{}
			}
			rewound[tp] = true
		}
	}
	return rewound
}
