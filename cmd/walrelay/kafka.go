package main

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// KafkaFlags secure the connection to Kafka. PostgreSQL's TLS is set in
// --pg-url (sslmode, sslrootcert, sslcert, sslkey).
type KafkaFlags struct {
	KafkaTLS                   bool   `name:"kafka-tls" help:"Connect to Kafka over TLS (implied by the other --kafka-tls-* flags), verifying the brokers against the system roots or --kafka-tls-ca."`
	KafkaTLSCA                 string `name:"kafka-tls-ca" type:"existingfile" placeholder:"FILE" help:"PEM file of the CA(s) that signed the brokers' certificates."`
	KafkaTLSCert               string `name:"kafka-tls-cert" type:"existingfile" placeholder:"FILE" help:"PEM client certificate, for brokers that require one (with --kafka-tls-key)."`
	KafkaTLSKey                string `name:"kafka-tls-key" type:"existingfile" placeholder:"FILE" help:"PEM private key of --kafka-tls-cert."`
	KafkaTLSServerName         string `name:"kafka-tls-server-name" help:"Name to verify in the brokers' certificates instead of the host dialed."`
	KafkaTLSInsecureSkipVerify bool   `name:"kafka-tls-insecure-skip-verify" help:"Do not verify the brokers' certificates (testing only)."`
	KafkaSASLMechanism         string `name:"kafka-sasl-mechanism" enum:",plain,scram-sha-256,scram-sha-512" default:"" help:"SASL mechanism: plain, scram-sha-256 or scram-sha-512; empty for none."`
	KafkaSASLUser              string `name:"kafka-sasl-user" help:"SASL user name."`
	KafkaSASLPassword          string `name:"kafka-sasl-password" help:"SASL password; prefer the WALRELAY_KAFKA_SASL_PASSWORD environment variable to keep it out of process listings. Never logged."`
	KafkaSASLAllowPlaintext    bool   `name:"kafka-sasl-allow-plaintext" help:"Allow --kafka-sasl-mechanism plain without TLS, which sends the password readable to anyone on the network path; only for a trusted network."`
}

// tlsEnabled reports whether the connection to Kafka uses TLS: any
// --kafka-tls* flag turns it on. options and the startup log use it alike.
func (f KafkaFlags) tlsEnabled() bool {
	return f.KafkaTLS || f.KafkaTLSCA != "" || f.KafkaTLSCert != "" || f.KafkaTLSKey != "" || f.KafkaTLSServerName != "" || f.KafkaTLSInsecureSkipVerify
}

// warnings are what the flags relax, for the startup log.
func (f KafkaFlags) warnings() []string {
	var w []string
	if f.KafkaTLSInsecureSkipVerify {
		w = append(w, "--kafka-tls-insecure-skip-verify: the brokers' certificates are not verified, so anyone on the network path can impersonate a broker and read or alter the records and the SASL credentials; use --kafka-tls-ca instead")
	}
	if f.KafkaSASLMechanism == "plain" && !f.tlsEnabled() {
		w = append(w, "--kafka-sasl-allow-plaintext: SASL PLAIN without TLS sends the password and every record in plaintext; use --kafka-tls (or a SCRAM mechanism) outside a trusted network")
	}
	return w
}

// principal is the Kafka principal the flags authenticate as, for the
// relay's authorization warnings (router.Config.Principal): the SASL
// user, as Kafka's default principal builder names it; "" otherwise (a
// TLS client certificate's principal depends on the broker's
// ssl.principal.mapping.rules).
func (f KafkaFlags) principal() string {
	if f.KafkaSASLMechanism == "" || f.KafkaSASLUser == "" {
		return ""
	}
	return "User:" + f.KafkaSASLUser
}

// options turns the flags into franz-go client options.
func (f KafkaFlags) options() ([]kgo.Opt, error) {
	var opts []kgo.Opt
	if f.tlsEnabled() {
		cfg := &tls.Config{
			MinVersion:         tls.VersionTLS12,
			ServerName:         f.KafkaTLSServerName,
			InsecureSkipVerify: f.KafkaTLSInsecureSkipVerify,
		}
		if f.KafkaTLSCA != "" {
			pem, err := os.ReadFile(f.KafkaTLSCA)
			if err != nil {
				return nil, fmt.Errorf("--kafka-tls-ca: %w", err)
			}
			cfg.RootCAs = x509.NewCertPool()
			if !cfg.RootCAs.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("--kafka-tls-ca %s: no PEM certificate in it", f.KafkaTLSCA)
			}
		}
		if (f.KafkaTLSCert == "") != (f.KafkaTLSKey == "") {
			return nil, fmt.Errorf("--kafka-tls-cert and --kafka-tls-key go together")
		}
		if f.KafkaTLSCert != "" {
			cert, err := tls.LoadX509KeyPair(f.KafkaTLSCert, f.KafkaTLSKey)
			if err != nil {
				return nil, fmt.Errorf("--kafka-tls-cert/--kafka-tls-key: %w", err)
			}
			cfg.Certificates = []tls.Certificate{cert}
		}
		opts = append(opts, kgo.DialTLSConfig(cfg))
	}
	switch f.KafkaSASLMechanism {
	case "":
		if f.KafkaSASLUser != "" || f.KafkaSASLPassword != "" {
			return nil, fmt.Errorf("--kafka-sasl-user/--kafka-sasl-password need --kafka-sasl-mechanism")
		}
	case "plain":
		if !f.tlsEnabled() && !f.KafkaSASLAllowPlaintext {
			return nil, fmt.Errorf("--kafka-sasl-mechanism plain without TLS would send the SASL password in plaintext: add --kafka-tls (with --kafka-tls-ca for a private CA), use scram-sha-256/scram-sha-512, or on a trusted network only add --kafka-sasl-allow-plaintext")
		}
		opts = append(opts, kgo.SASL(plain.Auth{User: f.KafkaSASLUser, Pass: f.KafkaSASLPassword}.AsMechanism()))
	case "scram-sha-256":
		opts = append(opts, kgo.SASL(scram.Auth{User: f.KafkaSASLUser, Pass: f.KafkaSASLPassword}.AsSha256Mechanism()))
	case "scram-sha-512":
		opts = append(opts, kgo.SASL(scram.Auth{User: f.KafkaSASLUser, Pass: f.KafkaSASLPassword}.AsSha512Mechanism()))
	default:
		return nil, fmt.Errorf("--kafka-sasl-mechanism %q: want plain, scram-sha-256 or scram-sha-512", f.KafkaSASLMechanism)
	}
	if f.KafkaSASLMechanism != "" && f.KafkaSASLUser == "" {
		return nil, fmt.Errorf("--kafka-sasl-mechanism %s needs --kafka-sasl-user", f.KafkaSASLMechanism)
	}
	return opts, nil
}
