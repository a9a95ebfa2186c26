package main

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/schema"
)

// ValueFlags frame record values in a schema registry's wire format
// (package schema), per topic or event type.
type ValueFlags struct {
	ValueFormat            []string      `placeholder:"[[type:]NAME=]FORMAT[@VERSION]" help:"Record value format: asis (the payload unchanged), json (validated against the subject's JSON Schema), avro (the payload's JSON converted to the subject's Avro schema) or protobuf (the payload read as the proto3 JSON of the subject's message), each framed in the registry's wire format (magic byte, schema id; Protobuf's message indexes), from the subject's latest version or @VERSION. Bare, for every topic; TOPIC=FORMAT for one topic; type:TYPE=FORMAT for one event type (wins over the topic's). Repeatable. A payload that does not match is dead-lettered (schema_mismatch); while the registry does not answer, delivery waits."`
	SchemaRegistryURL      []string      `name:"schema-registry-url" placeholder:"URL" help:"Schema registry base URL speaking Confluent's REST API (Apicurio Registry 3: http://host:8080/apis/ccompat/v7); repeat the flag, or separate with commas, for several."`
	SchemaRegistryUser     string        `name:"schema-registry-user" help:"Schema registry user (HTTP basic auth)."`
	SchemaRegistryPassword string        `name:"schema-registry-password" help:"Schema registry password; prefer the WALRELAY_SCHEMA_REGISTRY_PASSWORD environment variable to keep it out of process listings. Never logged."`
	SchemaRegistryCA       string        `name:"schema-registry-ca" type:"existingfile" placeholder:"FILE" help:"PEM file of the CA(s) that signed an https registry's certificate (default: the system roots)."`
	SubjectStrategy        string        `default:"${subject_strategy}" enum:"topic,record,topic-record" help:"Subject of an event's schema: topic (<topic>-value), record (the event type, the schema's full record name) or topic-record (<topic>-<event type>)."`
	SchemaRefresh          time.Duration `default:"${schema_refresh}" help:"How often a subject's latest version is read again (the schema in hand serves meanwhile, and while the registry does not answer). A payload the schema in hand refuses, or a subject the registry lacked, is checked against the latest version read anew (at most once a second per subject) before it is dead-lettered; a pinned version is asked about again after --schema-refresh."`
}

// parseValueFormats turns --value-format values into schema rules: the
// default and the rules by topic and by event type.
func parseValueFormats(vals []string, c *schema.Config) error {
	for _, v := range vals {
		for _, item := range strings.Split(v, ",") {
			item = strings.TrimSpace(item)
			if item == "" {
				continue
			}
			name, format, named := strings.Cut(item, "=")
			if !named {
				format = name
			}
			r, err := schema.ParseRule(format)
			if err != nil {
				return fmt.Errorf("--value-format %q: %w", item, err)
			}
			switch typ, isType := strings.CutPrefix(name, "type:"); {
			case !named:
				c.Default = r
			case isType && typ != "":
				if c.Types == nil {
					c.Types = map[string]schema.Rule{}
				}
				c.Types[typ] = r
			case !isType && name != "":
				if c.Topics == nil {
					c.Topics = map[string]schema.Rule{}
				}
				c.Topics[name] = r
			default:
				return fmt.Errorf("--value-format %q: want FORMAT, TOPIC=FORMAT or type:TYPE=FORMAT", item)
			}
		}
	}
	return nil
}

func (f ValueFlags) apply(cfg *relay.Config) error {
	c := &cfg.Values
	if err := parseValueFormats(f.ValueFormat, c); err != nil {
		return err
	}
	for _, u := range f.SchemaRegistryURL {
		for _, s := range strings.Split(u, ",") {
			if s = strings.TrimSpace(s); s != "" {
				c.URLs = append(c.URLs, s)
			}
		}
	}
	c.User, c.Password = f.SchemaRegistryUser, f.SchemaRegistryPassword
	c.Strategy, c.Refresh = schema.Strategy(f.SubjectStrategy), f.SchemaRefresh
	if f.SchemaRegistryCA != "" {
		pem, err := os.ReadFile(f.SchemaRegistryCA)
		if err != nil {
			return fmt.Errorf("--schema-registry-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("--schema-registry-ca %s: no PEM certificate in it", f.SchemaRegistryCA)
		}
		c.TLS = &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool}
	}
	return c.Validate()
}
