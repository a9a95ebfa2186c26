package topics

import (
	"strings"
	"testing"
)

// TestParseTemplate proves that ParseTemplate splits a template around its
// single {aggregate_type} placeholder, treats a template without it as one
// fixed (validated) topic, and refuses empty templates, repeated
// placeholders, stray braces and invalid fixed topic names.
func TestParseTemplate(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    Template
		wantErr string // substring of the error; "" means no error
	}{
		{name: "default", in: "outbox.event.{aggregate_type}", want: Template{prefix: "outbox.event."}},
		{name: "placeholder only", in: "{aggregate_type}", want: Template{}},
		{name: "prefix and suffix", in: "app.{aggregate_type}.v1", want: Template{prefix: "app.", suffix: ".v1"}},
		{name: "suffix only", in: "{aggregate_type}-events", want: Template{suffix: "-events"}},
		{name: "fixed", in: "outbox.all", want: Template{prefix: "outbox.all", fixed: true}},
		{name: "fixed max length", in: strings.Repeat("a", 249), want: Template{prefix: strings.Repeat("a", 249), fixed: true}},

		{name: "empty", in: "", wantErr: "empty"},
		{name: "two placeholders", in: "{aggregate_type}.{aggregate_type}", wantErr: "may appear once"},
		{name: "two placeholders adjacent", in: "{aggregate_type}{aggregate_type}", wantErr: "may appear once"},
		{name: "unknown placeholder", in: "outbox.{type}", wantErr: "only {aggregate_type} is a placeholder"},
		{name: "lone brace in fixed", in: "outbox}", wantErr: "only {aggregate_type} is a placeholder"},
		{name: "unknown braces around placeholder", in: "x.{aggregate_type}.{id}", wantErr: "only {aggregate_type} is a placeholder"},
		{name: "doubled braces", in: "{{aggregate_type}}", wantErr: "only {aggregate_type} is a placeholder"},
		{name: "misspelled placeholder", in: "outbox.{aggregatetype}", wantErr: "only {aggregate_type} is a placeholder"},
		{name: "fixed with space", in: "outbox all", wantErr: "topic template: topic name"},
		{name: "fixed dot", in: ".", wantErr: "not allowed"},
		{name: "fixed dot dot", in: "..", wantErr: "not allowed"},
		{name: "fixed too long", in: strings.Repeat("a", 250), wantErr: "250 characters long"},
		{name: "fixed with slash", in: "outbox/all", wantErr: "has character"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseTemplate(tt.in)
			if tt.wantErr != "" {
				if err == nil {
					t.Fatalf("ParseTemplate(%q) = %+v, nil; want error containing %q", tt.in, got, tt.wantErr)
				}
				if !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ParseTemplate(%q) error = %q; want it to contain %q", tt.in, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseTemplate(%q): %v", tt.in, err)
			}
			if got != tt.want {
				t.Fatalf("ParseTemplate(%q) = %+v; want %+v", tt.in, got, tt.want)
			}
		})
	}
}

// TestParseTemplateRejectsInvalidStaticParts proves that a template whose
// fixed prefix or suffix can never form a valid topic name is refused at
// start, as an invalid fixed template is (bad flags refuse to start with a
// one-line error rather than fail at run time), instead of silently
// dead-lettering every event.
func TestParseTemplateRejectsInvalidStaticParts(t *testing.T) {
	for _, in := range []string{
		"outbox event.{aggregate_type}",                       // space
		"outbox/{aggregate_type}",                             // slash
		"é.{aggregate_type}",                                  // non-ASCII
		strings.Repeat("a", 249) + "{aggregate_type}",         // no room left for any aggregate type
		"{aggregate_type}." + strings.Repeat("b", maxNameLen), // same, in the suffix
	} {
		if tmpl, err := ParseTemplate(in); err == nil {
			t.Errorf("ParseTemplate(%q) = %+v, nil; want an error (no event can ever get a valid topic)", in, tmpl)
		}
	}
}

// TestTemplateTopic proves that Topic substitutes the aggregate type between
// prefix and suffix byte for byte (without validating), and that a fixed
// template ignores the aggregate type, even a NULL or empty one.
func TestTemplateTopic(t *testing.T) {
	tests := []struct {
		tmpl  string
		agg   []byte
		topic string
	}{
		{"outbox.event.{aggregate_type}", []byte("order"), "outbox.event.order"},
		{"outbox.event.{aggregate_type}", []byte("Order_2-x.y"), "outbox.event.Order_2-x.y"},
		{"outbox.event.{aggregate_type}", []byte("bad type!"), "outbox.event.bad type!"},
		{"outbox.event.{aggregate_type}", []byte{}, "outbox.event."},
		{"outbox.event.{aggregate_type}", nil, "outbox.event."},
		{"{aggregate_type}", []byte("order"), "order"},
		{"app.{aggregate_type}.v1", []byte("customer"), "app.customer.v1"},
		{"{aggregate_type}-events", []byte("invoice"), "invoice-events"},
		{"outbox.all", []byte("order"), "outbox.all"},
		{"outbox.all", []byte{}, "outbox.all"},
		{"outbox.all", nil, "outbox.all"},
	}
	for _, tt := range tests {
		tmpl, err := ParseTemplate(tt.tmpl)
		if err != nil {
			t.Fatalf("ParseTemplate(%q): %v", tt.tmpl, err)
		}
		if got := tmpl.Topic(tt.agg); got != tt.topic {
			t.Errorf("ParseTemplate(%q).Topic(%q) = %q; want %q", tt.tmpl, tt.agg, got, tt.topic)
		}
	}
}

// TestValidName proves that ValidName accepts exactly Kafka's topic names:
// 1 to 249 characters of [a-zA-Z0-9._-], except "." and "..".
func TestValidName(t *testing.T) {
	tests := []struct {
		name  string
		topic string
		ok    bool
	}{
		{"empty", "", false},
		{"dot", ".", false},
		{"dot dot", "..", false},
		{"three dots", "...", true},
		{"dot prefix", ".hidden", true},
		{"single char", "a", true},
		{"249 chars", strings.Repeat("x", 249), true},
		{"250 chars", strings.Repeat("x", 250), false},
		{"lower", "abcdefghijklmnopqrstuvwxyz", true},
		{"upper", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", true},
		{"digits", "0123456789", true},
		{"dot underscore dash", "a.b_c-d", true},
		{"only punctuation", "._-", true},
		{"default template result", "outbox.event.order", true},
		{"space", "outbox event", false},
		{"slash", "outbox/event", false},
		{"backslash", `outbox\event`, false},
		{"colon", "outbox:event", false},
		{"plus", "a+b", false},
		{"at", "a@b", false},
		{"brace", "a{b}", false},
		{"bang", "bad type!", false},
		{"tab", "a\tb", false},
		{"nul", "a\x00b", false},
		{"e acute", "café", false},
		{"e acute alone", "é", false},
		{"emoji", "\U0001F600", false},
		{"e acute inside", "aéb", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ValidName(tt.topic)
			if tt.ok && err != nil {
				t.Fatalf("ValidName(%q) = %v; want nil", tt.topic, err)
			}
			if !tt.ok && err == nil {
				t.Fatalf("ValidName(%q) = nil; want an error", tt.topic)
			}
		})
	}
}

// TestValidNameEveryByte proves the character class byte by byte: every
// byte value is accepted alone exactly when it is in [a-zA-Z0-9._-] and
// the name is not ".".
func TestValidNameEveryByte(t *testing.T) {
	allowed := "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
	for c := 0; c < 256; c++ {
		name := "x" + string([]byte{byte(c)}) // "x" prefix keeps "." from being the whole name
		want := strings.IndexByte(allowed, byte(c)) >= 0
		if got := ValidName(name) == nil; got != want {
			t.Errorf("ValidName(%q) ok = %v; want %v", name, got, want)
		}
	}
}

// TestValidNameQuotesTheCharacter checks that the error names the
// offending character as the writer typed it, not its first UTF-8 byte.
func TestValidNameQuotesTheCharacter(t *testing.T) {
	tests := []struct{ topic, want string }{
		{"order.заказ", `character 'з'`},
		{"café", `character 'é'`},
		{"a b", `character ' '`},
		{"bad\xffutf8", `byte 0xff`},
	}
	for _, tt := range tests {
		err := ValidName(tt.topic)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ValidName(%q) = %v; want an error containing %s", tt.topic, err, tt.want)
		}
	}
}

// Produces tells the topics a template makes from those it cannot.
func TestTemplateProduces(t *testing.T) {
	tmpl, err := ParseTemplate("outbox.{aggregate_type}.v1")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]bool{"outbox.order.v1": true, "outbox.a.b.v1": true, "outbox..v1": false, "outbox.order": false, "other.order.v1": false} {
		if got := tmpl.Produces(name); got != want {
			t.Errorf("Produces(%q) = %v, want %v", name, got, want)
		}
	}
	fixed, _ := ParseTemplate("events")
	if fixed.Produces("events") {
		t.Error("a fixed template produces no event topic of its own to count")
	}
}
