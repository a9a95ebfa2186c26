package main

import (
	"testing"

	"github.com/alecthomas/kong"
)

// TestPresetDebezium: --preset debezium maps Debezium's default outbox
// columns and drops the type header; a column flag given another value
// still wins, and without the preset nothing changes.
func TestPresetDebezium(t *testing.T) {
	for _, tc := range []struct {
		args                []string
		aggType, aggID, typ string
	}{
		{[]string{"--preset", "debezium"}, "aggregatetype", "aggregateid", ""},
		{[]string{"--preset", "debezium", "--column-aggregate-id", "key", "--column-type", "kind"}, "aggregatetype", "key", "kind"},
		{nil, "aggregate_type", "aggregate_id", "type"},
	} {
		var c cli
		parser, err := kong.New(&c, parserOptions()...)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := parser.Parse(append([]string{"run", "--pg-url", "postgres://u@h/db", "--brokers", "k:9092"}, tc.args...)); err != nil {
			t.Fatal(err)
		}
		m, err := c.Run.mapping()
		if err != nil {
			t.Fatal(err)
		}
		if m.AggregateType != tc.aggType || m.AggregateID != tc.aggID || m.Type != tc.typ || m.ID != "id" || m.Payload != "payload" {
			t.Errorf("%v: mapping %+v, want aggregate type %q, aggregate id %q, type %q", tc.args, m, tc.aggType, tc.aggID, tc.typ)
		}
	}
	var c cli
	parser, _ := kong.New(&c, parserOptions()...)
	if _, err := parser.Parse([]string{"run", "--pg-url", "postgres://u@h/db", "--brokers", "k:9092", "--preset", "kafka-connect"}); err == nil {
		t.Error("--preset kafka-connect accepted; want a usage error naming none and debezium")
	}
}
