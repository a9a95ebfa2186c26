package integration

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// TestStandbyDecodeInitialSnapshot: a first start on a standby publishes
// the rows already in the outbox from the snapshot the slot exported there
// (PostgreSQL 16+ exports one from a slot created on a standby), consistent
// with the slot: rows committed before the start, and while the slot is
// created and the snapshot read, each reach Kafka, none lost; exactly-once
// reads each once.
func TestStandbyDecodeInitialSnapshot(t *testing.T) {
	needPG(t, 16)
	for _, mode := range []string{"at-least-once", "exactly-once"} {
		t.Run(mode, func(t *testing.T) {
			rs := startReplicaSet(t, replicaSetOptions{})
			e := rs.newEnv()
			e.startWriters(2, 0, 300, 0).wait(t)
			rs.waitReplayed()
			standbyURL := rs.standby.URL(e.name)
			c := e.consume()
			// In seq order, as the writers committed them per key.
			args := e.standbyArgs(standbyURL, e.url, "--snapshot-order", "seq")
			if mode == "exactly-once" {
				c = e.consumeWith(kgo.FetchIsolationLevel(kgo.ReadCommitted()))
				args = append(args, "--delivery", "exactly-once", "--checkpoint-topic", e.checkpointTopic())
			}
			// Rows go on being written while the slot is created on the
			// standby and the snapshot is read: each is in one or the other.
			during := e.startWriters(2, 300, 300, 5*time.Millisecond)
			p := startProc(t, nil, args...)
			e.waitStandbySlotActive(p, standbyURL)
			during.wait(t)

			// The slot shows active while it is being created: the
			// snapshot's line is what says it was published.
			published := regexp.MustCompile(`"msg":"initial snapshot published","rows":(\d+)`)
			var m []string
			e.waitFor("the initial snapshot published", 2*time.Minute, func() (bool, error) {
				m = published.FindStringSubmatch(p.out.String())
				return m != nil, nil
			})
			if n, _ := strconv.Atoi(m[1]); n < 600 {
				t.Errorf("the snapshot published %d rows, want at least the 600 committed before the start", n)
			}
			want, total := committedRows(t, e, e.conn())
			var recs []*kgo.Record
			for _, r := range waitAllIDs(c, want, 2*time.Minute) {
				if r.Topic != e.checkpointTopic() {
					recs = append(recs, r)
				}
			}
			dups := checkDelivered(t, recs, want, nil)
			if mode == "exactly-once" && dups > 0 {
				t.Errorf("%d duplicates under exactly-once with a read_committed consumer", dups)
			}
			if strings.Contains(p.out.String(), `"level":"error"`) {
				t.Errorf("errors logged:\n%s", lastLines(p.out.String(), 10))
			}
			t.Logf("%s: %d rows, %s in the snapshot, %d duplicates", mode, total, m[1], dups)
		})
	}
}
