package main

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/alecthomas/kong"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/relay"
)

// parse parses args with the binary's parser into a fresh cli.
func parse(t *testing.T, args ...string) *cli {
	t.Helper()
	var c cli
	k, err := kong.New(&c, parserOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := k.Parse(args); err != nil {
		t.Fatalf("parse %v: %v", args, err)
	}
	return &c
}

// TestDaemonDevAndEmbedderShareTheDefaults: `walrelay run` given only
// --pg-url and --brokers, `walrelay dev` given nothing, and an embedder
// that takes relay.DefaultConfig and sets the same URL and broker hand
// relay.New the same configuration, field by field, and the same Kafka
// client options.
func TestDaemonDevAndEmbedderShareTheDefaults(t *testing.T) {
	const url, broker = "postgres://walrelay@db.example:5432/app", "kafka.example:9092"
	log := zap.NewNop()

	daemon, err := parse(t, "run", "--pg-url", url, "--brokers", broker).Run.config(context.Background(), log, nil)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := parse(t, "dev").Dev.config(url, broker, log)
	if err != nil {
		t.Fatal(err)
	}
	embedder := relay.DefaultConfig()
	embedder.PGURL = url
	embedder.KafkaOptions = []kgo.Opt{kgo.SeedBrokers(broker)}

	for _, tc := range []struct {
		name string
		cfg  relay.Config
	}{{"walrelay run", daemon}, {"walrelay dev", dev}} {
		for _, d := range diff("relay.Config", reflect.ValueOf(tc.cfg), reflect.ValueOf(embedder)) {
			t.Errorf("%s: %s", tc.name, d)
		}
		for _, d := range kafkaDiff(t, tc.cfg.KafkaOptions, embedder.KafkaOptions) {
			t.Errorf("%s: Kafka client: %s", tc.name, d)
		}
	}
}

// diff lists the fields in which a and b differ, by path. KafkaOptions
// (functions) are left to kafkaDiff.
func diff(path string, a, b reflect.Value) []string {
	if a.Kind() != b.Kind() {
		return []string{fmt.Sprintf("%s: %v, want %v", path, a, b)}
	}
	switch a.Kind() {
	case reflect.Struct:
		var out []string
		for i := range a.NumField() {
			f := a.Type().Field(i)
			if f.Name == "KafkaOptions" || !f.IsExported() {
				continue
			}
			out = append(out, diff(path+"."+f.Name, a.Field(i), b.Field(i))...)
		}
		return out
	case reflect.Func:
		if a.IsNil() != b.IsNil() {
			return []string{fmt.Sprintf("%s: set on one side only", path)}
		}
		return nil
	default:
		if !reflect.DeepEqual(a.Interface(), b.Interface()) {
			return []string{fmt.Sprintf("%s = %v, want relay.DefaultConfig's %v", path, a.Interface(), b.Interface())}
		}
		return nil
	}
}

// kafkaDiff compares what two option lists make of a Kafka client: the
// options either side sets, read back from the client. The daemon adds a
// logger (its log carries the client's warnings), which is not compared.
func kafkaDiff(t *testing.T, a, b []kgo.Opt) []string {
	t.Helper()
	client := func(opts []kgo.Opt) *kgo.Client {
		cl, err := kgo.NewClient(opts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		return cl
	}
	ca, cb := client(a), client(b)
	var out []string
	for _, opt := range []string{
		"SeedBrokers", "ClientID", "ProducerLinger", "ProducerBatchCompression", "DialTLSConfig", "SASL",
		"TransactionalID", "RequiredAcks", "MaxBufferedRecords", "ProducerBatchMaxBytes", "RecordDeliveryTimeout",
		"DialTimeout",
	} {
		va, vb := ca.OptValue(opt), cb.OptValue(opt)
		if va == nil {
			t.Fatalf("kgo has no option %s", opt)
		}
		if !reflect.DeepEqual(va, vb) {
			out = append(out, fmt.Sprintf("%s = %v, want %v", opt, va, vb))
		}
	}
	return out
}

// TestFlagDuration: durations as the docs and a person write them.
func TestFlagDuration(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0: "0s", 200 * time.Microsecond: "200us", 5 * time.Millisecond: "5ms", 30 * time.Second: "30s",
		time.Minute: "1m", 2 * time.Minute: "2m", 90 * time.Second: "1m30s", time.Hour: "1h", 90 * time.Minute: "1h30m",
	} {
		if got := flagDuration(d); got != want {
			t.Errorf("flagDuration(%s) = %q, want %q", d, got, want)
		}
		if back, err := time.ParseDuration(flagDuration(d)); err != nil || back != d {
			t.Errorf("flagDuration(%s) = %q reads back as %s, %v", d, flagDuration(d), back, err)
		}
	}
}
