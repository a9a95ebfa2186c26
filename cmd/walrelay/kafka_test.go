package main

import (
	"context"
	"strings"
	"testing"

	"go.uber.org/zap"
)

// TestKafkaSASLPlainNeedsTLSOrOptIn: SASL PLAIN sends the password as is,
// so without TLS it is refused unless --kafka-sasl-allow-plaintext says
// the network is trusted.
func TestKafkaSASLPlainNeedsTLSOrOptIn(t *testing.T) {
	plain := KafkaFlags{KafkaSASLMechanism: "plain", KafkaSASLUser: "u", KafkaSASLPassword: "p"}
	if _, err := plain.options(context.Background(), zap.NewNop(), nil); err == nil || !strings.Contains(err.Error(), "--kafka-sasl-allow-plaintext") {
		t.Errorf("SASL PLAIN without TLS: %v, want a refusal naming --kafka-sasl-allow-plaintext and --kafka-tls", err)
	}
	optIn := plain
	optIn.KafkaSASLAllowPlaintext = true
	if _, err := optIn.options(context.Background(), zap.NewNop(), nil); err != nil {
		t.Errorf("SASL PLAIN without TLS, opted in: %v", err)
	}
	if w := optIn.warnings(); len(w) != 1 || !strings.Contains(w[0], "plaintext") {
		t.Errorf("opting in to SASL PLAIN over plaintext warns %q, want one warning", w)
	}
	withTLS := plain
	withTLS.KafkaTLS = true
	if _, err := withTLS.options(context.Background(), zap.NewNop(), nil); err != nil {
		t.Errorf("SASL PLAIN over TLS: %v", err)
	}
	if w := withTLS.warnings(); len(w) != 0 {
		t.Errorf("SASL PLAIN over verified TLS warns %q", w)
	}
	// SCRAM never sends the password itself.
	scram := KafkaFlags{KafkaSASLMechanism: "scram-sha-512", KafkaSASLUser: "u", KafkaSASLPassword: "p"}
	if _, err := scram.options(context.Background(), zap.NewNop(), nil); err != nil {
		t.Errorf("SCRAM without TLS: %v", err)
	}
}

// TestKafkaTLSIsOneCondition: every flag that turns TLS on is reported as
// TLS on, skip-verify alone included, and skip-verify warns.
func TestKafkaTLSIsOneCondition(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags KafkaFlags
		tls   bool
	}{
		{"none", KafkaFlags{}, false},
		{"--kafka-tls", KafkaFlags{KafkaTLS: true}, true},
		{"--kafka-tls-server-name", KafkaFlags{KafkaTLSServerName: "kafka"}, true},
		{"--kafka-tls-insecure-skip-verify", KafkaFlags{KafkaTLSInsecureSkipVerify: true}, true},
	} {
		opts, err := tc.flags.options(context.Background(), zap.NewNop(), nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := tc.flags.tlsEnabled(); got != tc.tls || (len(opts) > 0) != tc.tls {
			t.Errorf("%s: tlsEnabled %v with %d client options, want %v", tc.name, got, len(opts), tc.tls)
		}
	}
	skip := KafkaFlags{KafkaTLSInsecureSkipVerify: true, KafkaSASLMechanism: "plain", KafkaSASLUser: "u"}
	if _, err := skip.options(context.Background(), zap.NewNop(), nil); err != nil {
		t.Errorf("SASL PLAIN over TLS without verification: %v", err)
	}
	if w := skip.warnings(); len(w) != 1 || !strings.Contains(w[0], "--kafka-tls-insecure-skip-verify") {
		t.Errorf("skip-verify warns %q, want one warning naming the flag", w)
	}
}

// TestKafkaPrincipal: the relay names its SASL user as Kafka's default
// principal builder does when Kafka denies it an operation; without SASL
// it does not guess.
func TestKafkaPrincipal(t *testing.T) {
	for _, tc := range []struct {
		f    KafkaFlags
		want string
	}{
		{KafkaFlags{KafkaSASLMechanism: "scram-sha-512", KafkaSASLUser: "relay"}, "User:relay"},
		{KafkaFlags{KafkaSASLMechanism: "plain", KafkaSASLUser: "relay", KafkaTLS: true}, "User:relay"},
		{KafkaFlags{KafkaTLS: true}, ""},
		{KafkaFlags{}, ""},
	} {
		if got := tc.f.principal(); got != tc.want {
			t.Errorf("principal of %+v = %q, want %q", tc.f, got, tc.want)
		}
	}
	cfg, err := parse(t, "run", "--pg-url", "postgres://u@h/db", "--brokers", "k:9092",
		"--kafka-sasl-mechanism", "scram-sha-256", "--kafka-sasl-user", "relay", "--kafka-sasl-password", "p").Run.config(context.Background(), zap.NewNop(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Router.Principal != "User:relay" {
		t.Errorf("walrelay run: router.Config.Principal = %q, want User:relay", cfg.Router.Principal)
	}
}
