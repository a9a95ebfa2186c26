package schema

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/sr"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
)

// Values makes record values from payloads with the registry's schemas.
// It is safe for concurrent use: one Values serves every router of a
// relay, and a writer's checks.
type Values struct {
	cfg     Config
	cl      *sr.Client
	log     *zap.Logger
	metrics *metrics.Metrics

	mu      sync.Mutex
	entries map[subjectVersion]*entry

	closing context.Context
	close   context.CancelFunc
	bg      sync.WaitGroup
}

type subjectVersion struct {
	subject string
	version int // Latest or a pinned version
}

// entry is what Values knows of one subject's version. A read of the
// registry runs in the background while ready is non-nil.
type entry struct {
	ready   chan struct{} // closed when the read in progress ends
	codec   *codec        // the schema in hand, nil until one was read
	invalid error         // a *deadletter.SchemaError: no such subject, or an unusable schema
	failure error         // why the last read failed (the registry did not answer)
	read    time.Time     // when codec or invalid was read
	retryAt time.Time     // no read before this, after a failure
}

// New returns Values for cfg. log receives a line per schema read and per
// failed read; m counts the registry's answers. Values needs no registry
// when every rule is AsIs.
func New(cfg Config, log *zap.Logger, m *metrics.Metrics) (*Values, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	v := &Values{cfg: cfg, log: log, metrics: m, entries: make(map[subjectVersion]*entry)}
	v.closing, v.close = context.WithCancel(context.Background())
	if len(cfg.URLs) > 0 {
		opts := []sr.ClientOpt{sr.URLs(cfg.URLs...), sr.UserAgent("walrelay")}
		if cfg.User != "" || cfg.Password != "" {
			opts = append(opts, sr.BasicAuth(cfg.User, cfg.Password))
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = cfg.TLS
		opts = append(opts, sr.HTTPClient(&http.Client{Timeout: cfg.Timeout, Transport: tr}))
		var err error
		if v.cl, err = sr.NewClient(opts...); err != nil {
			return nil, fmt.Errorf("schema registry client: %w", err)
		}
	}
	return v, nil
}

// Close ends the registry reads in progress and waits for them.
func (v *Values) Close() {
	v.close()
	v.bg.Wait()
}

// Value returns the record value of ev, an event going to topic: its
// payload as is under AsIs, else framed in the registry's wire format.
// While the subject's schema is being read it returns a channel to wait
// on instead (then call again); for a payload that does not match, or a
// subject the registry lacks, a *deadletter.SchemaError. A NULL payload
// stays NULL (a tombstone).
func (v *Values) Value(topic string, ev *decoder.Event) (value []byte, wait <-chan struct{}, err error) {
	r := v.cfg.rule(topic, ev.Type)
	if r.Format == AsIs || ev.Payload == nil {
		return ev.Payload, nil, nil
	}
	subject, err := v.cfg.subject(topic, ev.Type)
	if err != nil {
		return nil, nil, &deadletter.SchemaError{Reason: deadletter.ReasonSchemaMismatch, Detail: err.Error()}
	}
	c, wait, err := v.codec(subjectVersion{subject, r.Version}, r.Format, string(ev.Type))
	if wait != nil || err != nil {
		return nil, wait, err
	}
	value, err = c.value(ev.Payload, string(ev.Type))
	return value, nil, err
}

// Check checks payload, an event of eventType going to topic, against its
// schema and returns its record value, waiting for the registry as long
// as ctx allows. It gives up on a registry that fails to answer (the
// error wraps ErrUnavailable), since the caller is a business
// transaction: a schema read before keeps serving.
func (v *Values) Check(ctx context.Context, topic, eventType string, payload []byte) ([]byte, error) {
	var typ []byte
	if eventType != "" {
		typ = []byte(eventType)
	}
	ev := &decoder.Event{Type: typ, Payload: payload}
	for {
		value, wait, err := v.Value(topic, ev)
		if wait == nil {
			return value, err
		}
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the schema registry: %w", ctx.Err())
		}
		if err := v.failure(topic, ev.Type); err != nil {
			return nil, err
		}
	}
}

// ErrUnavailable is wrapped by Check's error when the registry did not
// answer.
var ErrUnavailable = errors.New("schema registry unavailable")

// failure is the error of the last failed read of the subject of an event
// of eventType going to topic, if that read failed and no schema is in
// hand.
func (v *Values) failure(topic string, eventType []byte) error {
	r := v.cfg.rule(topic, eventType)
	subject, err := v.cfg.subject(topic, eventType)
	if err != nil {
		return nil
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	e := v.entries[subjectVersion{subject, r.Version}]
	if e == nil || e.codec != nil || e.failure == nil {
		return nil
	}
	return fmt.Errorf("%w: subject %s: %w", ErrUnavailable, subject, e.failure)
}

// codec returns the codec of subject's version, the channel to wait on
// while it is being read, or the SchemaError it cannot be had for.
// eventType picks a Protobuf schema's message.
func (v *Values) codec(k subjectVersion, f Format, eventType string) (*codec, <-chan struct{}, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	e := v.entries[k]
	if e == nil {
		e = &entry{}
		v.entries[k] = e
	}
	now := time.Now()
	stale := now.Sub(e.read) >= v.cfg.Refresh
	switch {
	case e.codec != nil:
		if k.version == Latest && stale && e.ready == nil && !now.Before(e.retryAt) {
			v.read(k, e) // in the background: the schema in hand serves meanwhile
		}
		if e.codec.format != f {
			return nil, nil, e.codec.wrongFormat(f)
		}
		return e.codec, nil, nil
	case e.invalid != nil && (!stale || e.ready != nil):
		return nil, nil, e.invalid
	case e.ready != nil:
		return nil, e.ready, nil
	case now.Before(e.retryAt):
		return nil, after(e.retryAt), nil
	}
	v.read(k, e)
	return nil, e.ready, nil
}

// read starts reading k from the registry into e; v.mu is held.
func (v *Values) read(k subjectVersion, e *entry) {
	ready := make(chan struct{})
	e.ready = ready
	v.bg.Go(func() {
		defer close(ready)
		ctx, cancel := context.WithTimeout(v.closing, v.cfg.Timeout)
		defer cancel()
		c, invalid, err := v.fetch(ctx, k)
		v.mu.Lock()
		defer v.mu.Unlock()
		e.ready = nil
		switch {
		case err != nil:
			e.failure, e.retryAt = err, time.Now().Add(v.cfg.RetryPause)
			v.count("error")
			if e.codec != nil {
				v.log.Warn("schema registry: reading the subject's latest version failed; the schema in hand serves meanwhile",
					zap.String("subject", k.subject), zap.Int("version", e.codec.version), zap.Error(err))
			} else {
				v.log.Warn("schema registry: reading the subject's schema failed; its events wait (the slot is not confirmed past them) and the read is retried",
					zap.String("subject", k.subject), zap.Duration("retry_in", v.cfg.RetryPause), zap.Error(err))
			}
		case invalid != nil:
			e.failure, e.read = nil, time.Now()
			e.codec, e.invalid = nil, invalid
			v.count("invalid")
			v.log.Warn("schema registry: no usable schema; the subject's events are dead-lettered until one is registered",
				zap.String("subject", k.subject), zap.Error(invalid))
		default:
			if e.codec == nil || e.codec.id != c.id {
				v.log.Info("schema registry: schema read", zap.String("subject", k.subject), zap.Int("version", c.version), zap.Int("id", c.id), zap.String("format", string(c.format)))
			}
			e.failure, e.read = nil, time.Now()
			e.codec, e.invalid = c, nil
			v.count("ok")
		}
	})
}

func (v *Values) count(result string) {
	if v.metrics != nil {
		v.metrics.SchemaReads.WithLabelValues(result).Inc()
	}
}

// fetch reads subject k and its references and compiles the schema: a
// codec; or, for a subject or version the registry lacks or a schema that
// cannot serve, the SchemaError to dead-letter its events with; or the
// error of a registry that did not answer.
func (v *Values) fetch(ctx context.Context, k subjectVersion) (*codec, error, error) {
	version := k.version
	if version == Latest {
		version = -1
	}
	ss, err := v.cl.SchemaByVersion(ctx, k.subject, version)
	if err != nil {
		if notFound(err) {
			what := "no such subject in the registry"
			if k.version != Latest {
				what = fmt.Sprintf("the registry has no version %d of the subject", k.version)
			}
			return nil, &deadletter.SchemaError{Reason: deadletter.ReasonSchemaNotFound, Subject: k.subject, Version: k.version, Detail: what}, nil
		}
		return nil, nil, err
	}
	refs, err := v.references(ctx, ss.References, nil, map[string]bool{})
	if err != nil {
		if notFound(err) {
			return nil, &deadletter.SchemaError{Reason: deadletter.ReasonSchemaMismatch, Subject: ss.Subject, Version: ss.Version, ID: ss.ID,
				Detail: "a schema it references is not in the registry: " + err.Error()}, nil
		}
		return nil, nil, err
	}
	c, err := compile(ss, refs)
	if err != nil {
		return nil, &deadletter.SchemaError{Reason: deadletter.ReasonSchemaMismatch, Subject: ss.Subject, Version: ss.Version, ID: ss.ID, Detail: err.Error()}, nil
	}
	return c, nil, nil
}

// references reads the schemas refs name, and theirs, depth first (each
// before the schemas that reference it), each once.
func (v *Values) references(ctx context.Context, refs []sr.SchemaReference, have []reference, seen map[string]bool) ([]reference, error) {
	for _, ref := range refs {
		if seen[ref.Name] {
			continue // read already, or a cycle
		}
		seen[ref.Name] = true
		ss, err := v.cl.SchemaByVersion(ctx, ref.Subject, ref.Version)
		if err != nil {
			return nil, fmt.Errorf("reference %s (subject %s version %d): %w", ref.Name, ref.Subject, ref.Version, err)
		}
		if have, err = v.references(ctx, ss.References, have, seen); err != nil {
			return nil, err
		}
		have = append(have, reference{name: ref.Name, schema: ss.Schema})
	}
	return have, nil
}

// reference is a schema another one references, by the name it is
// referenced with (an Avro type's full name, a .proto import path, a JSON
// Schema $ref).
type reference struct {
	name   string
	schema sr.Schema
}

// notFound reports whether the registry answered that the subject, the
// version or the schema does not exist: Confluent's error codes 40401,
// 40402 and 40403, or a bare 404.
func notFound(err error) bool {
	var re *sr.ResponseError
	if !errors.As(err, &re) {
		return false
	}
	switch re.ErrorCode {
	case 40401, 40402, 40403:
		return true
	}
	return re.StatusCode == http.StatusNotFound && re.ErrorCode/100 != 500
}

// after is a channel that delivers at t.
func after(t time.Time) <-chan struct{} {
	ch := make(chan struct{})
	time.AfterFunc(time.Until(t), func() { close(ch) })
	return ch
}
