package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/outbox"
)

// refuseChecker refuses payloads containing "bad" and records what it
// was asked.
type refuseChecker struct{ asked []string }

var errRefused = errors.New("field x: want a string")

func (c *refuseChecker) CheckPayload(_ context.Context, aggregateType, eventType string, payload []byte) error {
	c.asked = append(c.asked, aggregateType+"/"+eventType)
	if strings.Contains(string(payload), "bad") {
		return errRefused
	}
	return nil
}

// untouchedTx is a transaction a refused event must never reach: any
// call on it panics (its methods are the nil interface's).
type untouchedTx struct{ pgx.Tx }

// TestWriteChecksThePayload: Options.Check sees every payload before the
// insert, and a refused one fails Write with the checker's error under it,
// without a statement sent in the transaction.
func TestWriteChecksThePayload(t *testing.T) {
	c := &refuseChecker{}
	w, err := outbox.NewWriter(outbox.Table{}, outbox.Options{Check: c})
	if err != nil {
		t.Fatal(err)
	}
	_, err = w.Write(context.Background(), untouchedTx{}, outbox.Event{AggregateType: "order", AggregateID: "1", Type: "OrderCreated", Payload: []byte(`{"x": "bad"}`)})
	if !errors.Is(err, errRefused) || !strings.Contains(err.Error(), "nothing was written") {
		t.Fatalf("Write of a refused payload: %v; want the checker's error, saying nothing was written", err)
	}
	if len(c.asked) != 1 || c.asked[0] != "order/OrderCreated" {
		t.Errorf("checker asked %v; want one check of order/OrderCreated", c.asked)
	}
}
