// Package schema gives outbox payloads a contract: the record value of a
// topic or of an event type in a schema registry's wire format (a zero
// magic byte, the schema's id as a big-endian uint32, for Protobuf the
// message indexes, then the encoded value), made from the row's JSON
// payload and checked against the schema registered for its subject.
//
// Formats: asis (the payload unchanged, the default), json (JSON Schema:
// the payload is validated and carried as it is), avro (the payload's JSON
// is converted to the schema's types and Avro-encoded) and protobuf (the
// payload is read as the proto3 JSON mapping of the schema's message and
// encoded). The subject is named by a Strategy from the topic, the event
// type or both; its schema (the latest version, or a pinned one) is read
// from any registry speaking the Confluent REST API (Confluent, Apicurio's
// /apis/ccompat/v7, Redpanda, Karapace) and cached.
//
// Values is what the router asks for each event (router.Config.Values):
// a value, a channel to wait on while the registry is read in the
// background (the relay keeps answering PostgreSQL and confirms nothing
// past the event meanwhile: a registry that is down delays, it never
// drops), or a *deadletter.SchemaError naming the subject and version a
// payload did not match, which the router dead-letters. Check does the
// same for a writer (outbox.Options.Check, through WriterCheck), blocking.
//
// The encoding is the libraries': franz-go's pkg/sr for the registry and
// the wire header, hamba/avro, google.golang.org/protobuf with
// bufbuild/protocompile, santhosh-tekuri/jsonschema.
package schema

import (
	"crypto/tls"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Format is how a record value is made from the payload.
type Format string

const (
	// AsIs produces the payload unchanged: no registry, no check.
	AsIs Format = "asis"
	// JSONSchema validates the payload against the subject's JSON Schema
	// and frames it unchanged.
	JSONSchema Format = "json"
	// Avro converts the payload's JSON to the subject's Avro schema and
	// encodes it (Avro binary).
	Avro Format = "avro"
	// Protobuf reads the payload as the proto3 JSON mapping of a message
	// of the subject's .proto schema and encodes it.
	Protobuf Format = "protobuf"
)

// registryType is the schemaType a registry gives a Format's schemas.
func (f Format) registryType() string {
	switch f {
	case JSONSchema:
		return "JSON"
	case Protobuf:
		return "PROTOBUF"
	}
	return "AVRO"
}

// Strategy names the subject of an event's schema, as the Confluent
// serializers' subject name strategies do.
type Strategy string

const (
	// TopicName names the subject "<topic>-value" (Confluent's
	// TopicNameStrategy; the default).
	TopicName Strategy = "topic"
	// RecordName names the subject after the event type, which must then
	// be the schema's fully qualified record name (RecordNameStrategy).
	RecordName Strategy = "record"
	// TopicRecordName names the subject "<topic>-<event type>"
	// (TopicRecordNameStrategy).
	TopicRecordName Strategy = "topic-record"
)

// Latest is the Rule.Version that follows the subject's newest version.
const Latest = 0

// Rule says how the values of a topic or an event type are made.
type Rule struct {
	Format Format
	// Version pins the subject's version; Latest (0) takes the newest,
	// read again every Config.Refresh.
	Version int
}

func (r Rule) String() string {
	if r.Version == Latest || r.Format == AsIs {
		return string(r.Format)
	}
	return string(r.Format) + "@" + strconv.Itoa(r.Version)
}

// ParseRule parses FORMAT[@VERSION]: asis, json, avro or protobuf, and a
// version number or "latest" (the default).
func ParseRule(s string) (Rule, error) {
	f, v, pinned := strings.Cut(strings.TrimSpace(s), "@")
	r := Rule{Format: Format(strings.ToLower(f))}
	switch r.Format {
	case AsIs, JSONSchema, Avro, Protobuf:
	default:
		return Rule{}, fmt.Errorf("value format %q: want asis, json, avro or protobuf, optionally with @VERSION", s)
	}
	if pinned && v != "latest" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return Rule{}, fmt.Errorf("value format %q: the version after @ is a positive number or latest", s)
		}
		if r.Format == AsIs {
			return Rule{}, fmt.Errorf("value format %q: asis has no schema to pin", s)
		}
		r.Version = n
	}
	return r, nil
}

// Config configures Values. Start from DefaultConfig: a zero is taken as
// zero where zero means something (no URLs, no rules) and refused by
// Validate, naming the field, where it does not (a zero Refresh).
type Config struct {
	// URLs are the registry's base URLs, Confluent's REST API (for
	// Apicurio Registry 3: http://host:8080/apis/ccompat/v7). Needed when
	// any rule is not AsIs.
	URLs []string
	// User and Password, when set, authenticate with HTTP basic auth.
	User, Password string
	// TLS, when set, is used for https URLs.
	TLS *tls.Config

	// Default is the rule of the topics and event types that Topics and
	// Types do not name. Default AsIs.
	Default Rule
	// Topics are rules by topic name.
	Topics map[string]Rule
	// Types are rules by event type (the type column); they win over
	// Topics.
	Types map[string]Rule
	// Strategy names the subjects. Default TopicName.
	Strategy Strategy

	// Refresh is how often a subject's latest version is read again; the
	// schema in hand is used meanwhile, and kept while the registry does
	// not answer. A pinned version that does not exist is asked about
	// again after Refresh too. Default 1 minute.
	Refresh time.Duration
	// Recheck is the least time between two reads of a subject's latest
	// version for payloads its answer refuses. A payload that does not
	// match the schema in hand (or whose subject the registry lacked) is
	// dead-lettered against that answer only if it is younger than
	// Recheck and Refresh; otherwise the event waits while the subject is
	// read again, and is checked against what that read gives: a version
	// registered since the one in hand serves the events written for it,
	// and a stream of bad payloads reads the registry once per Recheck at
	// most. A pinned version is never read again for it. Zero reads again
	// for every such payload. Default 1s.
	Recheck time.Duration
	// Timeout bounds one request to the registry. Default 10s. A read an
	// event waits for holds delivery as NotAnswering well before
	// (NotAnsweringAfter).
	Timeout time.Duration
	// RetryPause is the wait after a failed request before the next.
	// Default 1s.
	RetryPause time.Duration
}

// DefaultConfig returns the defaults each field's documentation names:
// every value as is, so no registry is needed.
func DefaultConfig() Config {
	return Config{
		Default:    Rule{Format: AsIs},
		Strategy:   TopicName,
		Refresh:    time.Minute,
		Recheck:    time.Second,
		Timeout:    10 * time.Second,
		RetryPause: time.Second,
	}
}

// Active reports whether any rule needs the registry.
func (c Config) Active() bool {
	if c.Default.Format != "" && c.Default.Format != AsIs {
		return true
	}
	for _, r := range c.Topics {
		if r.Format != AsIs {
			return true
		}
	}
	for _, r := range c.Types {
		if r.Format != AsIs {
			return true
		}
	}
	return false
}

// Validate reports what in c Values cannot work with.
func (c Config) Validate() error {
	def := DefaultConfig()
	for _, d := range []struct {
		field  string
		d, def time.Duration
	}{
		{"schema.Config.Refresh", c.Refresh, def.Refresh},
		{"schema.Config.Timeout", c.Timeout, def.Timeout},
		{"schema.Config.RetryPause", c.RetryPause, def.RetryPause},
	} {
		if d.d <= 0 {
			return fmt.Errorf("%s is %s: give it a positive duration (the default is %s)", d.field, d.d, d.def)
		}
	}
	check := func(what string, r Rule) error {
		switch r.Format {
		case AsIs, JSONSchema, Avro, Protobuf:
		default:
			return fmt.Errorf("%s: value format %q: want asis, json, avro or protobuf", what, r.Format)
		}
		if r.Version < 0 {
			return fmt.Errorf("%s: version %d: want a positive version, or 0 for the latest", what, r.Version)
		}
		return nil
	}
	if err := check("schema.Config.Default", c.Default); err != nil {
		return err
	}
	for t, r := range c.Topics {
		if err := check("schema.Config.Topics["+t+"]", r); err != nil {
			return err
		}
	}
	for t, r := range c.Types {
		if err := check("schema.Config.Types["+t+"]", r); err != nil {
			return err
		}
	}
	switch c.Strategy {
	case TopicName, RecordName, TopicRecordName:
	default:
		return fmt.Errorf("schema.Config.Strategy %q: want topic, record or topic-record (the default is %s)", c.Strategy, def.Strategy)
	}
	if c.Active() && len(c.URLs) == 0 {
		return errors.New("a value format other than asis needs the schema registry's URL: set schema.Config.URLs")
	}
	return nil
}

// rule is the rule for an event of eventType going to topic.
func (c *Config) rule(topic string, eventType []byte) Rule {
	if len(c.Types) > 0 && eventType != nil {
		if r, ok := c.Types[string(eventType)]; ok {
			return r
		}
	}
	if r, ok := c.Topics[topic]; ok {
		return r
	}
	return c.Default
}

// subject names the subject of an event of eventType going to topic, or
// says why it cannot.
func (c *Config) subject(topic string, eventType []byte) (string, error) {
	switch c.Strategy {
	case RecordName:
		if len(eventType) == 0 {
			return "", errors.New("the event has no type, which names its subject (record strategy)")
		}
		return string(eventType), nil
	case TopicRecordName:
		if len(eventType) == 0 {
			return "", errors.New("the event has no type, which names its subject with the topic (topic-record strategy)")
		}
		return topic + "-" + string(eventType), nil
	}
	return topic + "-value", nil
}
