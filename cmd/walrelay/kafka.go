package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/kafkaauth"
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
	KafkaSASLMechanism         string `name:"kafka-sasl-mechanism" enum:",plain,scram-sha-256,scram-sha-512,oauthbearer,aws-msk-iam" default:"" help:"SASL mechanism: plain, scram-sha-256, scram-sha-512 (with --kafka-sasl-user), oauthbearer (with the --kafka-oauth-* flags) or aws-msk-iam (Amazon MSK IAM, AWS credentials from the default chain); empty for none."`
	KafkaSASLUser              string `name:"kafka-sasl-user" help:"SASL user name."`
	KafkaSASLPassword          string `name:"kafka-sasl-password" help:"SASL password; prefer the WALRELAY_KAFKA_SASL_PASSWORD environment variable to keep it out of process listings. Never logged."`
	KafkaSASLAllowPlaintext    bool   `name:"kafka-sasl-allow-plaintext" help:"Allow --kafka-sasl-mechanism plain without TLS, which sends the password readable to anyone on the network path; only for a trusted network."`

	KafkaOAuthTokenURL         string   `name:"kafka-oauth-token-url" placeholder:"URL" help:"oauthbearer: the OIDC token endpoint walrelay gets tokens from by the client-credentials grant, with --kafka-oauth-client-id and its secret; a new token once 80% of the current one's lifetime passed, whether or not Kafka asks for one."`
	KafkaOAuthClientID         string   `name:"kafka-oauth-client-id" help:"oauthbearer: the client id at --kafka-oauth-token-url."`
	KafkaOAuthClientSecret     string   `name:"kafka-oauth-client-secret" help:"oauthbearer: the client secret; give it as the WALRELAY_KAFKA_OAUTH_CLIENT_SECRET environment variable or in --kafka-oauth-client-secret-file, not as an argument. Never logged."`
	KafkaOAuthClientSecretFile string   `name:"kafka-oauth-client-secret-file" type:"existingfile" placeholder:"FILE" help:"oauthbearer: file holding the client secret (a mounted Kubernetes secret), read again at every request to the token endpoint, so a rotated secret needs no restart."`
	KafkaOAuthScope            []string `name:"kafka-oauth-scope" help:"oauthbearer: scope to ask the token endpoint for; repeat the flag (or separate with commas) for several."`
	KafkaOAuthAudience         string   `name:"kafka-oauth-audience" help:"oauthbearer: audience to ask the token endpoint for (its audience parameter); the broker checks the token's (sasl.oauthbearer.expected.audience)."`
	KafkaOAuthExtension        []string `name:"kafka-oauth-extension" placeholder:"KEY=VALUE" help:"oauthbearer: SASL extension sent with the token (Confluent Cloud: logicalCluster=lkc-…, identityPoolId=pool-…); repeatable."`
	KafkaOAuthTokenFile        string   `name:"kafka-oauth-token-file" placeholder:"FILE" help:"oauthbearer: file holding the token, read again once 80% of the current token's lifetime passed (at every authentication when it carries no expiry), instead of --kafka-oauth-token-url: a Kubernetes projected service-account token or what a workload-identity agent writes and rotates."`
	KafkaAWSRegion             string   `name:"kafka-aws-region" help:"aws-msk-iam: the AWS region to sign for when the brokers' host names do not carry one (a private DNS name); MSK's own host names are signed for their region. Default: the AWS configuration's (AWS_REGION)."`
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

// options turns the flags into franz-go client options. log receives what
// the credential sources say while the client runs (a token not refreshed,
// a rotated certificate that does not load), and board when the token
// source holds delivery (nil: nowhere); ctx bounds the credential
// sources' background work (the OAUTHBEARER token refresher).
func (f KafkaFlags) options(ctx context.Context, log *zap.Logger, board *holds.Board) ([]kgo.Opt, error) {
	var opts []kgo.Opt
	if f.tlsEnabled() {
		cfg, err := kafkaauth.TLSFiles{
			CA: f.KafkaTLSCA, Cert: f.KafkaTLSCert, Key: f.KafkaTLSKey,
			ServerName: f.KafkaTLSServerName, InsecureSkipVerify: f.KafkaTLSInsecureSkipVerify,
		}.Config(log.Named("kafka"))
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.DialTLSConfig(cfg))
	}
	if f.KafkaSASLMechanism != "oauthbearer" && f.oauthSet() {
		return nil, fmt.Errorf("--kafka-oauth-* flags need --kafka-sasl-mechanism oauthbearer")
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
	case "oauthbearer":
		mech, err := f.oauth(ctx, log, board)
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.SASL(mech))
	case "aws-msk-iam":
		if !f.tlsEnabled() {
			return nil, fmt.Errorf("--kafka-sasl-mechanism aws-msk-iam needs --kafka-tls: MSK's IAM listeners speak TLS only")
		}
		mech, err := kafkaauth.MSKIAM{Region: f.KafkaAWSRegion}.Mechanism(context.Background(), log.Named("kafka"))
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.SASL(mech))
	default:
		return nil, fmt.Errorf("--kafka-sasl-mechanism %q: want plain, scram-sha-256, scram-sha-512, oauthbearer or aws-msk-iam", f.KafkaSASLMechanism)
	}
	switch f.KafkaSASLMechanism {
	case "plain", "scram-sha-256", "scram-sha-512":
		if f.KafkaSASLUser == "" {
			return nil, fmt.Errorf("--kafka-sasl-mechanism %s needs --kafka-sasl-user", f.KafkaSASLMechanism)
		}
	case "oauthbearer", "aws-msk-iam":
		if f.KafkaSASLUser != "" || f.KafkaSASLPassword != "" {
			return nil, fmt.Errorf("--kafka-sasl-mechanism %s takes no --kafka-sasl-user/--kafka-sasl-password", f.KafkaSASLMechanism)
		}
	}
	return opts, nil
}

// oauthSet reports whether any --kafka-oauth-* flag is set.
func (f KafkaFlags) oauthSet() bool {
	return f.KafkaOAuthTokenURL != "" || f.KafkaOAuthClientID != "" || f.KafkaOAuthClientSecret != "" || f.KafkaOAuthClientSecretFile != "" ||
		len(f.KafkaOAuthScope) > 0 || f.KafkaOAuthAudience != "" || len(f.KafkaOAuthExtension) > 0 || f.KafkaOAuthTokenFile != ""
}

// oauth is the OAUTHBEARER mechanism of the --kafka-oauth-* flags; its
// token source reports into board's token_source condition.
func (f KafkaFlags) oauth(ctx context.Context, log *zap.Logger, board *holds.Board) (sasl.Mechanism, error) {
	o := kafkaauth.OAuth{
		TokenURL: f.KafkaOAuthTokenURL, ClientID: f.KafkaOAuthClientID, ClientSecret: f.KafkaOAuthClientSecret,
		ClientSecretFile: f.KafkaOAuthClientSecretFile,
		Scopes:           f.KafkaOAuthScope, Audience: f.KafkaOAuthAudience, TokenFile: f.KafkaOAuthTokenFile,
	}
	if board != nil {
		o.Holds = board.Condition(holds.TokenSource)
	}
	if f.KafkaOAuthClientSecretFile != "" && f.KafkaOAuthClientSecret != "" {
		return nil, fmt.Errorf("--kafka-oauth-client-secret and --kafka-oauth-client-secret-file: give one")
	}
	for _, kv := range f.KafkaOAuthExtension {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--kafka-oauth-extension %q: want KEY=VALUE", kv)
		}
		if o.Extensions == nil {
			o.Extensions = map[string]string{}
		}
		o.Extensions[k] = v
	}
	return o.Mechanism(ctx, log.Named("kafka"))
}

// explain adds to a Kafka error that stopped the relay what to check for
// the mechanism in use: some brokers close the connection instead of
// answering a failed authentication, and a refused OAUTHBEARER token says
// nothing of why (the broker logs it).
func (f KafkaFlags) explain(err error) error {
	switch {
	case f.KafkaSASLMechanism == "oauthbearer" && errors.Is(err, kerr.SaslAuthenticationFailed):
		return fmt.Errorf("%w (the broker refused the OAUTHBEARER token: check that --kafka-oauth-audience, --kafka-oauth-scope and the token's issuer are what the broker expects: its sasl.oauthbearer.expected.audience and sasl.oauthbearer.expected.issuer; its log names the claim)", err)
	case f.KafkaSASLMechanism != "" && errors.Is(err, kerr.IllegalSaslState):
		return fmt.Errorf("%w (Kafka authentication: the broker refused a SASL exchange in the connection's state, usually a re-authentication begun just after another; its log names the connection)", err)
	case f.KafkaSASLMechanism == "aws-msk-iam" && errors.Is(err, kerr.SaslAuthenticationFailed):
		return fmt.Errorf("%w (the cluster refused the IAM signature: check that the AWS identity's policy allows kafka-cluster:Connect on the cluster, and --kafka-aws-region)", err)
	case f.KafkaSASLMechanism != "" && closedByBroker(err):
		return fmt.Errorf("%w (the broker closed the connection: check the --kafka-sasl-* credentials and mechanism)", err)
	}
	return err
}
