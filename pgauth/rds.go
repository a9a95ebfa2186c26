package pgauth

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/feature/rds/auth"
	"go.uber.org/zap"
)

// RDSIAM makes Amazon RDS and Aurora IAM authentication tokens (a SigV4
// presigned rds-db:connect request for the connection's host, port and
// user, valid 15 minutes) with credentials of the AWS default chain
// (environment, web identity for IRSA, EKS Pod Identity, shared config,
// instance profile): one at each connection. RDS accepts them over TLS
// only.
type RDSIAM struct {
	// Region of the database; empty: the one in an RDS host name
	// (….<region>.rds.amazonaws.com), else the AWS configuration's.
	Region string
	// Log receives the WARN of a failing source.
	Log *zap.Logger
	// Credentials, when set, replaces the default chain (tests).
	Credentials aws.CredentialsProvider

	warnOnce
	defaultRegion string
}

// Load reads the AWS configuration (no network call: credentials are had
// at the first connection).
func (r *RDSIAM) Load(ctx context.Context) error {
	if r.Credentials != nil {
		return nil
	}
	cfg, err := config.LoadDefaultConfig(ctx)
	if err != nil {
		return fmt.Errorf("the AWS configuration (environment, shared config files): %w", err)
	}
	r.Credentials, r.defaultRegion = cfg.Credentials, cfg.Region
	return nil
}

// Password makes a token for user at host:port.
func (r *RDSIAM) Password(ctx context.Context, host string, port uint16, user string) (string, error) {
	run := r.begin()
	tok, err := r.token(ctx, host, port, user)
	if err != nil {
		r.failed(run, r.Log, r, err)
		return "", err
	}
	r.succeeded(run, r.Log, r)
	return tok, nil
}

func (r *RDSIAM) token(ctx context.Context, host string, port uint16, user string) (string, error) {
	if r.Credentials == nil {
		return "", errors.New("pgauth.RDSIAM: Load was not called")
	}
	if strings.HasPrefix(host, "/") {
		return "", errors.New("RDS IAM tokens are for TCP connections, and the host is a Unix socket directory")
	}
	region := r.Region
	if region == "" {
		region = rdsRegion(host)
	}
	if region == "" {
		region = r.defaultRegion
	}
	if region == "" {
		return "", fmt.Errorf("no AWS region for %s: set pgauth.RDSIAM.Region (or AWS_REGION)", host)
	}
	tok, err := auth.BuildAuthToken(ctx, net.JoinHostPort(host, strconv.Itoa(int(port))), region, user, r.Credentials)
	if err != nil {
		return "", fmt.Errorf("an RDS IAM token for %s@%s: %w", user, host, err)
	}
	return tok, nil
}

// String names the source.
func (r *RDSIAM) String() string { return "pgauth.RDSIAM" }

// rdsRegion is the region in an RDS endpoint's host name
// (name.id.region.rds.amazonaws.com, and the China partition's
// ….rds.amazonaws.com.cn), or "".
func rdsRegion(host string) string {
	labels := strings.Split(strings.TrimSuffix(strings.ToLower(host), "."), ".")
	for i := len(labels) - 1; i > 0; i-- {
		if labels[i] == "rds" {
			return labels[i-1]
		}
	}
	return ""
}
