package router

import (
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/test/fakenet"
)

// TestCloseEndsTopicPreparation checks that a topic preparation Send
// started does not outlive the router: Close cancels it and waits, so no
// admin request of a replaced producer runs on for the preparation timeout.
func TestCloseEndsTopicPreparation(t *testing.T) {
	// A "broker" that accepts connections and never answers.
	broker := fakenet.Listen(t, fakenet.Silent)
	r, err := New(withDefaults(Config{CreateTopics: true}), []kgo.Opt{kgo.SeedBrokers(broker)}, zap.NewNop(), metrics.NewUnregistered(), func(error) {})
	if err != nil {
		t.Fatal(err)
	}
	ev := &decoder.Event{ID: []byte("1"), AggregateType: []byte("order"), AggregateID: []byte("a1"), Payload: []byte("{}")}
	ready, err := r.Send(ev, 0, nil)
	if err != nil || ready == nil {
		t.Fatalf("Send for a new topic returned (%v, %v), want a channel to wait on while it is prepared", ready, err)
	}
	began := time.Now()
	r.Close()
	select {
	case <-ready:
	default:
		t.Fatal("Close returned while the topic preparation it started still runs")
	}
	if took := time.Since(began); took > prepareTimeout/2 {
		t.Fatalf("Close took %s: the preparation was waited for, not cancelled", took)
	}
}
