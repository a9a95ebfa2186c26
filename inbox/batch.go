package inbox

// batch.go: the records of one partition handled in one transaction. The
// transaction inserts the batch's inbox rows in one statement (ON
// CONFLICT DO NOTHING: an id already there is a duplicate, its handler
// skipped), reads their attempt counts, moves the partition's position
// past the batch from where this member left it, runs each new record's
// handler in offset order, and commits; the Kafka offset follows
// (Consumer.commit).
//
// A handler error rolls the whole transaction back: the records before
// the failing one are handled again in a new transaction without it, and
// it goes on alone (process), as every record did before batches: tried
// again after a pause, counted, dead-lettered after Config.MaxAttempts.
// The records after it wait for it, so a key's records stay in order. The
// alternative, a savepoint per record, costs two more round trips per
// record and a subtransaction each, which past 64 in one transaction
// slows every session's snapshots (PostgreSQL's subtransaction cache
// overflows): it cut a batch of 500 to a third of its rate, while a
// failure is rare. Records without an id, and those whose attempts are
// used up, also go alone, between batches.

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
)

// item is a record of a batch, with its span once the batch reached it.
type item struct {
	r    *kgo.Record
	id   string
	ctx  context.Context // carries span
	span trace.Span
	dup  bool // its id was in the inbox already, or earlier in the batch
}

// batchEnd is how a batch ended.
type batchEnd int

const (
	batchAll     batchEnd = iota // every record committed
	batchCut                     // Config.MaxBatchTime ran out: the rest goes to the next batch
	batchOne                     // the record after those committed goes alone (process)
	batchStopped                 // Run's context ended
	batchMoved                   // the database's position is not this member's: rewind
)

type batchResult struct {
	committed int // records committed (or skipped as duplicates), from the first
	end       batchEnd
	pause     bool // batchOne: the record failed once in the batch; pause before its next try
}

// handlePart handles a worker's batch of p's records, in offset order,
// and returns those it did not get to that the partition must handle next
// (a batch cut by Config.MaxBatchTime).
func (c *Consumer) handlePart(cl *kgo.Client, p *part, recs []*kgo.Record) []*kgo.Record {
	ctx := p.ctx
	items := make([]*item, len(recs))
	for i, r := range recs {
		items[i] = &item{r: r, id: header(r, "id")}
	}
	for i := 0; i < len(items); {
		if ctx.Err() != nil {
			return nil
		}
		if items[i].id == "" {
			if c.one(ctx, cl, p, items[i], false) != done {
				return nil
			}
			i++
			continue
		}
		j := i + 1
		for j < len(items) && items[j].id != "" {
			j++
		}
		res := c.batch(ctx, p, items[i:j], true)
		i += res.committed
		switch res.end {
		case batchCut:
			return recs[i:]
		case batchOne:
			if c.one(ctx, cl, p, items[i], res.pause) != done {
				return nil
			}
			i++
		case batchStopped:
			return nil
		case batchMoved:
			c.markMoved(p)
			return nil
		}
	}
	return nil
}

// one handles it alone (process) and records how that left it.
func (c *Consumer) one(ctx context.Context, cl *kgo.Client, p *part, it *item, pause bool) processed {
	c.startItem(ctx, it)
	res := c.process(it.ctx, cl, p, it.r, it.id, pause)
	endSpan(it.span, res)
	it.span = nil
	switch res {
	case done:
		c.markDone(p, it.r)
	case moved:
		c.markMoved(p)
	}
	return res
}

// startItem starts it's span, unless started.
func (c *Consumer) startItem(ctx context.Context, it *item) {
	if it.span == nil {
		it.ctx, it.span = c.startSpan(ctx, it.r, it.id)
	}
}

// endItems ends the spans the batch started of items, as p left them.
func endItems(items []*item, p processed) {
	for _, it := range items {
		if it.span != nil {
			endSpan(it.span, p)
			it.span = nil
		}
	}
}

// batch handles items, records of p that all have an id, in one
// transaction, retrying it whole while the database fails outside the
// handlers. cut: Config.MaxBatchTime applies (not to records handled
// again after a failure, which ran within it once).
func (c *Consumer) batch(ctx context.Context, p *part, items []*item, cut bool) batchResult {
	pause := c.backoff()
	for {
		res, err := c.tryBatch(ctx, p, items, cut)
		if err == nil {
			switch res.end {
			case batchStopped:
				endItems(items[res.committed:], stopped)
			case batchMoved:
				endItems(items[res.committed:], moved)
			}
			return res
		}
		if ctx.Err() != nil {
			endItems(items, stopped)
			return batchResult{end: batchStopped}
		}
		c.m.dbErrors.WithLabelValues(c.cfg.Name).Inc()
		c.log.Warn("inbox transaction failed; retrying the batch without counting an attempt", zap.String("topic", p.topic),
			zap.Int32("partition", p.partition), zap.Int64("offset", items[0].r.Offset), zap.Int("records", len(items)), zap.Error(err))
		if !pause.wait(ctx) {
			endItems(items, stopped)
			return batchResult{end: batchStopped}
		}
	}
}

// attempts is a message's row in the attempts table.
type attempts struct {
	n         int
	lastError string
}

// tryBatch runs one transaction of items. An error is the database's,
// outside the handlers: the transaction is to be tried again whole.
func (c *Consumer) tryBatch(ctx context.Context, p *part, items []*item, cut bool) (batchResult, error) {
	ids := distinctIDs(items)
	tx, err := c.cfg.DB.Begin(ctx)
	if err != nil {
		return batchResult{}, err
	}
	defer tx.Rollback(context.Background())
	from, known := c.position(p)
	b := &pgx.Batch{}
	// The inbox rows first: a concurrent copy of a message waits on the
	// first one's row and then finds it. In one order for every
	// transaction, so that two with the same messages (two members during
	// a rebalance) wait rather than deadlock.
	b.Queue("INSERT INTO "+c.inbox+" (consumer, message_id) SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING RETURNING message_id",
		c.cfg.Name, slices.Sorted(slices.Values(ids)))
	b.Queue("SELECT message_id, attempts, last_error FROM "+c.attempt+" WHERE consumer = $1 AND message_id = ANY($2)", c.cfg.Name, ids)
	c.queueMove(b, p, from, known, items[len(items)-1].r.Offset+1)
	br := tx.SendBatch(ctx, b)
	fresh, prior, err := readBatch(br)
	if err != nil {
		br.Close()
		return batchResult{}, err
	}
	adv, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return batchResult{}, err
	}
	if adv.RowsAffected() == 0 {
		// Copies found meanwhile count as skipped even so: typically the
		// first copy's transaction, of another member during a rebalance,
		// moved the position too.
		for _, it := range items {
			if !fresh[it.id] {
				c.startItem(ctx, it)
				c.m.duplicates.WithLabelValues(c.cfg.Name).Inc()
				markDuplicate(it.ctx)
			}
		}
		return batchResult{end: batchMoved}, nil
	}

	start := time.Now()
	var retired []string // handled after failing before: their attempt counts go
	seen := make(map[string]bool, len(items))
	for k, it := range items {
		it.dup = !fresh[it.id] || seen[it.id]
		seen[it.id] = true
		c.startItem(ctx, it)
		if !it.dup {
			pr := prior[it.id]
			if pr.n >= c.cfg.MaxAttempts {
				// Earlier runs used its attempts up and died before
				// dead-lettering it: alone, after the records before it.
				return c.finish(ctx, tx, p, items, k, batchOne, fresh, retired)
			}
			m := &Message{ID: it.id, Record: it.r, Attempt: pr.n + 1, consumer: c.cfg.Name}
			if herr := c.call(it.ctx, tx, m); herr != nil {
				dead := transient(tx, herr)
				tx.Rollback(context.Background())
				if ctx.Err() != nil {
					return batchResult{end: batchStopped}, nil
				}
				pause := true
				if dead {
					c.dbFailed(it.id, herr)
				} else if n, ok := c.failed(it.ctx, it.id, herr); ok && n >= c.cfg.MaxAttempts {
					pause = false // to the dead-letter topic at once
				}
				return c.without(ctx, p, items, k, pause), nil
			}
			if pr.n > 0 {
				retired = append(retired, it.id)
			}
		}
		switch {
		case ctx.Err() != nil:
			// Stopped as the handler returned: what was handled commits.
			return c.finish(ctx, tx, p, items, k+1, batchStopped, fresh, retired)
		case cut && k+1 < len(items) && items[k+1].span == nil && c.cfg.MaxBatchTime > 0 && time.Since(start) >= c.cfg.MaxBatchTime:
			// (Not before a record already under way, which failed in an
			// earlier batch: its span goes on with it.)
			return c.finish(ctx, tx, p, items, k+1, batchCut, fresh, retired)
		}
	}
	return c.finish(ctx, tx, p, items, len(items), batchAll, fresh, retired)
}

// readBatch reads the new inbox rows' ids and the attempt counts of a
// batch's first two statements.
func readBatch(br pgx.BatchResults) (fresh map[string]bool, prior map[string]attempts, err error) {
	rows, err := br.Query()
	if err != nil {
		return nil, nil, err
	}
	fresh = map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, nil, err
		}
		fresh[id] = true
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	rows, err = br.Query()
	if err != nil {
		return nil, nil, err
	}
	prior = map[string]attempts{}
	for rows.Next() {
		var id string
		var a attempts
		if err := rows.Scan(&id, &a.n, &a.lastError); err != nil {
			rows.Close()
			return nil, nil, err
		}
		prior[id] = a
	}
	return fresh, prior, rows.Err()
}

// without commits, after items[k] failed and its transaction was rolled
// back, the records before it in a new transaction, and sends items[k]
// alone.
func (c *Consumer) without(ctx context.Context, p *part, items []*item, k int, pause bool) batchResult {
	if k > 0 {
		if res := c.batch(ctx, p, items[:k], false); res.end != batchAll {
			return res // stopped, moved, or another record failed this time
		}
	}
	return batchResult{committed: k, end: batchOne, pause: pause}
}

// finish commits the first n of the batch's items, handled; the rest are
// taken out of the transaction (their inbox rows deleted, the position
// moved back to after the last one handled). With none handled it rolls
// back. The commit is not cancelled by a stop: every handler it commits
// returned nil.
func (c *Consumer) finish(ctx context.Context, tx pgx.Tx, p *part, items []*item, n int, end batchEnd, fresh map[string]bool, retired []string) (batchResult, error) {
	if n == 0 {
		return batchResult{end: end}, nil // the caller's deferred Rollback
	}
	last := items[n-1].r
	b := &pgx.Batch{}
	if n < len(items) {
		if undo := unhandled(items, n, fresh); len(undo) > 0 {
			b.Queue("DELETE FROM "+c.inbox+" WHERE consumer = $1 AND message_id = ANY($2)", c.cfg.Name, undo)
		}
		b.Queue("UPDATE "+c.offsets+" SET next_offset = $4, updated_at = now() WHERE consumer_group = $1 AND topic = $2 AND partition = $3",
			c.cfg.Group, p.topic, p.partition, last.Offset+1)
	}
	if len(retired) > 0 {
		b.Queue("DELETE FROM "+c.attempt+" WHERE consumer = $1 AND message_id = ANY($2)", c.cfg.Name, retired)
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if b.Len() > 0 {
		if err := tx.SendBatch(cctx, b).Close(); err != nil {
			return batchResult{}, err
		}
	}
	if err := tx.Commit(cctx); err != nil {
		if errors.Is(err, pgx.ErrTxCommitRollback) {
			err = errors.New("the batch's transaction was rolled back at commit")
		}
		return batchResult{}, err
	}
	c.setPosition(p, last.Offset+1, true)
	var handled, dups int
	for _, it := range items[:n] {
		if it.dup {
			dups++
			markDuplicate(it.ctx)
		} else {
			handled++
		}
		endSpan(it.span, done)
		it.span = nil
	}
	c.m.processed.WithLabelValues(c.cfg.Name).Add(float64(handled))
	c.m.duplicates.WithLabelValues(c.cfg.Name).Add(float64(dups))
	c.m.batchRecords.WithLabelValues(c.cfg.Name).Observe(float64(n))
	c.markDone(p, last)
	return batchResult{committed: n, end: end}, nil
}

// distinctIDs are the ids of items, each once, in their order.
func distinctIDs(items []*item) []string {
	ids := make([]string, 0, len(items))
	seen := make(map[string]bool, len(items))
	for _, it := range items {
		if !seen[it.id] {
			seen[it.id] = true
			ids = append(ids, it.id)
		}
	}
	return ids
}

// unhandled are the ids whose inbox rows the batch inserted (fresh) for
// records after its first n: taken out when it commits only those.
func unhandled(items []*item, n int, fresh map[string]bool) []string {
	kept := make(map[string]bool, n)
	for _, it := range items[:n] {
		kept[it.id] = true
	}
	var undo []string
	for _, it := range items[n:] {
		if fresh[it.id] && !kept[it.id] {
			kept[it.id] = true
			undo = append(undo, it.id)
		}
	}
	return undo
}
