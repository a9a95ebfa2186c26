package main

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/walrelay/walrelay/pgauth"
	"github.com/walrelay/walrelay/slot"
)

// PGAuthFlags get the PostgreSQL password at each connection, for
// credentials that expire. Every command that connects to PostgreSQL has
// them.
type PGAuthFlags struct {
	PGPasswordCommand string `name:"pg-password-command" placeholder:"COMMAND" help:"Run COMMAND (split into words like a shell's, no shell: no pipes nor variables) at each PostgreSQL connection walrelay opens and use its standard output, less the final line break, as the password (Vault, a cloud CLI: gcloud sql generate-login-token, az account get-access-token …). It gets PGHOST, PGPORT and PGUSER; its output is never logged, nor its standard error. A failure is logged at WARN once and the connection retried with backoff."`
	PGAWSIAM          bool   `name:"pg-aws-iam" help:"Amazon RDS/Aurora IAM authentication: a token (valid 15 minutes) made at each PostgreSQL connection with AWS credentials of the default chain (environment, web identity for IRSA, EKS Pod Identity, instance profile) for the --pg-url user and host. Needs TLS (sslmode=verify-full with the RDS CA bundle as sslrootcert)."`
	PGAWSRegion       string `name:"pg-aws-region" help:"--pg-aws-iam: the database's AWS region; default: the one in an RDS host name, else the AWS configuration's (AWS_REGION)."`
}

// install makes every PostgreSQL connection of this process take its
// password from the source the flags choose (none: the URL, PGPASSWORD or
// the passfile, as before).
func (f PGAuthFlags) install(ctx context.Context, log *zap.Logger) error {
	var src slot.PasswordSource
	switch {
	case f.PGPasswordCommand != "" && f.PGAWSIAM:
		return usageError(errors.New("--pg-password-command and --pg-aws-iam are two sources of the PostgreSQL password: give one"))
	case f.PGAWSRegion != "" && !f.PGAWSIAM:
		return usageError(errors.New("--pg-aws-region goes with --pg-aws-iam"))
	case f.PGPasswordCommand != "":
		argv, err := pgauth.SplitArgs(f.PGPasswordCommand)
		if err != nil || len(argv) == 0 {
			return usageError(fmt.Errorf("--pg-password-command does not split into a program and its arguments (%v)", err))
		}
		src = &pgauth.Command{Argv: argv, Log: log}
	case f.PGAWSIAM:
		r := &pgauth.RDSIAM{Region: f.PGAWSRegion, Log: log}
		if err := r.Load(ctx); err != nil {
			return &exitError{code: exitFailed, err: fmt.Errorf("--pg-aws-iam: %w", err)}
		}
		src = r
	}
	slot.SetPasswordSource(src)
	return nil
}
