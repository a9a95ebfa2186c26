package kafkaauth

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/twmb/franz-go/pkg/sasl"
	awssasl "github.com/twmb/franz-go/pkg/sasl/aws"
	"go.uber.org/zap"
)

// MSKIAM configures SASL AWS_MSK_IAM, Amazon MSK's IAM access control: each
// authentication is a SigV4-signed kafka-cluster:Connect request made with
// credentials of the AWS default chain (environment, web identity for
// IRSA, EKS Pod Identity, shared config and SSO, ECS and instance
// profiles), which the SDK refreshes before they expire.
type MSKIAM struct {
	// Region signs for brokers whose host name does not carry one (a
	// private DNS name); a host name of MSK's (…kafka.<region>.amazonaws.com)
	// is signed for its own region, which the cluster checks.
	Region string
	// UserAgent is sent with each signature (IAM policies may condition on
	// aws:UserAgent); empty: walrelay's.
	UserAgent string
	// Credentials, when set, replaces the default chain (tests).
	Credentials aws.CredentialsProvider
}

// Mechanism is the AWS_MSK_IAM mechanism. Credentials are had at each
// authentication (the SDK caches them until shortly before they expire);
// a chain that yields none is logged at WARN once until it yields again,
// naming the chain, and returned as an error.
func (m MSKIAM) Mechanism(ctx context.Context, log *zap.Logger) (sasl.Mechanism, error) {
	creds := m.Credentials
	if creds == nil {
		var opts []func(*config.LoadOptions) error
		if m.Region != "" {
			opts = append(opts, config.WithRegion(m.Region))
		}
		cfg, err := config.LoadDefaultConfig(ctx, opts...)
		if err != nil {
			return nil, fmt.Errorf("kafka SASL AWS_MSK_IAM: the AWS configuration (environment, shared config files): %w", err)
		}
		creds = cfg.Credentials
		if m.Region == "" {
			m.Region = cfg.Region
		}
	}
	if m.Region != "" && os.Getenv("AWS_REGION") == "" {
		// franz-go's signer takes the region from the broker's host name,
		// and else from AWS_REGION only.
		if err := os.Setenv("AWS_REGION", m.Region); err != nil {
			return nil, err
		}
	}
	ua := m.UserAgent
	if ua == "" {
		ua = "walrelay"
	}
	var mu sync.Mutex
	failing := false
	return awssasl.ManagedStreamingIAM(func(ctx context.Context) (awssasl.Auth, error) {
		c, err := creds.Retrieve(ctx)
		mu.Lock()
		defer mu.Unlock()
		if err == nil && (c.AccessKeyID == "" || c.SecretAccessKey == "") {
			err = errors.New("they hold no access key")
		}
		if err != nil {
			err = fmt.Errorf("kafka SASL AWS_MSK_IAM: no AWS credentials from the default chain (environment, web identity, EKS Pod Identity, shared config, instance profile): %w", err)
			if !failing {
				failing = true
				log.Warn("kafka AWS_MSK_IAM credentials unavailable: Kafka connections wait for them", zap.Error(err))
			}
			return awssasl.Auth{}, &SourceError{err}
		}
		if failing {
			failing = false
			log.Info("kafka AWS_MSK_IAM credentials available again", zap.String("source", c.Source))
		}
		return awssasl.Auth{AccessKey: c.AccessKeyID, SecretKey: c.SecretAccessKey, SessionToken: c.SessionToken, UserAgent: ua}, nil
	}), nil
}
