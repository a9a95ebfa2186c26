package router

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
)

// Kafka answers PRODUCER_FENCED both to a producer another one fenced and to
// one whose transaction it timed out: the transaction's age decides.
func TestTxnErrorClassification(t *testing.T) {
	for _, tc := range []struct {
		name          string
		err           error
		open          time.Duration
		fenced, timed bool
	}{
		{"fenced young transaction", kerr.ProducerFenced, 100 * time.Millisecond, true, false},
		{"fenced after the timeout", kerr.ProducerFenced, 3 * time.Second, false, true},
		{"other error", kerr.InvalidTxnState, 100 * time.Millisecond, false, false},
		{"other error after the timeout", kerr.InvalidTxnState, 3 * time.Second, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &Router{cfg: Config{TransactionTimeout: 2 * time.Second}, txnBegan: time.Now().Add(-tc.open)}
			err := r.txnError(fmt.Errorf("commit Kafka transaction: %w", tc.err))
			if got := errors.Is(err, ErrFenced); got != tc.fenced {
				t.Errorf("errors.Is(%v, ErrFenced) = %v, want %v", err, got, tc.fenced)
			}
			if got := errors.Is(err, ErrTxnTimedOut); got != tc.timed {
				t.Errorf("errors.Is(%v, ErrTxnTimedOut) = %v, want %v", err, got, tc.timed)
			}
			if !errors.Is(err, tc.err) {
				t.Errorf("%v does not wrap %v", err, tc.err)
			}
			if !r.Failed() {
				t.Error("a failed transactional call leaves the router not Failed: it would be reused")
			}
		})
	}
}
