package schema

import (
	"fmt"
	"strings"

	"github.com/twmb/franz-go/pkg/sr"

	"github.com/walrelay/walrelay/deadletter"
)

// codec makes the record values of one schema: a subject's version, its
// id, and what encodes or checks a payload for it.
type codec struct {
	subject string
	version int
	id      int
	format  Format
	enc     encoder
}

// encoder appends the encoded payload to dst (which holds the wire
// header already). An error is about the payload, in words.
type encoder interface {
	// index is the Protobuf message indexes for eventType's message (nil
	// for the other formats), or an error when there is no message.
	index(eventType string) ([]int, error)
	appendValue(dst, payload []byte, eventType string) ([]byte, error)
}

// header is the registry's wire header: franz-go's Confluent framing.
var header sr.ConfluentHeader

// value is payload as the record value: the wire header and the encoded
// payload, or a SchemaError saying what did not match.
func (c *codec) value(payload []byte, eventType string) ([]byte, error) {
	idx, err := c.enc.index(eventType)
	if err != nil {
		return nil, c.mismatch(err)
	}
	b, _ := header.AppendEncode(make([]byte, 0, len(payload)+16), c.id, idx) // never fails
	b, err = c.enc.appendValue(b, payload, eventType)
	if err != nil {
		return nil, c.mismatch(err)
	}
	return b, nil
}

func (c *codec) mismatch(err error) *deadletter.SchemaError {
	return &deadletter.SchemaError{Reason: deadletter.ReasonSchemaMismatch, Subject: c.subject, Version: c.version, ID: c.id, Detail: oneLine(err.Error())}
}

func (c *codec) wrongFormat(want Format) *deadletter.SchemaError {
	return &deadletter.SchemaError{Reason: deadletter.ReasonSchemaMismatch, Subject: c.subject, Version: c.version, ID: c.id,
		Detail: fmt.Sprintf("the subject holds a %s schema, and the value format of this event is %s", c.format.registryType(), want)}
}

// compile builds the codec of ss, whose references refs holds (each
// before those that reference it).
func compile(ss sr.SubjectSchema, refs []reference) (*codec, error) {
	c := &codec{subject: ss.Subject, version: ss.Version, id: ss.ID}
	var err error
	switch ss.Type {
	case sr.TypeAvro:
		c.format = Avro
		c.enc, err = compileAvro(ss.Schema.Schema, refs)
	case sr.TypeJSON:
		c.format = JSONSchema
		c.enc, err = compileJSONSchema(ss.Schema.Schema, refs)
	case sr.TypeProtobuf:
		c.format = Protobuf
		c.enc, err = compileProtobuf(ss.Schema.Schema, refs)
	default:
		return nil, fmt.Errorf("schema type %s: walrelay encodes AVRO, JSON and PROTOBUF", ss.Type)
	}
	if err != nil {
		return nil, fmt.Errorf("the %s schema does not compile: %s", c.format.registryType(), oneLine(err.Error()))
	}
	return c, nil
}

// oneLine is s on one line (a validator's report spans several), cut to
// what a header should carry.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 900 {
		s = s[:900] + "…"
	}
	return s
}
