package schema

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
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
	holds   HoldReporter // nil: no one to tell
	// urls are the registry's URLs without credentials, for messages;
	// scrub removes the credentials URLs may carry from an error's text.
	urls  string
	scrub *strings.Replacer
	// notAnswering is how long a read an event waits for goes unanswered
	// before the registry holds delivery as NotAnswering.
	notAnswering time.Duration
	now          func() time.Time

	mu      sync.Mutex
	entries map[subjectVersion]*entry
	held    string // the reason and message last reported as a hold; "" when none

	closing context.Context
	close   context.CancelFunc
	bg      sync.WaitGroup
}

// HoldReporter is told when the registry holds delivery (a
// *holds.Condition of the relay's board): Hold with a reason, one
// CamelCase word, and one line naming the cause and the fix; Clear once
// it no longer does.
type HoldReporter interface {
	Hold(reason, message string)
	Clear()
}

// The reasons Values holds delivery for.
const (
	// HoldUnreachable: a read a waiting event needs failed (connection
	// refused, an error answer).
	HoldUnreachable = "Unreachable"
	// HoldNotAnswering: a read a waiting event needs has had no answer for
	// NotAnsweringAfter, or gave up at Config.Timeout without one.
	HoldNotAnswering = "NotAnswering"
)

// NotAnsweringAfter is how long a read that an event waits for may go
// unanswered before Values holds delivery as NotAnswering: long enough
// for a busy registry's answer, short enough to name a hung one well
// before the read gives up (Config.Timeout, 10s by default). With a
// Timeout under twice as long, half the Timeout.
const NotAnsweringAfter = 2 * time.Second

// Option sets what New takes besides a Config.
type Option func(*Values)

// ReportHolds makes Values report into h while a subject's schema cannot
// be had and events wait for it: HoldUnreachable, HoldNotAnswering, and
// Clear once every waiting subject has its schema. A failed refresh of a
// schema in hand holds nothing: that schema serves meanwhile.
func ReportHolds(h HoldReporter) Option { return func(v *Values) { v.holds = h } }

type subjectVersion struct {
	subject string
	version int // Latest or a pinned version
}

// entry is what Values knows of one subject's version. A read of the
// registry runs in the background while ready is non-nil.
type entry struct {
	ready   chan struct{} // closed when the read in progress ends
	started time.Time     // when the read in progress started
	codec   *codec        // the schema in hand, nil until one was read
	invalid error         // a *deadletter.SchemaError: no such subject, or an unusable schema
	failure error         // why the last read failed (the registry did not answer)
	read    time.Time     // when codec or invalid was read
	retryAt time.Time     // no read before this, after a failure
	// waiting is since when an event waits for a read of this entry (its
	// first, a retry, or a read again before a dead letter): zero when
	// none does. What holds delivery.
	waiting time.Time
	// reads counts the reads started, answered is the count of the one
	// whose answer is in hand; rechecking is the event waiting for a read
	// again before it is dead-lettered, and recheckRead the count of the
	// read that answers it.
	reads, answered uint64
	rechecking      *decoder.Event
	recheckRead     uint64
}

// New returns Values for cfg. log receives a line per schema read and per
// failed read; m counts the registry's answers. Values needs no registry
// when every rule is AsIs.
func New(cfg Config, log *zap.Logger, m *metrics.Metrics, opts ...Option) (*Values, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	v := &Values{cfg: cfg, log: log, metrics: m, entries: make(map[subjectVersion]*entry), now: time.Now,
		notAnswering: min(NotAnsweringAfter, cfg.Timeout/2)}
	for _, o := range opts {
		o(v)
	}
	v.closing, v.close = context.WithCancel(context.Background())
	v.urls, v.scrub = redactURLs(cfg.URLs)
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

// Close ends the registry reads in progress and waits for them; a hold
// it reported ends with it.
func (v *Values) Close() {
	v.close()
	v.bg.Wait()
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, e := range v.entries {
		e.waiting = time.Time{}
	}
	v.reportHolds()
}

// Value returns the record value of ev, an event going to topic: its
// payload as is under AsIs, else framed in the registry's wire format.
// While the subject's schema is being read it returns a channel to wait
// on instead (then call again with the same ev); for a payload that does
// not match, or a subject the registry lacks, a *deadletter.SchemaError.
// A NULL payload stays NULL (a tombstone).
//
// Following the subject's latest version, a payload is dead-lettered
// only against the registry's answer read since ev waited for it, or
// within Config.Recheck (and Config.Refresh): otherwise ev waits while
// the subject is read again, so that a version registered since the one
// in hand serves the events written for it.
func (v *Values) Value(topic string, ev *decoder.Event) (value []byte, wait <-chan struct{}, err error) {
	r := v.cfg.rule(topic, ev.Type)
	if r.Format == AsIs || ev.Payload == nil {
		return ev.Payload, nil, nil
	}
	subject, err := v.cfg.subject(topic, ev.Type)
	if err != nil {
		return nil, nil, &deadletter.SchemaError{Reason: deadletter.ReasonSchemaMismatch, Detail: err.Error()}
	}
	k := subjectVersion{subject, r.Version}
	c, wait, err, rechecking := v.codec(k, r.Format)
	if wait != nil {
		return nil, wait, nil
	}
	if err == nil {
		if value, err = c.value(ev.Payload, string(ev.Type)); err == nil {
			if rechecking {
				v.rechecked(k, ev)
			}
			return value, nil, nil
		}
	}
	if k.version == Latest {
		if wait := v.recheck(k, ev, c, err); wait != nil {
			return nil, wait, nil
		}
	}
	return nil, nil, err
}

// Check checks payload, an event of eventType going to topic, against its
// schema and returns its record value, waiting for the registry as long
// as ctx allows. It gives up on a registry that fails to answer (the
// error wraps ErrUnavailable), since the caller is a business
// transaction: a schema read before keeps serving, but for a payload that
// does not match it, which is checked against the subject's latest first.
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
// of eventType going to topic, if that read failed while an event waits
// for it.
func (v *Values) failure(topic string, eventType []byte) error {
	r := v.cfg.rule(topic, eventType)
	subject, err := v.cfg.subject(topic, eventType)
	if err != nil {
		return nil
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	e := v.entries[subjectVersion{subject, r.Version}]
	if e == nil || e.waiting.IsZero() || e.failure == nil {
		return nil
	}
	return fmt.Errorf("%w: subject %s: %w", ErrUnavailable, subject, e.failure)
}

// codec returns the codec of subject's version, the channel to wait on
// while it is being read, or the SchemaError it cannot be had for (with
// the codec in hand when that is its format); and whether an event waited
// for a read again before its dead letter (see recheck).
func (v *Values) codec(k subjectVersion, f Format) (_ *codec, _ <-chan struct{}, _ error, rechecking bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	e := v.entries[k]
	if e == nil {
		e = &entry{}
		v.entries[k] = e
	}
	now := v.now()
	stale := now.Sub(e.read) >= v.cfg.Refresh
	switch {
	case e.codec != nil:
		if k.version == Latest && stale && e.ready == nil && !now.Before(e.retryAt) {
			v.read(k, e, now) // in the background: the schema in hand serves meanwhile
		}
		if e.codec.format != f {
			return e.codec, nil, e.codec.wrongFormat(f), e.rechecking != nil
		}
		return e.codec, nil, nil, e.rechecking != nil
	case e.invalid != nil && (k.version == Latest || !stale || e.ready != nil):
		return nil, nil, e.invalid, false // (the latest: Value decides whether to read again)
	}
	return nil, v.await(k, e, now), nil, false
}

// rechecked ends ev's wait for a read again before its dead letter, now
// that the read it waited for made its value.
func (v *Values) rechecked(k subjectVersion, ev *decoder.Event) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if e := v.entries[k]; e.rechecking == ev {
		e.rechecking = nil
	}
}

// recheck decides whether ev, whose payload the answer in hand (c, or
// the invalid err) refuses, is dead-lettered now: nil if so; else the
// channel to wait on while the subject's latest is read again. The
// answer serves when ev waited for it, or when it is younger than
// Config.Recheck and Config.Refresh: the least time between two reads of
// a subject for payloads it refuses, so that a stream of bad payloads
// does not read the registry for each.
//
// ev is known by its pointer, which the router sends again after a wait
// but which the decoder also gives every later event: what ev waited for
// is forgotten as soon as it has its value or its dead letter, so that
// no later event takes the read ev waited for as its own.
func (v *Values) recheck(k subjectVersion, ev *decoder.Event, c *codec, err error) <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	e := v.entries[k]
	now := v.now()
	switch {
	case e.codec != c || c == nil && e.invalid != err:
		return closed // a newer answer came meanwhile: check against it
	case e.rechecking == ev && e.answered >= e.recheckRead:
		e.rechecking = nil
		return nil
	case now.Sub(e.read) < min(v.cfg.Recheck, v.cfg.Refresh):
		if e.rechecking == ev {
			e.rechecking = nil
		}
		return nil
	}
	e.rechecking = ev
	wait := v.await(k, e, now)
	e.recheckRead = e.reads
	if e.ready == nil {
		e.recheckRead++ // the read after the pause after a failure
	}
	return wait
}

// closed is a channel that is closed: ask again at once.
var closed = func() chan struct{} { ch := make(chan struct{}); close(ch); return ch }()

// await marks e waited for, and returns what to wait on: the read in
// progress, the pause after a failed one, or a read it starts; v.mu is
// held.
func (v *Values) await(k subjectVersion, e *entry, now time.Time) <-chan struct{} {
	if e.waiting.IsZero() {
		e.waiting = now
		defer v.reportHolds()
	}
	switch {
	case e.ready != nil:
		return e.ready
	case now.Before(e.retryAt):
		return after(e.retryAt.Sub(now))
	}
	v.read(k, e, now)
	return e.ready
}

// read starts reading k from the registry into e; v.mu is held.
func (v *Values) read(k subjectVersion, e *entry, now time.Time) {
	ready := make(chan struct{})
	e.ready, e.started = ready, now
	e.reads++
	n := e.reads
	var slow *time.Timer
	if v.holds != nil {
		// A read an event waits for that goes unanswered this long holds
		// delivery; the check at its end is reportHolds's.
		slow = time.AfterFunc(v.notAnswering, func() {
			v.mu.Lock()
			defer v.mu.Unlock()
			v.reportHolds()
		})
	}
	v.bg.Go(func() {
		defer close(ready)
		if slow != nil {
			defer slow.Stop()
		}
		ctx, cancel := context.WithTimeout(v.closing, v.cfg.Timeout)
		defer cancel()
		c, invalid, err := v.fetch(ctx, k)
		v.mu.Lock()
		defer v.mu.Unlock()
		e.ready = nil
		now := v.now()
		switch {
		case err != nil:
			err = &scrubbed{err: err, text: v.scrub.Replace(err.Error())}
			e.failure, e.retryAt = err, now.Add(v.cfg.RetryPause)
			v.count("error")
			switch {
			case e.codec != nil && e.waiting.IsZero():
				v.log.Warn("schema registry: reading the subject's latest version failed; the schema in hand serves meanwhile",
					zap.String("subject", k.subject), zap.Int("version", e.codec.version), zap.Error(err))
			case e.codec != nil:
				v.failed("schema registry: reading the subject's latest version again failed; the event that did not match its version in hand waits for it (the slot is not confirmed past it) and the read is retried",
					zap.String("subject", k.subject), zap.Int("version", e.codec.version), zap.Duration("retry_in", v.cfg.RetryPause), zap.Error(err))
			default:
				v.failed("schema registry: reading the subject's schema failed; its events wait (the slot is not confirmed past them) and the read is retried",
					zap.String("subject", k.subject), zap.Duration("retry_in", v.cfg.RetryPause), zap.Error(err))
			}
		case invalid != nil:
			e.failure, e.read, e.answered, e.waiting = nil, now, n, time.Time{}
			e.codec, e.invalid = nil, invalid
			v.count("invalid")
			v.log.Warn("schema registry: no usable schema; the subject's events are dead-lettered until one is registered",
				zap.String("subject", k.subject), zap.Error(invalid))
		default:
			if e.codec == nil || e.codec.id != c.id {
				v.log.Info("schema registry: schema read", zap.String("subject", k.subject), zap.Int("version", c.version), zap.Int("id", c.id), zap.String("format", string(c.format)))
			}
			e.failure, e.read, e.answered, e.waiting = nil, now, n, time.Time{}
			e.codec, e.invalid = c, nil
			v.count("ok")
		}
		v.reportHolds()
	})
}

// failed logs a failed read that events wait for: at WARN, unless a
// HoldReporter reports it (its WARN says when the hold starts and ends),
// then at INFO, a line per retry.
func (v *Values) failed(msg string, fields ...zap.Field) {
	if v.holds != nil {
		v.log.Info(msg, fields...)
		return
	}
	v.log.Warn(msg, fields...)
}

// reportHolds tells v.holds what holds delivery now: the subject waited
// for longest among those whose read failed or goes unanswered; v.mu is
// held.
func (v *Values) reportHolds() {
	if v.holds == nil {
		return
	}
	now := v.now()
	var (
		first  subjectVersion
		fe     *entry
		reason string
		n      int
	)
	for k, e := range v.entries {
		r := v.holdReason(e, now)
		if r == "" {
			continue
		}
		n++
		if fe == nil || e.waiting.Before(fe.waiting) || e.waiting.Equal(fe.waiting) && k.subject < first.subject {
			first, fe, reason = k, e, r
		}
	}
	if fe == nil {
		if v.held != "" {
			v.held = ""
			v.holds.Clear()
		}
		return
	}
	msg := v.holdMessage(first, fe, reason, now)
	if n > 1 {
		msg += fmt.Sprintf(" (and %d more subjects wait)", n-1)
	}
	if v.held == reason+": "+msg {
		return
	}
	v.held = reason + ": " + msg
	v.holds.Hold(reason, msg)
}

// holdReason is why e holds delivery, or "".
func (v *Values) holdReason(e *entry, now time.Time) string {
	switch {
	case e.waiting.IsZero():
		return ""
	case e.ready != nil && now.Sub(e.started) >= v.notAnswering, e.failure != nil && timedOut(e.failure):
		return HoldNotAnswering
	case e.failure != nil:
		return HoldUnreachable
	}
	return ""
}

// holdMessage says why e holds delivery, and what waits for it.
func (v *Values) holdMessage(k subjectVersion, e *entry, reason string, now time.Time) string {
	const waits = "; the subject's events wait for it, and every event after them with them, since delivery and confirmation follow commit order"
	switch {
	case reason == HoldUnreachable:
		return fmt.Sprintf("subject %s: a read of the schema registry at %s failed: %s%s: bring the registry back, or correct schema.Config.URLs", k.subject, v.urls, v.cause(e.failure), waits)
	case e.ready != nil && now.Sub(e.started) >= v.notAnswering:
		return fmt.Sprintf("subject %s: the schema registry at %s has left a read unanswered for over %s (it gives up at schema.Config.Timeout, %s, and retries)%s: check the registry and the network to it",
			k.subject, v.urls, v.notAnswering, v.cfg.Timeout, waits)
	}
	return fmt.Sprintf("subject %s: the schema registry at %s did not answer a read within schema.Config.Timeout, %s: %s%s: check the registry and the network to it",
		k.subject, v.urls, v.cfg.Timeout, v.cause(e.failure), waits)
}

// cause is what err says without the request's URL, which the message
// names already: a failed request's own error (refused, reset, timed
// out), or the registry's error answer.
func (v *Values) cause(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return v.scrub.Replace(ue.Err.Error())
	}
	return err.Error()
}

// timedOut reports whether err is a read that got no answer in time.
func timedOut(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}

// scrubbed is a registry error whose text lost the credentials the URLs
// carry.
type scrubbed struct {
	err  error
	text string
}

func (s *scrubbed) Error() string { return s.text }
func (s *scrubbed) Unwrap() error { return s.err }

// redactURLs returns urls without their credentials, for messages, and
// what removes those credentials from an error's text (as given, and as
// net/http redacts them).
func redactURLs(urls []string) (string, *strings.Replacer) {
	out := make([]string, len(urls))
	var pairs []string
	for i, raw := range urls {
		out[i] = raw
		u, err := url.Parse(raw)
		if err != nil || u.User == nil {
			continue
		}
		if _, rest, ok := strings.Cut(raw, "://"); ok {
			host, _, _ := strings.Cut(rest, "/")
			if at := strings.LastIndex(host, "@"); at >= 0 {
				pairs = append(pairs, host[:at+1], "")
			}
		}
		pairs = append(pairs, u.User.Username()+":xxxxx@", "", u.User.String()+"@", "")
		u.User = nil
		out[i] = u.String()
	}
	return strings.Join(out, ", "), strings.NewReplacer(pairs...)
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

// after is a channel that delivers after d.
func after(d time.Duration) <-chan struct{} {
	ch := make(chan struct{})
	time.AfterFunc(d, func() { close(ch) })
	return ch
}
