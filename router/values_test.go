package router

import (
	"errors"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
)

// fakeValues is a Config.Values: "wait" payloads make Send wait until
// open is closed, "bad" ones do not match, the others are framed.
type fakeValues struct {
	open  chan struct{}
	calls int
}

func (f *fakeValues) Value(topic string, ev *decoder.Event) ([]byte, <-chan struct{}, error) {
	f.calls++
	switch string(ev.Payload) {
	case "wait":
		select {
		case <-f.open:
			return []byte("framed:wait"), nil, nil
		default:
			return nil, f.open, nil
		}
	case "bad":
		return nil, nil, &deadletter.SchemaError{Reason: deadletter.ReasonSchemaMismatch, Subject: topic + "-value", Version: 3, ID: 9, Detail: "field x: want a string"}
	case "plain-error":
		return nil, nil, errors.New("no rule")
	}
	return append([]byte("framed:"), ev.Payload...), nil, nil
}

// TestValues: the record carries the value Config.Values makes; while it
// cannot make one yet, Send takes nothing and returns its channel; a
// payload it refuses is dead-lettered with the subject and version.
func TestValues(t *testing.T) {
	fv := &fakeValues{open: make(chan struct{})}
	e := newEnv(t, Config{Values: fv})
	a := &testAcker{}

	e.mustSend(event("1", "order", "k1", `ok`), 10, a)
	wait, err := e.r.Send(event("2", "order", "k2", "wait"), 20, a)
	if wait == nil || err != nil {
		t.Fatalf("Send while the value cannot be made: %v, %v; want a channel to wait on", wait, err)
	}
	if a.adds.Load() != 1 {
		t.Fatalf("%d records added; a waiting Send must take nothing", a.adds.Load())
	}
	close(fv.open)
	<-wait
	e.mustSend(event("2", "order", "k2", "wait"), 20, a)
	e.mustSend(event("3", "order", "k3", "bad"), 30, a)
	e.mustSend(event("4", "order", "k4", "plain-error"), 40, a)
	e.flush()

	recs := e.consume("outbox.event.order")
	values := map[string]bool{}
	for _, r := range recs {
		values[string(r.Value)] = true // (two keys: two partitions, read in any order)
	}
	if len(recs) != 2 || !values["framed:ok"] || !values["framed:wait"] {
		t.Fatalf("records with values %v: want the two framed values", values)
	}
	dlq := map[string]map[string]string{} // by value: the keys differ, so may the partitions
	for _, r := range e.consume("walrelay.dlq") {
		dlq[string(r.Value)] = headers(r)
	}
	if len(dlq) != 2 {
		t.Fatalf("dead letters of %d payloads; want 2", len(dlq))
	}
	if h := dlq["bad"]; h[deadletter.HeaderReason] != "schema_mismatch" || h[deadletter.HeaderSchemaSubject] != "outbox.event.order-value" || h[deadletter.HeaderSchemaVersion] != "3" {
		t.Errorf("dead letter of the payload that does not match: %v; want schema_mismatch, the subject and version 3", h)
	}
	if h := dlq["plain-error"]; h[deadletter.HeaderReason] != "schema_mismatch" || h[deadletter.HeaderDetail] != "no rule" {
		t.Errorf("dead letter %v: an error of no reason is a schema_mismatch with its text", h)
	}
	if got := e.deadLettered(deadletter.ReasonSchemaMismatch); got != 2 {
		t.Errorf("walrelay_events_dead_lettered_total{reason=schema_mismatch} = %v; want 2", got)
	}
	if a.acks.Load() != 4 {
		t.Errorf("%d acks; want every event acknowledged (two published, two dead-lettered)", a.acks.Load())
	}
}

func headers(rec *kgo.Record) map[string]string {
	h := map[string]string{}
	for _, x := range rec.Headers {
		h[x.Key] = string(x.Value)
	}
	return h
}
