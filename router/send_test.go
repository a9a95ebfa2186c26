package router

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/test/testkit"
)

// patience bounds every wait on the in-process broker. It is a deadlock
// guard, not a timing assertion: on a loaded machine things are slow, not
// wrong.
const patience = 60 * time.Second

// env is a Router producing to an in-process kfake cluster.
type env struct {
	t      *testing.T
	c      *kfake.Cluster
	r      *Router
	m      *metrics.Metrics
	seeds  []string
	fatals atomic.Int64

	mu        sync.Mutex
	fatalErr  error
	published []*kgo.Record // copies of what OnPublished saw

	relayOpts  []kgo.Opt // the router's client options besides the seeds (SASL)
	helperOpts []kgo.Opt // the test's own clients' (SASL as a super user)
}

// newEnv starts a one-broker kfake cluster with three partitions per topic
// and a started Router with CreateTopics on.
func newEnv(t *testing.T, cfg Config, opts ...kfake.Opt) *env {
	t.Helper()
	return newEnvAs(t, cfg, nil, nil, opts...)
}

// newEnvAs is newEnv with client options for the router (relay) and for
// the test's own clients (helper): a cluster with ACLs needs SASL users.
func newEnvAs(t *testing.T, cfg Config, relay, helper []kgo.Opt, opts ...kfake.Opt) *env {
	t.Helper()
	cfg = withDefaults(cfg)
	c := testkit.Kfake(t, append([]kfake.Opt{kfake.DefaultNumPartitions(3)}, opts...)...)
	e := &env{t: t, c: c, m: metrics.NewUnregistered(), seeds: c.ListenAddrs(), relayOpts: relay, helperOpts: helper}
	cfg.CreateTopics = true
	cfg.OnPublished = func(rec *kgo.Record) {
		cp := *rec
		e.mu.Lock()
		e.published = append(e.published, &cp)
		e.mu.Unlock()
	}
	var err error
	e.r, err = New(cfg, e.routerOpts(), zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)), e.m, func(err error) {
		e.fatals.Add(1)
		e.mu.Lock()
		e.fatalErr = err
		e.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.r.Close)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := e.r.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	return e
}

// routerOpts are the client options of the env's routers.
func (e *env) routerOpts() []kgo.Opt {
	return append([]kgo.Opt{
		kgo.SeedBrokers(e.seeds...),
		// Retry produce quickly so tests that hold the broker resume soon.
		kgo.RetryBackoffFn(func(int) time.Duration { return 10 * time.Millisecond }),
	}, e.relayOpts...)
}

// helper is a client of the test's own.
func (e *env) helper(opts ...kgo.Opt) *kgo.Client {
	e.t.Helper()
	cl, err := kgo.NewClient(append(append([]kgo.Opt{kgo.SeedBrokers(e.seeds...)}, e.helperOpts...), opts...)...)
	if err != nil {
		e.t.Fatal(err)
	}
	return cl
}

// send calls Send until it takes the event, waiting on the channel it
// returns as the contract says (at most 50ms at a time), and returns Send's
// error.
func (e *env) send(ev *decoder.Event, lsn decoder.LSN, a Acker) error {
	e.t.Helper()
	deadline := time.Now().Add(patience)
	for {
		wait, err := e.r.Send(ev, lsn, a)
		if wait == nil {
			return err
		}
		if err != nil {
			e.t.Fatalf("Send returned both a channel and an error: %v", err)
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("Send of event %q still waiting after %v", ev.ID, patience)
		}
		select {
		case <-wait:
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// mustSend sends an event that must be taken without error.
func (e *env) mustSend(ev *decoder.Event, lsn decoder.LSN, a Acker) {
	e.t.Helper()
	if err := e.send(ev, lsn, a); err != nil {
		e.t.Fatalf("Send(%q): %v", ev.ID, err)
	}
}

// flush waits until every record sent is acknowledged or failed.
func (e *env) flush() {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := e.r.Flush(ctx); err != nil {
		e.t.Fatalf("Flush: %v", err)
	}
	if n := e.r.Inflight(); n != 0 {
		e.t.Fatalf("Inflight() = %d after Flush; want 0", n)
	}
}

// endOffsets returns how many records each of the (existing) topics holds.
func (e *env) endOffsets(topics ...string) map[string]int64 {
	e.t.Helper()
	return e.listOffsets((*kadm.Client).ListEndOffsets, topics...)
}

// listOffsets sums, per topic, the offsets list returns for its partitions.
func (e *env) listOffsets(list func(*kadm.Client, context.Context, ...string) (kadm.ListedOffsets, error), topics ...string) map[string]int64 {
	e.t.Helper()
	cl := e.helper()
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	offs, err := list(kadm.NewClient(cl), ctx, topics...)
	if err != nil {
		e.t.Fatalf("list offsets: %v", err)
	}
	if err := offs.Error(); err != nil {
		e.t.Fatalf("list offsets: %v", err)
	}
	n := make(map[string]int64)
	offs.Each(func(o kadm.ListedOffset) { n[o.Topic] += o.Offset })
	return n
}

// consume reads every record of the topics from the start, and checks
// that their count is what the broker holds.
func (e *env) consume(topics ...string) []*kgo.Record {
	e.t.Helper()
	want := int64(0)
	for _, n := range e.endOffsets(topics...) {
		want += n
	}
	cl := e.helper(kgo.ConsumeTopics(topics...), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	var recs []*kgo.Record
	for int64(len(recs)) < want {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			e.t.Fatalf("consumed %d of %d records: %v", len(recs), want, ctx.Err())
		}
		fs.EachError(func(topic string, p int32, err error) {
			e.t.Errorf("fetch %s/%d: %v", topic, p, err)
		})
		recs = append(recs, fs.Records()...)
	}
	if int64(len(recs)) != want {
		e.t.Fatalf("consumed %d records; the broker holds %d", len(recs), want)
	}
	return recs
}

// counterValue reads a counter. (prometheus/testutil.ToFloat64 would do,
// but testutil imports github.com/kylelemons/godebug, which go.mod does not
// list, so importing it would need a go.mod change.)
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatalf("read counter: %v", err)
	}
	if m.Counter == nil {
		t.Fatalf("not a counter: %v", &m)
	}
	return m.GetCounter().GetValue()
}

// histogramValue reads a histogram's count of observations and their sum.
func histogramValue(t *testing.T, h prometheus.Histogram) (uint64, float64) {
	t.Helper()
	var m dto.Metric
	if err := h.Write(&m); err != nil {
		t.Fatalf("read histogram: %v", err)
	}
	if m.Histogram == nil {
		t.Fatalf("not a histogram: %v", &m)
	}
	return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
}

func (e *env) deadLettered(reason deadletter.Reason) float64 {
	return counterValue(e.t, e.m.EventsDeadLettered.WithLabelValues(string(reason)))
}

func (e *env) publishedTo(topic string) float64 {
	return counterValue(e.t, e.m.EventsPublished.WithLabelValues(topic))
}

// header returns the value of the record's header key and whether it is
// there; it fails the test if the key appears twice.
func header(t *testing.T, rec *kgo.Record, key string) ([]byte, bool) {
	t.Helper()
	var v []byte
	found := false
	for _, h := range rec.Headers {
		if h.Key == key {
			if found {
				t.Errorf("record %s/%d@%d has header %q twice", rec.Topic, rec.Partition, rec.Offset, key)
			}
			v, found = h.Value, true
		}
	}
	return v, found
}

func byID(t *testing.T, recs []*kgo.Record, idHeader string) map[string]*kgo.Record {
	t.Helper()
	m := make(map[string]*kgo.Record)
	for _, rec := range recs {
		id, ok := header(t, rec, idHeader)
		if !ok {
			t.Fatalf("record %s/%d@%d has no %q header", rec.Topic, rec.Partition, rec.Offset, idHeader)
		}
		if m[string(id)] != nil {
			t.Fatalf("two records with id %q", id)
		}
		m[string(id)] = rec
	}
	return m
}

func lsnOf(i int) decoder.LSN { return decoder.LSN(0x1_0000_0000 + uint64(i)*0x100) }

// TestSendDeliversValidEvents proves that valid events of two transactions
// land on their template's topics with key = aggregate id, value = payload
// (NULL payload a tombstone), timestamp = commit time, and headers id, type
// and the non-NULL extra headers in order; that records of one key share a
// partition and keep their send order; that every Send is one Add and one
// Ack; that the published counter counts per topic; and that nothing is
// dead-lettered and the fatal handler is not called.
func TestSendDeliversValidEvents(t *testing.T) {
	e := newEnv(t, withDefaults(Config{}))
	type sent struct {
		ev *decoder.Event
		a  *testAcker
	}
	tx1, tx2 := &testAcker{}, &testAcker{}
	var evs []sent
	add := func(a *testAcker, id, agg, key string, payload []byte, mod func(*decoder.Event)) {
		ev := event(id, agg, key, "")
		ev.Payload = payload
		if mod != nil {
			mod(ev)
		}
		evs = append(evs, sent{ev, a})
	}
	for i := range 6 { // two keys interleaved, checked for order below
		add(tx1, fmt.Sprintf("o%d", i), "order", fmt.Sprintf("order-%d", i%2), fmt.Appendf(nil, `{"seq":%d}`, i), nil)
	}
	add(tx1, "c1", "customer", "cust-1", []byte(`{"name":"A"}`), func(ev *decoder.Event) {
		ev.Headers = []decoder.Header{{Key: "trace", Value: []byte("t-1")}, {Key: "tenant", Value: nil}, {Key: "user", Value: []byte("u-1")}}
	})
	add(tx2, "c2", "customer", "cust-1", nil, nil) // tombstone
	add(tx2, "c3", "customer", "cust-2", []byte{}, func(ev *decoder.Event) { ev.Type = nil })
	add(tx2, "o6", "order", "order-0", []byte(`{"seq":6}`), nil)

	for i, s := range evs {
		e.mustSend(s.ev, lsnOf(i), s.a)
	}
	e.flush()

	if got, want := tx1.adds.Load(), int64(7); got != want {
		t.Errorf("tx1 adds = %d; want %d", got, want)
	}
	if got, want := tx2.adds.Load(), int64(3); got != want {
		t.Errorf("tx2 adds = %d; want %d", got, want)
	}
	for name, a := range map[string]*testAcker{"tx1": tx1, "tx2": tx2} {
		if a.acks.Load() != a.adds.Load() {
			t.Errorf("%s: %d acks for %d adds", name, a.acks.Load(), a.adds.Load())
		}
	}
	if n := e.fatals.Load(); n != 0 {
		t.Fatalf("fatal called %d times: %v", n, e.fatalErr)
	}
	if e.r.Failed() {
		t.Error("Failed() = true")
	}

	recs := e.consume("outbox.event.order", "outbox.event.customer", "walrelay.dlq")
	if len(recs) != len(evs) {
		t.Fatalf("consumed %d records; want %d", len(recs), len(evs))
	}
	got := byID(t, recs, "id")
	for _, s := range evs {
		ev := s.ev
		rec := got[string(ev.ID)]
		if rec == nil {
			t.Errorf("event %q not delivered", ev.ID)
			continue
		}
		if want := "outbox.event." + string(ev.AggregateType); rec.Topic != want {
			t.Errorf("%q: topic %q; want %q", ev.ID, rec.Topic, want)
		}
		if !bytes.Equal(rec.Key, ev.AggregateID) {
			t.Errorf("%q: key %q; want %q", ev.ID, rec.Key, ev.AggregateID)
		}
		if !bytes.Equal(rec.Value, ev.Payload) || (rec.Value == nil) != (ev.Payload == nil) {
			t.Errorf("%q: value %q (nil %v); want %q (nil %v)", ev.ID, rec.Value, rec.Value == nil, ev.Payload, ev.Payload == nil)
		}
		if !rec.Timestamp.Equal(commitTime) {
			t.Errorf("%q: timestamp %v; want %v", ev.ID, rec.Timestamp, commitTime)
		}
		want := []hdr{{"id", string(ev.ID)}}
		if ev.Type != nil {
			want = append(want, hdr{"type", string(ev.Type)})
		}
		for _, h := range ev.Headers {
			if h.Value != nil {
				want = append(want, hdr{h.Key, string(h.Value)})
			}
		}
		if h := headersOf(rec.Headers); fmt.Sprint(h) != fmt.Sprint(want) {
			t.Errorf("%q: headers %q; want %q", ev.ID, h, want)
		}
	}

	// One key, one partition, in send order (offsets increase with ids).
	type pos struct {
		partition int32
		offset    int64
		id        string
	}
	byKey := make(map[string][]pos)
	for _, s := range evs {
		rec := got[string(s.ev.ID)]
		if rec == nil {
			continue
		}
		k := rec.Topic + "/" + string(rec.Key)
		byKey[k] = append(byKey[k], pos{rec.Partition, rec.Offset, string(s.ev.ID)})
	}
	for k, ps := range byKey {
		for i := 1; i < len(ps); i++ {
			if ps[i].partition != ps[0].partition {
				t.Errorf("key %s: %s on partition %d, %s on %d", k, ps[0].id, ps[0].partition, ps[i].id, ps[i].partition)
			}
			if ps[i].offset <= ps[i-1].offset {
				t.Errorf("key %s: %s (offset %d) sent after %s (offset %d)", k, ps[i].id, ps[i].offset, ps[i-1].id, ps[i-1].offset)
			}
		}
	}

	if got := e.publishedTo("outbox.event.order"); got != 7 {
		t.Errorf("published{outbox.event.order} = %v; want 7", got)
	}
	if got := e.publishedTo("outbox.event.customer"); got != 3 {
		t.Errorf("published{outbox.event.customer} = %v; want 3", got)
	}
	for _, reason := range []deadletter.Reason{deadletter.ReasonNoAggregateType, deadletter.ReasonNoAggregateID, deadletter.ReasonNoID, deadletter.ReasonInvalidTopic, deadletter.ReasonTopicRejected, deadletter.ReasonTooLarge} {
		if got := e.deadLettered(reason); got != 0 {
			t.Errorf("dead_lettered{%s} = %v; want 0", reason, got)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.published) != len(evs) {
		t.Errorf("OnPublished called %d times; want %d", len(e.published), len(evs))
	}
	for _, rec := range e.published {
		if rec.Partition < 0 || rec.Offset < 0 {
			t.Errorf("OnPublished got %s without partition/offset: %d@%d", rec.Topic, rec.Partition, rec.Offset)
		}
	}
}

// deadLetterCase is one invalid event and what its dead-letter record must
// say.
type deadLetterCase struct {
	name    string
	ev      *decoder.Event
	reason  deadletter.Reason
	omitted bool   // payload too large to ride along
	topic   string // walrelay.topic header, for topic reasons
}

// invalidEvents returns one event per invalid kind, with distinct ids
// (where the id is not NULL) and aggregate ids.
func invalidEvents() []deadLetterCase {
	mk := func(id, agg, key string, mod func(*decoder.Event)) *decoder.Event {
		ev := event(id, agg, key, `{"bad":true}`)
		if mod != nil {
			mod(ev)
		}
		return ev
	}
	return []deadLetterCase{
		{name: "NULL aggregate type", ev: mk("d1", "", "k1", func(ev *decoder.Event) { ev.AggregateType = nil }), reason: deadletter.ReasonNoAggregateType},
		{name: "empty aggregate type", ev: mk("d2", "", "k2", nil), reason: deadletter.ReasonNoAggregateType},
		{name: "NULL aggregate id", ev: mk("d3", "order", "", func(ev *decoder.Event) { ev.AggregateID = nil }), reason: deadletter.ReasonNoAggregateID},
		{name: "NULL id", ev: mk("", "order", "k4", func(ev *decoder.Event) { ev.ID = nil }), reason: deadletter.ReasonNoID},
		{name: "invalid topic name", ev: mk("d5", "bad type!", "k5", nil), reason: deadletter.ReasonInvalidTopic, topic: "outbox.event.bad type!"},
		{name: "topic the broker rejects", ev: mk("d6", "rejected", "k6", nil), reason: deadletter.ReasonTopicRejected, topic: "outbox.event.rejected"},
		{name: "record too large", ev: mk("d7", "order", "k7", func(ev *decoder.Event) {
			ev.Payload = bytes.Repeat([]byte("x"), 5000)
			ev.Headers = []decoder.Header{{Key: "trace", Value: []byte("t-7")}}
		}), reason: deadletter.ReasonTooLarge, omitted: true},
		{name: "unmappable row", ev: mk("d8", "order", "k8", func(ev *decoder.Event) {
			ev.Payload = nil // the column was dropped
			ev.Unmappable = fmt.Errorf(`outbox table public.outbox has no column "payload": %w`, decoder.ErrMissingColumn)
		}), reason: deadletter.ReasonUnmappable},
	}
}

// rejectTopic makes the broker refuse to create topic as Kafka refuses an
// invalid name.
func rejectTopic(c *kfake.Cluster, topic string) {
	c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.CreateTopics}, Topic: topic, Err: kerr.InvalidTopicException, Count: -1})
}

// TestSendDeadLettersInvalidEvents proves that every kind of invalid event
// (NULL or empty aggregate type, NULL aggregate id, NULL id, invalid topic
// name, a topic the broker refuses, a record over MaxRecordBytes) goes to
// the dead-letter topic with its key, payload (or walrelay.payload_omitted
// with the payload's length when it does not fit) and headers reason,
// detail, table, LSN, id (when not NULL), type, aggregate type and topic;
// that valid events around them still reach their topic; that each is
// counted by reason; and that each is one Add and one Ack.
func TestSendDeadLettersInvalidEvents(t *testing.T) {
	e := newEnv(t, withDefaults(Config{MaxRecordBytes: 2000}))
	rejectTopic(e.c, "outbox.event.rejected")
	cases := invalidEvents()
	a := &testAcker{}
	lsns := make(map[*decoder.Event]decoder.LSN)
	i := 0
	for _, tc := range cases {
		// A valid event before each invalid one: the stream goes on.
		e.mustSend(event(fmt.Sprintf("v%d", i), "order", "k", "ok"), lsnOf(i), a)
		i++
		lsns[tc.ev] = lsnOf(i)
		e.mustSend(tc.ev, lsnOf(i), a)
		i++
	}
	e.flush()

	if got, want := a.adds.Load(), int64(2*len(cases)); got != want {
		t.Errorf("adds = %d; want %d (one per event)", got, want)
	}
	if a.acks.Load() != a.adds.Load() {
		t.Errorf("acks = %d; want %d", a.acks.Load(), a.adds.Load())
	}
	if n := e.fatals.Load(); n != 0 {
		t.Fatalf("fatal called %d times: %v", n, e.fatalErr)
	}

	if n := e.endOffsets("outbox.event.order")["outbox.event.order"]; n != int64(len(cases)) {
		t.Errorf("outbox.event.order holds %d records; want the %d valid ones", n, len(cases))
	}
	dlq := e.consume("walrelay.dlq")
	if len(dlq) != len(cases) {
		t.Fatalf("dead-letter topic holds %d records; want %d", len(dlq), len(cases))
	}
	// Identify dead-letter records by key: every case has a distinct one
	// (or none, for the NULL aggregate id).
	byKey := make(map[string]*kgo.Record)
	for _, rec := range dlq {
		byKey[string(rec.Key)] = rec
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ev := tc.ev
			rec := byKey[string(ev.AggregateID)]
			if rec == nil {
				t.Fatalf("no dead-letter record with key %q", ev.AggregateID)
			}
			if (rec.Key == nil) != (ev.AggregateID == nil) {
				t.Errorf("key %q (nil %v); want %q", rec.Key, rec.Key == nil, ev.AggregateID)
			}
			if !rec.Timestamp.Equal(commitTime) {
				t.Errorf("timestamp %v; want %v", rec.Timestamp, commitTime)
			}
			want := map[string]string{
				deadletter.HeaderReason: string(tc.reason),
				deadletter.HeaderTable:  "public.outbox",
				deadletter.HeaderLSN:    lsns[ev].String(),
			}
			if ev.ID != nil {
				want["id"] = string(ev.ID)
			}
			if ev.Type != nil {
				want["type"] = string(ev.Type)
			}
			if ev.AggregateType != nil {
				want[deadletter.HeaderAggregateType] = string(ev.AggregateType)
			}
			if ev.AggregateID != nil {
				want[deadletter.HeaderAggregateID] = string(ev.AggregateID)
			}
			if tc.topic != "" {
				want[deadletter.HeaderTopic] = tc.topic
			}
			for _, h := range ev.Headers {
				want[h.Key] = string(h.Value)
			}
			if tc.omitted {
				want[deadletter.HeaderPayloadOmit] = fmt.Sprint(len(ev.Payload))
			}
			for k, v := range want {
				got, ok := header(t, rec, k)
				if !ok {
					t.Errorf("header %q missing", k)
				} else if string(got) != v {
					t.Errorf("header %q = %q; want %q", k, got, v)
				}
			}
			if detail, _ := header(t, rec, deadletter.HeaderDetail); len(detail) == 0 {
				t.Errorf("header %q empty or missing", deadletter.HeaderDetail)
			}
			if _, ok := header(t, rec, "walrelay.topic"); ok && tc.topic == "" {
				t.Errorf("unexpected %q header", deadletter.HeaderTopic)
			}
			if _, ok := header(t, rec, "id"); ok && ev.ID == nil {
				t.Error("id header on an event whose id is NULL")
			}
			if tc.omitted {
				if rec.Value != nil {
					t.Errorf("value of %d bytes; want none (payload omitted)", len(rec.Value))
				}
				if _, ok := header(t, rec, deadletter.HeaderPayloadOmit); !ok {
					t.Errorf("header %q missing", deadletter.HeaderPayloadOmit)
				}
			} else {
				if !bytes.Equal(rec.Value, ev.Payload) {
					t.Errorf("value %q; want the payload %q", rec.Value, ev.Payload)
				}
				if _, ok := header(t, rec, deadletter.HeaderPayloadOmit); ok {
					t.Errorf("header %q on a record whose payload fits", deadletter.HeaderPayloadOmit)
				}
			}
		})
	}

	counts := make(map[deadletter.Reason]float64)
	for _, tc := range cases {
		counts[tc.reason]++
	}
	for reason, want := range counts {
		if got := e.deadLettered(reason); got != want {
			t.Errorf("dead_lettered{%s} = %v; want %v", reason, got, want)
		}
	}
	if got := e.publishedTo("outbox.event.order"); got != float64(len(cases)) {
		t.Errorf("published{outbox.event.order} = %v; want %d", got, len(cases))
	}
	if got := e.publishedTo("outbox.event.rejected"); got != 0 {
		t.Errorf("published{outbox.event.rejected} = %v; want 0", got)
	}
	if got := e.publishedTo("walrelay.dlq"); got != float64(len(cases)) {
		t.Errorf("published{walrelay.dlq} = %v; want %d", got, len(cases))
	}
}

// TestSendInvalidPolicies proves on-invalid=fail and on-invalid=skip for
// every kind of invalid event: fail returns an *InvalidEventError naming
// reason, id, table and LSN; skip returns nil and counts the event; with
// neither is anything produced (the dead-letter topic exists and stays
// empty) nor the acker's Add called.
func TestSendInvalidPolicies(t *testing.T) {
	for _, policy := range []OnInvalid{InvalidFail, InvalidSkip} {
		t.Run(string(policy), func(t *testing.T) {
			e := newEnv(t, withDefaults(Config{MaxRecordBytes: 2000, OnInvalid: policy}), kfake.SeedTopics(3, "walrelay.dlq"))
			rejectTopic(e.c, "outbox.event.rejected")
			for i, tc := range invalidEvents() {
				a := &testAcker{}
				err := e.send(tc.ev, lsnOf(i), a)
				switch policy {
				case InvalidFail:
					var ie *deadletter.InvalidEventError
					if !errors.As(err, &ie) {
						t.Fatalf("%s: Send error = %v; want *deadletter.InvalidEventError", tc.name, err)
					}
					want := deadletter.InvalidEventError{Reason: tc.reason, Table: "public.outbox", LSN: lsnOf(i), ID: string(tc.ev.ID)}
					if ie.Reason != want.Reason || ie.Table != want.Table || ie.LSN != want.LSN || ie.ID != want.ID || ie.Detail == "" {
						t.Errorf("%s: error %+v; want %+v with a detail", tc.name, *ie, want)
					}
					if msg := ie.Error(); !strings.Contains(msg, string(tc.reason)) || !strings.Contains(msg, fmt.Sprintf("%q", tc.ev.ID)) {
						t.Errorf("%s: message %q names neither reason nor id", tc.name, msg)
					}
				case InvalidSkip:
					if err != nil {
						t.Errorf("%s: Send error = %v; want nil", tc.name, err)
					}
				}
				if a.adds.Load() != 0 {
					t.Errorf("%s: %d adds; want none", tc.name, a.adds.Load())
				}
			}
			e.flush()
			// The too-large event created its own topic before it was found
			// too large: both topics exist and must be empty.
			for topic, got := range e.endOffsets("walrelay.dlq", "outbox.event.order") {
				if got != 0 {
					t.Errorf("%s holds %d records; want none", topic, got)
				}
			}
			if policy == InvalidSkip {
				counts := make(map[deadletter.Reason]float64)
				for _, tc := range invalidEvents() {
					counts[tc.reason]++
				}
				for reason, want := range counts {
					if got := e.deadLettered(reason); got != want {
						t.Errorf("dead_lettered{%s} = %v; want %v", reason, got, want)
					}
				}
			}
			if got := e.publishedTo("walrelay.dlq"); got != 0 {
				t.Errorf("published{walrelay.dlq} = %v; want 0", got)
			}
			if n := e.fatals.Load(); n != 0 {
				t.Errorf("fatal called %d times: %v", n, e.fatalErr)
			}
		})
	}
}

// TestSendGate proves the in-flight bound: with MaxInflightEvents=2 and a
// broker refusing produce requests with a retriable error, two events are
// taken and the third Send returns a channel and takes nothing (no Add);
// once the broker accepts again the channel delivers, the third event is
// taken, and all three are acknowledged in order.
func TestSendGate(t *testing.T) {
	e := newEnv(t, withDefaults(Config{MaxInflightEvents: 2}))
	hold := e.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	held := true
	defer func() {
		if held {
			hold.Remove()
		}
	}()
	a := &testAcker{}
	e.mustSend(event("g0", "order", "k", "0"), lsnOf(0), a)
	e.mustSend(event("g1", "order", "k", "1"), lsnOf(1), a)

	third := event("g2", "order", "k", "2")
	wait, err := e.r.Send(third, lsnOf(2), a)
	if err != nil || wait == nil {
		t.Fatalf("third Send = %v, %v; want a channel to wait on", wait, err)
	}
	if got := a.adds.Load(); got != 2 {
		t.Fatalf("adds = %d; want 2 (the third event must not be taken)", got)
	}
	if got := e.r.Inflight(); got != 2 {
		t.Errorf("Inflight() = %d; want 2", got)
	}
	// Nothing can be released while the broker refuses every produce.
	select {
	case <-wait:
		t.Fatal("gate channel delivered while both records are still unacknowledged")
	default:
	}
	if wait2, _ := e.r.Send(third, lsnOf(2), a); wait2 == nil {
		t.Fatal("Send took an event with the gate still full")
	}
	if a.acks.Load() != 0 || a.adds.Load() != 2 {
		t.Fatalf("adds/acks = %d/%d while held; want 2/0", a.adds.Load(), a.acks.Load())
	}

	hold.Remove()
	held = false
	select {
	case <-wait:
	case <-time.After(patience):
		t.Fatal("gate channel did not deliver after the broker accepted the records")
	}
	e.mustSend(third, lsnOf(2), a)
	e.flush()
	if a.adds.Load() != 3 || a.acks.Load() != 3 {
		t.Errorf("adds/acks = %d/%d; want 3/3", a.adds.Load(), a.acks.Load())
	}
	recs := e.consume("outbox.event.order")
	if len(recs) != 3 {
		t.Fatalf("consumed %d records; want 3", len(recs))
	}
	for i, rec := range recs { // one key: one partition, in order
		if want := fmt.Sprint(i); string(rec.Value) != want {
			t.Errorf("record %d has value %q; want %q", i, rec.Value, want)
		}
	}
	if n := e.fatals.Load(); n != 0 {
		t.Errorf("fatal called %d times: %v", n, e.fatalErr)
	}
}

// TestSendGateBytes proves the byte bound: with MaxInflightBytes below two
// records' size and the broker holding produce requests, the first event
// is taken (one event larger than the bound still goes through alone) and
// the second waits.
func TestSendGateBytes(t *testing.T) {
	e := newEnv(t, withDefaults(Config{MaxInflightBytes: 500}))
	hold := e.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
	a := &testAcker{}
	e.mustSend(event("b0", "order", "k", strings.Repeat("x", 600)), lsnOf(0), a)
	wait, err := e.r.Send(event("b1", "order", "k", "small"), lsnOf(1), a)
	if err != nil || wait == nil || a.adds.Load() != 1 {
		t.Fatalf("second Send = %v, %v with %d adds; want a channel and 1 add", wait, err, a.adds.Load())
	}
	hold.Remove()
	e.mustSend(event("b1", "order", "k", "small"), lsnOf(1), a)
	e.flush()
	if a.adds.Load() != 2 || a.acks.Load() != 2 {
		t.Errorf("adds/acks = %d/%d; want 2/2", a.adds.Load(), a.acks.Load())
	}
}

// TestSendProduceFailure proves that a produce error Kafka will not retry
// (INVALID_RECORD) calls the fatal handler exactly once however many
// records fail, makes Failed() true, counts every failed record in
// walrelay_produce_errors_total, never acks a failed record, and still
// releases the in-flight gate.
func TestSendProduceFailure(t *testing.T) {
	e := newEnv(t, withDefaults(Config{}))
	e.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.InvalidRecord, Count: -1})
	a := &testAcker{}
	const n = 5
	for i := range n {
		e.mustSend(event(fmt.Sprintf("f%d", i), "order", fmt.Sprintf("k%d", i), "p"), lsnOf(i), a)
	}
	e.flush()
	if got := e.fatals.Load(); got != 1 {
		t.Fatalf("fatal called %d times; want exactly 1", got)
	}
	e.mu.Lock()
	ferr := e.fatalErr
	e.mu.Unlock()
	if !errors.Is(ferr, kerr.InvalidRecord) || !strings.Contains(ferr.Error(), "outbox.event.order") {
		t.Errorf("fatal error = %v; want INVALID_RECORD naming the topic", ferr)
	}
	if !e.r.Failed() {
		t.Error("Failed() = false after a refused record")
	}
	if a.adds.Load() != n || a.acks.Load() != 0 {
		t.Errorf("adds/acks = %d/%d; want %d/0", a.adds.Load(), a.acks.Load(), n)
	}
	if got := counterValue(t, e.m.ProduceErrors); got != n {
		t.Errorf("produce errors = %v; want %d", got, n)
	}
	if got := e.publishedTo("outbox.event.order"); got != 0 {
		t.Errorf("published{outbox.event.order} = %v; want 0", got)
	}
}

// TestSendNearLimitWithLongHeaders proves that an event whose
// size estimate is exactly MaxRecordBytes is either produced or
// dead-lettered, and never refused by the producer: here eight 200-byte
// header values make the record's wire size exceed the estimate.
func TestSendNearLimitWithLongHeaders(t *testing.T) {
	e := newEnv(t, withDefaults(Config{})) // MaxRecordBytes 1,000,012, franz-go's batch limit too
	ev := event("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f", "order", "k", "")
	ev.Type = nil
	for i := range 8 {
		ev.Headers = append(ev.Headers, decoder.Header{Key: fmt.Sprintf("h%d", i), Value: bytes.Repeat([]byte("v"), 200)})
	}
	// Fill the payload so that the estimate is exactly the limit.
	_, tp, _ := e.r.route(ev)
	ev.Payload = []byte{}
	base := e.r.newRecord(ev, tp, &testAcker{}).size
	// The payload's length varint grows with it: take the largest payload
	// whose estimate still fits.
	for n := e.r.cfg.MaxRecordBytes - base; ; n-- {
		ev.Payload = bytes.Repeat([]byte("p"), n)
		if e.r.newRecord(ev, tp, &testAcker{}).size <= e.r.cfg.MaxRecordBytes {
			break
		}
	}
	if got := e.r.newRecord(ev, tp, &testAcker{}).size; got < e.r.cfg.MaxRecordBytes-3 {
		t.Fatalf("estimate %d; want within 3 bytes of %d", got, e.r.cfg.MaxRecordBytes)
	}
	a := &testAcker{}
	e.mustSend(ev, lsnOf(0), a)
	e.flush()
	if n := e.fatals.Load(); n != 0 {
		t.Fatalf("fatal called %d times: %v", n, e.fatalErr)
	}
	if a.acks.Load() != 1 {
		t.Errorf("acks = %d; want 1", a.acks.Load())
	}
}

// A record answered NOT_LEADER_FOR_PARTITION (a topic the relay has just
// created, a leader election) is retried once the producer has refreshed
// its metadata. franz-go refreshes at most every MetadataMinAge, 5 s by
// default: such a record then waited about 5 s (seen on Apache Kafka as a
// p99 commit-to-consumer of 4 s right after startup). The router lowers the
// limit: the record is acknowledged well within half the default.
func TestSendRetriesNotLeaderWithoutWaitingForMetadataMinAge(t *testing.T) {
	e := newEnv(t, withDefaults(Config{}))
	a := &testAcker{}
	e.mustSend(event("warm", "order", "k", "p"), lsnOf(0), a) // the topic exists, metadata loaded
	e.flush()
	e.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotLeaderForPartition, Count: 1})
	began := time.Now()
	e.mustSend(event("moved", "order", "k", "p"), lsnOf(1), a)
	e.flush()
	if took := time.Since(began); took >= 2500*time.Millisecond {
		t.Errorf("a record answered NOT_LEADER_FOR_PARTITION took %s to be acknowledged: the metadata refresh waited for franz-go's 5 s MetadataMinAge", took.Round(time.Millisecond))
	}
	if got := a.acks.Load(); got != 2 {
		t.Errorf("acks = %d; want 2", got)
	}
}
