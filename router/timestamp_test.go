package router

import (
	"strconv"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/router/internal/topics"
)

// stamp keeps a commit time the topic's bounds accept, and replaces one
// they would refuse (or any, once the topic refused a timestamp) by the
// produce time, keeping it in the header and counting the header's size.
func TestStamp(t *testing.T) {
	now := time.Now()
	for _, c := range []struct {
		name            string
		before, after   time.Duration
		refused         bool
		ts              time.Time
		wantProduceTime bool
	}{
		{"no bounds", 0, 0, false, now.Add(-24 * time.Hour), false},
		{"inside the before bound", time.Hour, 0, false, now.Add(-30 * time.Minute), false},
		{"past the before bound", time.Hour, 0, false, now.Add(-2 * time.Hour), true},
		{"within the margin of the before bound", time.Hour, 0, false, now.Add(-time.Hour + 30*time.Second), true},
		{"ahead past the after bound", 0, time.Minute, false, now.Add(2 * time.Minute), true},
		{"refused before", 0, 0, true, now, true},
	} {
		tp := &topic{name: "t", tsBefore: c.before, tsAfter: c.after}
		tp.produceTime.Store(c.refused)
		o := &outRecord{topic: tp}
		o.rec = kgo.Record{Topic: "t", Key: []byte("k"), Value: []byte("v"), Timestamp: c.ts}
		o.size = topics.RecordSize(o.rec.Key, o.rec.Value, nil)
		before := o.size
		stamp(o)
		var header string
		for _, h := range o.rec.Headers {
			if h.Key == HeaderCommitTime {
				header = string(h.Value)
			}
		}
		switch {
		case !c.wantProduceTime && (header != "" || !o.rec.Timestamp.Equal(c.ts) || o.size != before):
			t.Errorf("%s: timestamp %s, header %q, size %d: want the commit time kept", c.name, o.rec.Timestamp, header, o.size)
		case c.wantProduceTime && (header != strconv.FormatInt(c.ts.UnixMilli(), 10) || o.rec.Timestamp.Before(now) || o.size <= before || o.size > before+commitTimeHeaderBytes):
			t.Errorf("%s: timestamp %s, header %q, size %d (was %d): want the produce time and the commit time in the header", c.name, o.rec.Timestamp, header, o.size, before)
		}
	}
}
