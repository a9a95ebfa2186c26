package topics

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// aggregateTypePlaceholder is replaced by the row's aggregate_type in the
// topic template.
const aggregateTypePlaceholder = "{aggregate_type}"

// Template turns an aggregate type into a topic name.
type Template struct {
	prefix, suffix string
	fixed          bool // no placeholder: every event goes to one topic
}

// ParseTemplate parses a topic template such as "outbox.event.{aggregate_type}".
// A template without the placeholder routes every event to one topic.
func ParseTemplate(s string) (Template, error) {
	if s == "" {
		return Template{}, errors.New("topic template is empty")
	}
	n := strings.Count(s, aggregateTypePlaceholder)
	if n > 1 {
		return Template{}, fmt.Errorf("topic template %q: %s may appear once", s, aggregateTypePlaceholder)
	}
	if n == 0 {
		if strings.ContainsAny(s, "{}") {
			return Template{}, fmt.Errorf("topic template %q: only %s is a placeholder", s, aggregateTypePlaceholder)
		}
		if err := ValidName(s); err != nil {
			return Template{}, fmt.Errorf("topic template: %w", err)
		}
		return Template{prefix: s, fixed: true}, nil
	}
	i := strings.Index(s, aggregateTypePlaceholder)
	t := Template{prefix: s[:i], suffix: s[i+len(aggregateTypePlaceholder):]}
	if strings.ContainsAny(t.prefix+t.suffix, "{}") {
		return Template{}, fmt.Errorf("topic template %q: only %s is a placeholder", s, aggregateTypePlaceholder)
	}
	// The fixed parts must be able to form a valid name around a
	// one-character aggregate type; else every event would be invalid.
	if err := ValidName(t.prefix + "x" + t.suffix); err != nil {
		return Template{}, fmt.Errorf("topic template %q can never make a valid topic name: %w", s, err)
	}
	return t, nil
}

// Topic returns the topic for an aggregate type.
func (t Template) Topic(aggregateType []byte) string {
	if t.fixed {
		return t.prefix
	}
	return t.prefix + string(aggregateType) + t.suffix
}

// Produces reports whether name is a topic the template makes of some
// (non-empty) aggregate type; never for a fixed template.
func (t Template) Produces(name string) bool {
	return !t.fixed && len(name) > len(t.prefix)+len(t.suffix) && strings.HasPrefix(name, t.prefix) && strings.HasSuffix(name, t.suffix)
}

// Fixed reports whether the template has no placeholder: every event goes
// to one topic, whatever (even no) aggregate type it has.
func (t Template) Fixed() bool { return t.fixed }

// maxNameLen is Kafka's limit on topic name length.
const maxNameLen = 249

// ValidName reports why Kafka would reject name, or nil. Kafka allows 1 to
// 249 characters from [a-zA-Z0-9._-], except "." and "..".
func ValidName(name string) error {
	switch {
	case name == "":
		return errors.New("topic name is empty")
	case name == "." || name == "..":
		return fmt.Errorf("topic name %q is not allowed", name)
	case len(name) > maxNameLen:
		return fmt.Errorf("topic name is %d characters long, Kafka allows %d", len(name), maxNameLen)
	}
	// Range over runes so the error quotes the character the writer
	// typed ('з'), not the first byte of its UTF-8 encoding.
	for i, c := range name {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			if c == utf8.RuneError {
				return fmt.Errorf("topic name %q has byte 0x%02x, not UTF-8; Kafka allows [a-zA-Z0-9._-]", name, name[i])
			}
			return fmt.Errorf("topic name %q has character %q; Kafka allows [a-zA-Z0-9._-]", name, c)
		}
	}
	return nil
}
