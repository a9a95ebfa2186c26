package schema

import (
	"context"
	"strings"
)

// WriterCheck checks an outbox writer's payloads against the schemas the
// relay will frame them with (outbox.Options.Check): a payload that does
// not match fails the business transaction with a *deadletter.SchemaError
// naming the subject and version, instead of reaching the relay's
// dead-letter topic. Give it the relay's value formats (a Values made
// from the same Config) and topic template.
type WriterCheck struct {
	Values *Values
	// TopicTemplate is the relay's (--topic-template): it makes the topic
	// that picks the rule and names the subject. Default
	// "outbox.event.{aggregate_type}".
	TopicTemplate string
}

// CheckPayload checks payload, an event of eventType and aggregateType. A
// registry that does not answer fails the check (the error wraps
// ErrUnavailable) unless its schema was read before.
func (w WriterCheck) CheckPayload(ctx context.Context, aggregateType, eventType string, payload []byte) error {
	tmpl := w.TopicTemplate
	if tmpl == "" {
		tmpl = "outbox.event.{aggregate_type}"
	}
	_, err := w.Values.Check(ctx, strings.Replace(tmpl, "{aggregate_type}", aggregateType, 1), eventType, payload)
	return err
}
