package integration

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/walrelay/walrelay/internal/devcluster"
)

// mskIAMServer answers the AWS_MSK_IAM exchange on a kfake broker as MSK
// does: the client's first message is a JSON map of a SigV4-presigned
// kafka-cluster:Connect request for the broker's host; the server checks
// it, here by signing the same request with the known credentials at the
// message's own time with the AWS SDK's signer (aws/signer/v4) and
// comparing the signatures, the scope and the time.
type mskIAMServer struct {
	host, region string
	creds        aws.Credentials

	mu       sync.Mutex
	accepted int
	refused  []string
}

func (s *mskIAMServer) install(k *devcluster.Kafka) {
	k.ControlKey(int16(kmsg.SASLHandshake), func(req kmsg.Request) (kmsg.Response, error, bool) {
		k.KeepControl()
		r := req.(*kmsg.SASLHandshakeRequest)
		resp := r.ResponseKind().(*kmsg.SASLHandshakeResponse)
		resp.SupportedMechanisms = []string{"AWS_MSK_IAM"}
		if r.Mechanism != "AWS_MSK_IAM" {
			resp.ErrorCode = kerr.UnsupportedSaslMechanism.Code
		}
		return resp, nil, true
	})
	k.ControlKey(int16(kmsg.SASLAuthenticate), func(req kmsg.Request) (kmsg.Response, error, bool) {
		k.KeepControl()
		r := req.(*kmsg.SASLAuthenticateRequest)
		resp := r.ResponseKind().(*kmsg.SASLAuthenticateResponse)
		s.mu.Lock()
		defer s.mu.Unlock()
		if err := s.check(r.SASLAuthBytes); err != nil {
			s.refused = append(s.refused, err.Error())
			resp.ErrorCode = kerr.SaslAuthenticationFailed.Code
			msg := "[test] access denied"
			resp.ErrorMessage = &msg
			return resp, nil, true
		}
		s.accepted++
		resp.SASLAuthBytes = []byte(`{"version":"2020_10_22","request-id":"test"}`)
		return resp, nil, true
	})
}

// check verifies one client-first message.
func (s *mskIAMServer) check(msg []byte) error {
	var m map[string]string
	if err := json.Unmarshal(msg, &m); err != nil {
		return fmt.Errorf("not JSON: %v", err)
	}
	if m["version"] != "2020_10_22" || m["action"] != "kafka-cluster:Connect" || m["host"] != s.host || m["x-amz-algorithm"] != "AWS4-HMAC-SHA256" || m["x-amz-signedheaders"] != "host" {
		return fmt.Errorf("fields %v", keys(m))
	}
	at, err := time.Parse("20060102T150405Z", m["x-amz-date"])
	if err != nil || time.Since(at).Abs() > 5*time.Minute {
		return fmt.Errorf("x-amz-date %q not within 5 minutes", m["x-amz-date"])
	}
	scope := fmt.Sprintf("%s/%s/%s/kafka-cluster/aws4_request", s.creds.AccessKeyID, at.Format("20060102"), s.region)
	if m["x-amz-credential"] != scope {
		return fmt.Errorf("credential scope %q, want %q", m["x-amz-credential"], scope)
	}
	if m["x-amz-security-token"] != s.creds.SessionToken {
		return fmt.Errorf("session token differs")
	}
	q := url.Values{"Action": {"kafka-cluster:Connect"}, "X-Amz-Expires": {m["x-amz-expires"]}}
	req, _ := http.NewRequest(http.MethodGet, "https://"+s.host+"/?"+strings.ReplaceAll(q.Encode(), "+", "%20"), nil)
	empty := sha256.Sum256(nil)
	signed, _, err := v4.NewSigner().PresignHTTP(context.Background(), s.creds, req, hex.EncodeToString(empty[:]), "kafka-cluster", s.region, at)
	if err != nil {
		return err
	}
	u, err := url.Parse(signed)
	if err != nil {
		return err
	}
	if want := u.Query().Get("X-Amz-Signature"); want == "" || m["x-amz-signature"] != want {
		return fmt.Errorf("signature does not verify")
	}
	return nil
}

func keys(m map[string]string) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

// TestMSKIAMSignature runs the relay binary with --kafka-sasl-mechanism
// aws-msk-iam over TLS against a kfake broker that checks each
// AWS_MSK_IAM message's SigV4 signature (mskIAMServer), the credentials
// given as the AWS default chain reads them from the environment and the
// region from --kafka-aws-region (127.0.0.1 names none): with the right
// credentials every authentication verifies and the relay delivers; with a
// wrong secret key the broker refuses and the relay exits 2 with one line
// naming the IAM refusal. Neither the secret key, the session token nor a
// signature appears in its output. (AWS itself cannot be reached here.)
func TestMSKIAMSignature(t *testing.T) {
	ca := newTestCA(t)
	srvCert, srvKey := ca.issue(t, "broker", 2)
	pair, err := tls.X509KeyPair(srvCert, srvKey)
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caFile, ca.pem, 0o600); err != nil {
		t.Fatal(err)
	}
	creds := aws.Credentials{AccessKeyID: "AKIAWALRELAYTEST", SecretAccessKey: "s3cret/Key+walrelay-Test-0123456789abcdef", SessionToken: "FwoGZXIvYXdzEJr-test-session-token"}
	awsEnv := func(secret string) []string {
		home := t.TempDir()
		return []string{"AWS_ACCESS_KEY_ID=" + creds.AccessKeyID, "AWS_SECRET_ACCESS_KEY=" + secret, "AWS_SESSION_TOKEN=" + creds.SessionToken,
			"AWS_REGION=", "AWS_DEFAULT_REGION=", "AWS_PROFILE=", "AWS_EC2_METADATA_DISABLED=true", "HOME=" + home,
			"AWS_CONFIG_FILE=" + filepath.Join(home, "none"), "AWS_SHARED_CREDENTIALS_FILE=" + filepath.Join(home, "none")}
	}
	for _, tc := range []struct {
		name   string
		secret string
		ok     bool
	}{{"right credentials", creds.SecretAccessKey, true}, {"wrong secret key", "wr0ng/Key+walrelay-Test-0123456789abcdef", false}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			k, err := devcluster.StartKafka(devcluster.KafkaOptions{Extra: []kfake.Opt{kfake.TLS(&tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12})}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(k.Close)
			srv := &mskIAMServer{host: "127.0.0.1", region: "eu-central-1", creds: creds}
			srv.install(k)
			e.brokers = []string{k.Addr()}
			args := append(e.args(), "--kafka-tls-ca", caFile, "--kafka-sasl-mechanism", "aws-msk-iam", "--kafka-aws-region", "eu-central-1", "--startup-timeout", "30s")
			p := startProc(t, awsEnv(tc.secret), args...)
			if !tc.ok {
				code, elapsed, exited := p.wait(60 * time.Second)
				last := lastLines(p.out.String(), 1)
				t.Logf("exit %d after %s: %s", code, elapsed.Round(time.Millisecond), last)
				if !exited || code != 2 || !strings.Contains(last, "SASL_AUTHENTICATION_FAILED") || !strings.Contains(last, "kafka-cluster:Connect") {
					t.Errorf("exit %d (by itself: %v), last line %s; want 2 naming the refused IAM signature", code, exited, last)
				}
			} else {
				e.waitSlotActive(p)
				e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('iam', 'k', 'T', '{"iam": true}')`)
				pool := x509.NewCertPool()
				pool.AppendCertsFromPEM(ca.pem)
				cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.ConsumeTopics(e.topic("iam")), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
					kgo.DialTLSConfig(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}))
				if err != nil {
					t.Fatal(err)
				}
				defer cl.Close()
				e.waitFor("the event", 60*time.Second, func() (bool, error) {
					ctx, cancel := context.WithTimeout(e.ctx, time.Second)
					defer cancel()
					got := ""
					cl.PollRecords(ctx, 10).EachRecord(func(r *kgo.Record) { got = string(r.Value) })
					return got == `{"iam": true}`, nil
				})
				checkRunning(t, p, "the relay")
			}
			srv.mu.Lock()
			accepted, refused := srv.accepted, srv.refused
			srv.mu.Unlock()
			t.Logf("%d authentications verified, %d refused", accepted, len(refused))
			if tc.ok && (accepted == 0 || len(refused) > 0) {
				t.Errorf("%d verified, refused: %q", accepted, refused)
			}
			if !tc.ok && (accepted > 0 || len(refused) == 0 || !strings.Contains(refused[0], "signature does not verify")) {
				t.Errorf("wrong secret: %d verified, refused %q", accepted, refused)
			}
			out := p.out.String()
			for _, secret := range []string{tc.secret, creds.SessionToken, "X-Amz-Signature", "x-amz-signature"} {
				if strings.Contains(out, secret) {
					t.Errorf("the output holds %q", secret)
				}
			}
		})
	}
}
