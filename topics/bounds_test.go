package topics

import "testing"

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
