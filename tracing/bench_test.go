package tracing

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
)

type nopAcker struct{}

func (nopAcker) Add() {}
func (nopAcker) Ack() {}

// BenchmarkSend is the router's cost per event, from Send to Kafka's
// acknowledgement on an in-process broker that discards records, with
// tracing off (no Tracer: the router's path without tracing), and on
// with every trace sampled and with 1% (spans exported to nowhere, so
// the cost is the relay's own: encoded as for a collector, sent nowhere).
// Run with -benchmem: off allocates what the router allocates without
// tracing.
func BenchmarkSend(b *testing.B) {
	for _, bc := range []struct {
		name    string
		sampler sdktrace.Sampler // nil: tracing off
	}{
		{"off", nil},
		{"on-sampled-1.0", sdktrace.ParentBased(sdktrace.TraceIDRatioBased(1))},
		{"on-sampled-0.01", sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0.01))},
	} {
		b.Run(bc.name, func(b *testing.B) {
			k, err := devcluster.StartKafka(devcluster.KafkaOptions{Discard: true})
			if err != nil {
				b.Fatal(err)
			}
			defer k.Close()
			cfg := router.DefaultConfig()
			if bc.sampler != nil {
				p, err := Start(context.Background(), Config{Enabled: true, Sampler: bc.sampler}, Options{Client: &marshalClient{}})
				if err != nil {
					b.Fatal(err)
				}
				defer func() { _ = p.Shutdown(context.Background()) }()
				cfg.Tracer = p.Producer()
			}
			r, err := router.New(cfg, []kgo.Opt{kgo.SeedBrokers(k.Addr()), kgo.ProducerLinger(time.Millisecond)}, zap.NewNop(), metrics.NewUnregistered(), func(err error) { b.Error(err) })
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			ctx := context.Background()
			if err := r.Start(ctx); err != nil {
				b.Fatal(err)
			}
			ev := &decoder.Event{
				Table: &decoder.Table{Schema: "public", Name: "outbox"}, ID: []byte("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f"),
				AggregateType: []byte("order"), AggregateID: []byte("order-42"), Type: []byte("OrderPlaced"),
				Payload: []byte(`{"orderId":42,"total":12.5,"currency":"EUR"}`), CommitTime: time.Now(),
				Headers: []decoder.Header{{Key: "traceparent"}, {Key: "tracestate"}},
			}
			send := func() {
				for {
					wait, err := r.Send(ev, 1, nopAcker{})
					if err != nil {
						b.Fatal(err)
					}
					if wait == nil {
						return
					}
					<-wait
				}
			}
			send() // the topic is created and ready
			if err := r.Flush(ctx); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				send()
			}
			if err := r.Flush(ctx); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// TestSendWithoutTracerAllocatesOnlyTheRecord: with tracing off the
// router does no tracing work: Send allocates the record (one
// allocation, headers inline) and nothing else.
func TestSendWithoutTracerAllocatesOnlyTheRecord(t *testing.T) {
	k, err := devcluster.StartKafka(devcluster.KafkaOptions{Discard: true})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	cfg := router.DefaultConfig()
	cfg.MaxInflightEvents = 100_000
	r, err := router.New(cfg, []kgo.Opt{kgo.SeedBrokers(k.Addr()), kgo.ProducerLinger(time.Minute)},
		zap.NewNop(), metrics.NewUnregistered(), func(err error) { t.Error(err) })
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := context.Background()
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	ev := &decoder.Event{
		Table: &decoder.Table{Schema: "public", Name: "outbox"}, ID: []byte("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f"),
		AggregateType: []byte("order"), AggregateID: []byte("order-42"), Type: []byte("OrderPlaced"),
		Payload: []byte(`{}`), CommitTime: time.Now(),
		Headers: []decoder.Header{{Key: "traceparent", Value: []byte(writerTP)}, {Key: "tracestate"}},
	}
	send := func() {
		for {
			wait, err := r.Send(ev, 1, nopAcker{})
			if err != nil {
				t.Fatal(err)
			}
			if wait == nil {
				return
			}
			<-wait
		}
	}
	send() // the topic is created and ready
	if n := testing.AllocsPerRun(1000, send); n != 1 {
		t.Errorf("Send without a tracer allocates %v times per event; want 1 (the record)", n)
	}
	if err := r.Flush(ctx); err != nil {
		t.Fatal(err)
	}
}

// marshalClient is an OTLP client that encodes each export request as the
// gRPC and HTTP clients do, and sends it nowhere: what an export costs the
// relay, without a collector's share.
type marshalClient struct {
	buf   []byte
	spans int
}

func (c *marshalClient) Start(context.Context) error { return nil }
func (c *marshalClient) Stop(context.Context) error  { return nil }
func (c *marshalClient) UploadTraces(_ context.Context, rs []*tracepb.ResourceSpans) error {
	var err error
	c.buf, err = proto.MarshalOptions{}.MarshalAppend(c.buf[:0], &coltracepb.ExportTraceServiceRequest{ResourceSpans: rs})
	for _, r := range rs {
		for _, s := range r.ScopeSpans {
			c.spans += len(s.Spans)
		}
	}
	return err
}

// BenchmarkSpan is tracing's own cost per event, without the router: a
// record's span begun, acknowledged and ended as the router does, and
// exported in batches through OpenTelemetry's OTLP exporter to a client
// that encodes the request and sends it nowhere. Sampling 1.0 and 0.01,
// the record carrying a sampled writer's context (parent-based: the
// writer's decision wins) or none (a root span, sampled at the ratio).
func BenchmarkSpan(b *testing.B) {
	for _, bc := range []struct {
		name   string
		ratio  float64
		parent bool
	}{{"root-1.0", 1, false}, {"root-0.01", 0.01, false}, {"child-1.0", 1, true}} {
		b.Run(bc.name, func(b *testing.B) {
			cl := &marshalClient{}
			p, err := Start(context.Background(), Config{Enabled: true, Sampler: sdktrace.ParentBased(sdktrace.TraceIDRatioBased(bc.ratio)), QueueSize: 1 << 20},
				Options{Client: cl})
			if err != nil {
				b.Fatal(err)
			}
			pr := p.Producer()
			commit := time.Now()
			var hs []kgo.RecordHeader
			if bc.parent {
				hs = append(hs, kgo.RecordHeader{Key: "traceparent", Value: []byte(writerTP)})
			}
			recs := make([]kgo.Record, 1024)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				rec := &recs[i%len(recs)]
				i++
				*rec = kgo.Record{Topic: "outbox.event.order", Key: []byte("order-42"), Headers: append(make([]kgo.RecordHeader, 0, 4), hs...)}
				pr.Start(rec, router.TraceStart{Commit: commit, Read: commit, ID: []byte("0b1c7a5e-3f1d-4c1e-9d7f-1a2b3c4d5e6f"), Grow: true})
				rec.Partition, rec.Offset = 1, int64(i)
				pr.End(rec, nil)
			}
			if err := p.Shutdown(context.Background()); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(cl.spans)/float64(b.N), "spans/op")
		})
	}
}
