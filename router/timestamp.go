package router

// timestamp.go: a record's timestamp when its topic will not take the
// commit time. A record carries its transaction's commit time, the same
// on every replay; but a topic may refuse timestamps far from the
// broker's clock (message.timestamp.before.max.ms and after.max.ms, a
// common guard against skewed producer clocks), and a backlog read after
// an outage is "old". Refused, such a record would fail the stream on
// every restart. So a record whose commit time the topic's bounds would
// refuse carries the time it is produced instead, with the commit time in
// a header; and a topic that refuses a timestamp anyway (bounds the relay
// may not read, a clock off) gets the produce time on every record from
// then on, after one restart from the last confirmed position.

import (
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/router/internal/topics"
)

// HeaderCommitTime is the header of a record whose timestamp is the time
// it was produced rather than the commit time: its value is the commit
// time (for a snapshot record, the snapshot's time) in milliseconds since
// the Unix epoch, as Kafka counts record timestamps.
const HeaderCommitTime = "walrelay.commit_time"

// commitTimeHeaderBytes bounds what HeaderCommitTime adds to a record's
// encoded size (name, at most 20 digits, their lengths).
const commitTimeHeaderBytes = len(HeaderCommitTime) + 20 + 8

// stampMargin is how far inside a topic's timestamp bound a commit time
// must lie to be kept: the record reaches the broker a little later, and
// the broker's clock may run ahead of the relay's.
func stampMargin(bound time.Duration) time.Duration { return min(bound/10, time.Minute) }

// needsProduceTime reports whether a record of t timestamped ts must carry
// the produce time instead.
func needsProduceTime(t *topic, ts time.Time) bool {
	if t.produceTime.Load() {
		return true
	}
	if t.tsBefore == 0 && t.tsAfter == 0 {
		return false
	}
	now := time.Now()
	return t.tsBefore > 0 && ts.Before(now.Add(-t.tsBefore+stampMargin(t.tsBefore))) ||
		t.tsAfter > 0 && ts.After(now.Add(t.tsAfter-stampMargin(t.tsAfter)))
}

// stamp gives o the produce time when its topic would refuse its
// timestamp, keeping that timestamp in HeaderCommitTime, and updates its
// size. It runs before o is counted in flight.
func stamp(o *outRecord) {
	if !needsProduceTime(o.topic, o.rec.Timestamp) {
		return
	}
	for _, h := range o.rec.Headers {
		if h.Key == HeaderCommitTime {
			return // stamped already (a dead letter of a stamped record)
		}
	}
	o.rec.Headers = append(o.rec.Headers, kgo.RecordHeader{Key: HeaderCommitTime, Value: strconv.AppendInt(nil, o.rec.Timestamp.UnixMilli(), 10)})
	o.rec.Timestamp = time.Now()
	o.size = topics.RecordSize(o.rec.Key, o.rec.Value, o.rec.Headers)
}

// refusedTimestamp handles a record Kafka refused for its timestamp
// (INVALID_TIMESTAMP), on the promise goroutine: the topic's records
// carry the produce time from now on, under later producers too, and the
// stream restarts once from the last confirmed position to send them so.
// A record that had the produce time already is refused because the
// relay's and the broker's clocks disagree: that needs the clocks fixed.
func (r *Router) refusedTimestamp(o *outRecord, err error) {
	t := o.topic
	stamped := t.produceTime.Load()
	for _, h := range o.rec.Headers {
		stamped = stamped || h.Key == HeaderCommitTime
	}
	if stamped {
		r.fail(fmt.Errorf("produce to %s: %w: Kafka refused even the produce time as the record's timestamp: the relay's clock and the broker's differ by more than the topic's message.timestamp.before.max.ms / after.max.ms allow; synchronise them (NTP)", t.name, err))
		return
	}
	r.topics.UseProduceTime(t.name)
	t.produceTime.Store(true)
	r.log.Warn("Kafka refused a record's timestamp (its commit time) for the topic's message.timestamp.* bounds: from now on its records carry the produce time, with the commit time in header "+HeaderCommitTime+"; restarting from the last confirmed position to send them so",
		zap.String("topic", t.name), zap.Time("record_timestamp", o.rec.Timestamp), zap.Error(err))
	r.fail(fmt.Errorf("produce to %s: %w (the topic's records carry the produce time from now on)", t.name, err))
}
