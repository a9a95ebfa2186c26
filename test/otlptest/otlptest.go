// Package otlptest is an OTLP trace receiver that tests, the benchmark and
// the orders example run in-process: the gRPC service of
// go.opentelemetry.io/proto/otlp and its HTTP form (POST /v1/traces,
// protobuf), keeping every span it receives. Stop kills it as a crashed
// collector goes: listeners and connections closed at once.
package otlptest

import (
	"context"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// Span is one received span, flattened.
type Span struct {
	Service       string // the resource's service.name
	TraceID       string // hex
	SpanID        string
	ParentSpanID  string // "" for a root span
	Name          string
	Kind          tracepb.Span_SpanKind
	Start, End    time.Time
	Attrs         map[string]string // every attribute as text
	Events        []Event
	Status        tracepb.Status_StatusCode
	StatusMessage string
}

// Event is a span event.
type Event struct {
	Name string
	Time time.Time
}

// Receiver receives OTLP traces over gRPC and HTTP on the loopback
// interface.
type Receiver struct {
	coltracepb.UnimplementedTraceServiceServer
	grpcLn, httpLn net.Listener
	grpc           *grpc.Server
	http           *http.Server

	discard bool // count spans, keep none (StartCounting)

	mu    sync.Mutex
	spans []Span
	count int
}

// Start starts a receiver on two free loopback ports.
func Start() (*Receiver, error) { return start(&Receiver{}) }

// StartCounting starts a receiver that counts the spans it receives and
// keeps none (Spans is empty): for a benchmark's hundreds of thousands.
func StartCounting() (*Receiver, error) { return start(&Receiver{discard: true}) }

func start(r *Receiver) (*Receiver, error) {
	var err error
	if r.grpcLn, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		return nil, err
	}
	if r.httpLn, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		r.grpcLn.Close()
		return nil, err
	}
	r.grpc = grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(r.grpc, r)
	go func() { _ = r.grpc.Serve(r.grpcLn) }()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/traces", r.serveHTTP)
	r.http = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = r.http.Serve(r.httpLn) }()
	return r, nil
}

// GRPCEndpoint is the OTEL_EXPORTER_OTLP_ENDPOINT of the gRPC receiver.
func (r *Receiver) GRPCEndpoint() string { return "http://" + r.grpcLn.Addr().String() }

// HTTPEndpoint is the OTEL_EXPORTER_OTLP_ENDPOINT of the HTTP receiver.
func (r *Receiver) HTTPEndpoint() string { return "http://" + r.httpLn.Addr().String() }

// Stop kills the receiver: listeners and connections closed at once, as
// a collector that crashed.
func (r *Receiver) Stop() {
	r.grpc.Stop()
	_ = r.http.Close()
}

// Export implements the OTLP trace service.
func (r *Receiver) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	r.add(req)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func (r *Receiver) serveHTTP(w http.ResponseWriter, hr *http.Request) {
	body, err := io.ReadAll(hr.Body)
	req := &coltracepb.ExportTraceServiceRequest{}
	if err == nil {
		err = proto.Unmarshal(body, req)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.add(req)
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (r *Receiver) add(req *coltracepb.ExportTraceServiceRequest) {
	if r.discard {
		n := 0
		for _, rs := range req.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				n += len(ss.GetSpans())
			}
		}
		r.mu.Lock()
		r.count += n
		r.mu.Unlock()
		return
	}
	var got []Span
	for _, rs := range req.GetResourceSpans() {
		service := attrs(rs.GetResource().GetAttributes())["service.name"]
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				sp := Span{
					Service: service, TraceID: hex.EncodeToString(s.GetTraceId()), SpanID: hex.EncodeToString(s.GetSpanId()),
					ParentSpanID: hex.EncodeToString(s.GetParentSpanId()), Name: s.GetName(), Kind: s.GetKind(),
					Start: time.Unix(0, int64(s.GetStartTimeUnixNano())), End: time.Unix(0, int64(s.GetEndTimeUnixNano())),
					Attrs: attrs(s.GetAttributes()), Status: s.GetStatus().GetCode(), StatusMessage: s.GetStatus().GetMessage(),
				}
				for _, e := range s.GetEvents() {
					sp.Events = append(sp.Events, Event{Name: e.GetName(), Time: time.Unix(0, int64(e.GetTimeUnixNano()))})
				}
				got = append(got, sp)
			}
		}
	}
	r.mu.Lock()
	r.spans = append(r.spans, got...)
	r.count += len(got)
	r.mu.Unlock()
}

// Count is the number of spans received so far.
func (r *Receiver) Count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.count
}

// attrs renders attributes as text.
func attrs(kvs []*commonpb.KeyValue) map[string]string {
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		v := kv.GetValue()
		switch x := v.GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.GetKey()] = x.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.GetKey()] = strconv.FormatInt(x.IntValue, 10)
		case *commonpb.AnyValue_BoolValue:
			m[kv.GetKey()] = strconv.FormatBool(x.BoolValue)
		case *commonpb.AnyValue_DoubleValue:
			m[kv.GetKey()] = strconv.FormatFloat(x.DoubleValue, 'g', -1, 64)
		default:
			m[kv.GetKey()] = v.String()
		}
	}
	return m
}

// Spans returns the spans received so far, in the order they came.
func (r *Receiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Span(nil), r.spans...)
}

// Traces groups the spans received so far by trace id, each trace's spans
// in parent order where they form a chain (a parent before its children,
// then by start time).
func (r *Receiver) Traces() map[string][]Span {
	byTrace := map[string][]Span{}
	for _, s := range r.Spans() {
		byTrace[s.TraceID] = append(byTrace[s.TraceID], s)
	}
	for id, spans := range byTrace {
		byTrace[id] = parentOrder(spans)
	}
	return byTrace
}

// parentOrder sorts spans so that each comes after its parent, when the
// parent is among them; roots and orphans first, by start time.
func parentOrder(spans []Span) []Span {
	depth := func(s Span) int {
		d := 0
		for seen := 0; s.ParentSpanID != "" && seen < len(spans); seen++ {
			found := false
			for _, p := range spans {
				if p.SpanID == s.ParentSpanID {
					s, found = p, true
					d++
					break
				}
			}
			if !found {
				break
			}
		}
		return d
	}
	sort.SliceStable(spans, func(i, j int) bool {
		if di, dj := depth(spans[i]), depth(spans[j]); di != dj {
			return di < dj
		}
		return spans[i].Start.Before(spans[j].Start)
	})
	return spans
}
