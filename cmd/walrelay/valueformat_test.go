package main

import (
	"context"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/walrelay/walrelay/schema"
)

func TestValueFormatFlags(t *testing.T) {
	c := parse(t, "run", "--pg-url", "postgres://walrelay@db.example/app", "--brokers", "kafka.example:9092",
		"--value-format", "avro", "--value-format", "orders=json@2,type:shop.OrderPaid=protobuf",
		"--schema-registry-url", "http://registry.example/apis/ccompat/v7", "--subject-strategy", "topic-record")
	cfg, err := c.Run.config(context.Background(), zap.NewNop(), nil)
	if err != nil {
		t.Fatal(err)
	}
	v := cfg.Values
	if v.Default != (schema.Rule{Format: schema.Avro}) || v.Topics["orders"] != (schema.Rule{Format: schema.JSONSchema, Version: 2}) ||
		v.Types["shop.OrderPaid"] != (schema.Rule{Format: schema.Protobuf}) || v.Strategy != schema.TopicRecordName ||
		len(v.URLs) != 1 {
		t.Errorf("schema config %+v: want the flags' rules, strategy and URL", v)
	}

	for args, want := range map[string]string{
		"--value-format avro":          "--schema-registry-url",
		"--value-format xml":           "want asis, json, avro or protobuf",
		"--value-format type:=avro":    "type:TYPE=FORMAT",
		"--value-format orders=avro@0": "positive number",
	} {
		c := parse(t, append([]string{"run", "--pg-url", "postgres://walrelay@db.example/app", "--brokers", "kafka.example:9092"}, strings.Fields(args)...)...)
		_, err := c.Run.config(context.Background(), zap.NewNop(), nil)
		if err == nil || !strings.Contains(speakFlags(err.Error()), want) {
			t.Errorf("%s: error %v; want it to say %q", args, err, want)
		}
	}
}
