package letter

import (
	"bytes"
	"errors"
	"strconv"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router/internal/topics"
)

func event() *decoder.Event {
	return &decoder.Event{
		Table:         &decoder.Table{Schema: "public", Name: "outbox"},
		ID:            []byte("id-1"),
		AggregateType: []byte("order"),
		AggregateID:   []byte("k"),
		Payload:       []byte(`{"n":1}`),
	}
}

func headers(rec kgo.Record) map[string]string {
	m := map[string]string{}
	for _, h := range rec.Headers {
		m[h.Key] = string(h.Value)
	}
	return m
}

// Check names the first thing that makes an event invalid, in the order
// the dead-letter reasons are documented, and nothing for a valid event.
func TestCheck(t *testing.T) {
	tests := []struct {
		name  string
		edit  func(*decoder.Event)
		fixed bool
		want  deadletter.Reason
	}{
		{"valid", func(*decoder.Event) {}, false, ""},
		{"unmappable first", func(e *decoder.Event) { e.Unmappable = errors.New("column dropped"); e.ID = nil }, false, deadletter.ReasonUnmappable},
		{"no aggregate type", func(e *decoder.Event) { e.AggregateType = nil; e.ID = nil }, false, deadletter.ReasonNoAggregateType},
		{"fixed template needs none", func(e *decoder.Event) { e.AggregateType = nil }, true, ""},
		{"no aggregate id before no id", func(e *decoder.Event) { e.AggregateID, e.ID = nil, nil }, false, deadletter.ReasonNoAggregateID},
		{"no id", func(e *decoder.Event) { e.ID = nil }, false, deadletter.ReasonNoID},
	}
	for _, tt := range tests {
		ev := event()
		tt.edit(ev)
		if got, detail := Check(ev, tt.fixed); got != tt.want || (got != "" && detail == "") {
			t.Errorf("%s: Check = %q, %q; want %q with a detail", tt.name, got, detail, tt.want)
		}
	}
}

// A dead letter carries the payload and the identifying headers when it
// fits; over the limit it drops the payload, says how large it was, and
// still fits.
func TestForEventShrinksToTheLimit(t *testing.T) {
	ev := event()
	l := Letter{Reason: deadletter.ReasonInvalidTopic, Detail: "bad", LSN: 0x10, Topic: "outbox.event.order", HeaderID: "id", HeaderType: "type"}
	rec, size := ForEvent(ev, l, "walrelay.dlq", 1<<20)
	h := headers(rec)
	if rec.Topic != "walrelay.dlq" || !bytes.Equal(rec.Value, ev.Payload) || size != topics.RecordSize(rec.Key, rec.Value, rec.Headers) {
		t.Fatalf("record = %+v (size %d); want the payload on walrelay.dlq", rec, size)
	}
	for k, v := range map[string]string{deadletter.HeaderReason: "invalid_topic", deadletter.HeaderTable: "public.outbox", deadletter.HeaderLSN: "0/10", deadletter.HeaderTopic: "outbox.event.order", "id": "id-1"} {
		if h[k] != v {
			t.Errorf("header %s = %q; want %q", k, h[k], v)
		}
	}
	if _, ok := h[deadletter.HeaderPayloadOmit]; ok {
		t.Errorf("header %s on a record that fits", deadletter.HeaderPayloadOmit)
	}

	ev.Payload = bytes.Repeat([]byte("x"), 5000)
	ev.AggregateID = bytes.Repeat([]byte("k"), 3000)
	rec, size = ForEvent(ev, l, "walrelay.dlq", 4096)
	if rec.Value != nil || size > 4096 || len(rec.Key) != 1024 || headers(rec)[deadletter.HeaderPayloadOmit] != "5000" {
		t.Fatalf("shrunk record: value %d bytes, key %d bytes, size %d, omitted %q; want no value, a 1 KiB key, at most 4096 bytes, omitted 5000",
			len(rec.Value), len(rec.Key), size, headers(rec)[deadletter.HeaderPayloadOmit])
	}
}

// A record Kafka refused for its topic becomes a topic_rejected dead
// letter that keeps the record's own headers, names its aggregate type and
// id as every dead letter does, and keeps its payload while it fits.
func TestForRefused(t *testing.T) {
	orig := &kgo.Record{Topic: "outbox.event.secret", Key: []byte("k"), Value: []byte("p"), Headers: []kgo.RecordHeader{{Key: "id", Value: []byte("id-1")}}}
	rec, _ := ForRefused(orig, []byte("secret"), "public.outbox", 0x20, "POLICY_VIOLATION", "walrelay.dlq", 1<<20)
	h := headers(rec)
	if rec.Topic != "walrelay.dlq" || string(rec.Value) != "p" || h[deadletter.HeaderReason] != string(deadletter.ReasonTopicRejected) || h[deadletter.HeaderTopic] != "outbox.event.secret" || h["id"] != "id-1" || h[deadletter.HeaderLSN] != "0/20" {
		t.Fatalf("dead letter = %+v, headers %v", rec, h)
	}
	if h[deadletter.HeaderAggregateType] != "secret" || h[deadletter.HeaderAggregateID] != "k" {
		t.Fatalf("dead letter headers %v: want %s secret and %s k", h, deadletter.HeaderAggregateType, deadletter.HeaderAggregateID)
	}
	orig.Value = bytes.Repeat([]byte("x"), 5000)
	rec, size := ForRefused(orig, []byte("secret"), "public.outbox", 0x20, "denied", "walrelay.dlq", 1024)
	if rec.Value != nil || size > 1024 || headers(rec)[deadletter.HeaderPayloadOmit] != strconv.Itoa(5000) {
		t.Fatalf("over the limit: value %d bytes, size %d, headers %v; want no value", len(rec.Value), size, headers(rec))
	}
}
