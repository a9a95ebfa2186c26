package main

import (
	"errors"
	"fmt"
	"io"
	"testing"
)

func TestClosedByBrokerLooksAtTheErrorNotItsText(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("reach kafka brokers: %w", io.EOF), true},
		{fmt.Errorf("sasl: %w", io.ErrUnexpectedEOF), true},
		{errors.New("topic EOF.events is not allowed"), false},
		{errors.New("SASL_AUTHENTICATION_FAILED"), false},
	} {
		if got := closedByBroker(tc.err); got != tc.want {
			t.Errorf("closedByBroker(%q) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
