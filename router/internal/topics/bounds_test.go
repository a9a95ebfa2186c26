package topics

import (
	"testing"
	"time"
)

// Use admits new topics up to the bound and keeps admitting those already
// used; Label gives its own series to the first topics only.
func TestSetBounds(t *testing.T) {
	s := NewSet()
	if !s.Use("a", 2) || !s.Use("b", 2) || s.Use("c", 2) || !s.Use("a", 2) {
		t.Fatal("Use: want a and b admitted, c refused past 2, a still admitted")
	}
	if !NewSet().Use("x", -1) {
		t.Fatal("Use with a negative bound refused a topic")
	}
	if s.Label("a", 1) != "a" || s.Label("b", 1) != OtherLabel || s.Label("a", 1) != "a" {
		t.Fatal("Label: want a its own series, b under other")
	}
	if s.Refusal("a") != "" {
		t.Fatal("Refusal of a topic never refused")
	}
	s.Refuse("a", "denied")
	if s.Refusal("a") != "denied" {
		t.Fatal("Refuse not remembered")
	}
}

// The allowlist is anchored at both ends; an empty one allows everything.
func TestParseAllow(t *testing.T) {
	re, err := ParseAllow(`orders|payments`)
	if err != nil {
		t.Fatal(err)
	}
	if !re.MatchString("orders") || re.MatchString("orders-secret") || re.MatchString("x.payments") {
		t.Fatal("allowlist not anchored")
	}
	if re, err := ParseAllow(""); re != nil || err != nil {
		t.Fatalf("ParseAllow(\"\") = %v, %v; want nil, nil", re, err)
	}
	if _, err := ParseAllow("("); err == nil {
		t.Fatal("ParseAllow accepted an invalid expression")
	}
}

// Seed counts topics that exist whatever the bound, and they stay usable
// while new ones are refused.
func TestSetSeed(t *testing.T) {
	s := NewSet()
	if n := s.Seed([]string{"a", "b", "c"}); n != 3 {
		t.Fatalf("Seed counted %d topics, want 3", n)
	}
	if s.Use("d", 2) || !s.Use("a", 2) || !s.Use("c", 2) {
		t.Fatal("Use after Seed past the bound: want d refused, a and c admitted")
	}
	if s.ProduceTime("a") {
		t.Fatal("ProduceTime of a topic whose timestamps were never refused")
	}
	s.UseProduceTime("a")
	if !s.ProduceTime("a") || s.ProduceTime("b") {
		t.Fatal("UseProduceTime: want a only")
	}
}

// limitsOf takes the least of a topic's timestamp bounds, ignores
// Kafka's "no bound" default, and none apply under LogAppendTime.
func TestLimitsOf(t *testing.T) {
	const noBound = "9223372036854775807"
	for _, c := range []struct {
		name          string
		values        map[string]string
		before, after time.Duration
		maxBytes      int
	}{
		{"defaults", map[string]string{"max.message.bytes": "1048588", "message.timestamp.before.max.ms": noBound, "message.timestamp.after.max.ms": "3600000"}, 0, time.Hour, 1048588},
		{"before bound", map[string]string{"message.timestamp.before.max.ms": "86400000", "message.timestamp.after.max.ms": noBound}, 24 * time.Hour, 0, 0},
		{"difference is least", map[string]string{"message.timestamp.before.max.ms": "86400000", "message.timestamp.difference.max.ms": "60000"}, time.Minute, time.Minute, 0},
		{"zero is strictest", map[string]string{"message.timestamp.before.max.ms": "0"}, time.Millisecond, 0, 0},
		{"log append time", map[string]string{"message.timestamp.type": "LogAppendTime", "message.timestamp.before.max.ms": "1000"}, 0, 0, 0},
		{"nothing readable", map[string]string{"message.timestamp.before.max.ms": "x"}, 0, 0, 0},
	} {
		l := limitsOf(c.values)
		if l.TimestampBefore != c.before || l.TimestampAfter != c.after || l.MaxBytes != c.maxBytes {
			t.Errorf("%s: limits %+v, want before %s, after %s, max bytes %d", c.name, l, c.before, c.after, c.maxBytes)
		}
	}
}

// A denial is in force until allowed (the relay is not ready meanwhile);
// it is worth a warning when new and every DenialWarnEvery while it
// lasts, not at each of its repeats; allowed, a new denial warns at once.
func TestSetDenials(t *testing.T) {
	s := NewSet()
	t0 := time.Unix(1_000_000, 0)
	if s.Denied() != "" || s.IsDenied("topic a") || s.Allow("topic a") {
		t.Fatal("a new set has a denial")
	}
	if !s.Deny("topic b", "b denied", t0) {
		t.Error("a new denial: no warning")
	}
	if s.Deny("topic b", "b denied", t0.Add(time.Second)) || s.Deny("topic b", "b denied", t0.Add(DenialWarnEvery-time.Second)) {
		t.Error("a repeat within DenialWarnEvery: a warning")
	}
	if !s.Deny("topic b", "b denied", t0.Add(DenialWarnEvery)) {
		t.Error("a repeat DenialWarnEvery later: no warning")
	}
	s.Deny("topic a", "a denied", t0)
	if got := s.Denied(); got != "a denied" || !s.IsDenied("topic b") {
		t.Errorf("Denied() = %q, want the first resource's (a denied)", got)
	}
	if !s.Allow("topic a") || s.Allow("topic a") {
		t.Error("Allow: want true once, then false")
	}
	if got := s.Denied(); got != "b denied" {
		t.Errorf("Denied() = %q after allowing a, want b denied", got)
	}
	s.Allow("topic b")
	if s.Denied() != "" || !s.Deny("topic b", "b denied", t0.Add(DenialWarnEvery+time.Second)) {
		t.Error("allowed, then denied again: want no denial in between, and a warning at once")
	}
}
