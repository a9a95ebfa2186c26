package slot

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgconn"
)

// PasswordSource gives the password of each new PostgreSQL connection, for
// credentials that expire (RDS and Cloud SQL IAM tokens, Vault's dynamic
// passwords): asked at every connection, never cached here.
type PasswordSource interface {
	// Password is the password for user at host:port (the connection's
	// first host).
	Password(ctx context.Context, host string, port uint16, user string) (string, error)
	// String names where the password comes from, for errors and logs
	// (the configuration field that set it up).
	String() string
}

// sourceBox lets an atomic.Pointer hold an interface.
type sourceBox struct{ src PasswordSource }

var passwordSource atomic.Pointer[sourceBox]

// SetPasswordSource makes every connection opened from now on by Connect
// and with ReplicationConfig (every connection of walrelay's: replication,
// record, watch, snapshot, heartbeat, status) ask src for its password,
// in place of the URL's, PGPASSWORD's or the passfile's. It is
// process-wide, as PGPASSWORD is; nil turns it off.
func SetPasswordSource(src PasswordSource) {
	if src == nil {
		passwordSource.Store(nil)
		return
	}
	passwordSource.Store(&sourceBox{src})
}

// PasswordSourceError is a PasswordSource that failed to give a password.
type PasswordSourceError struct {
	Source string
	Err    error
}

func (e *PasswordSourceError) Error() string {
	return fmt.Sprintf("no PostgreSQL password from %s: %v", e.Source, e.Err)
}
func (e *PasswordSourceError) Unwrap() error { return e.Err }

// usePasswordSource makes cfg ask the password source, when one is set,
// once the connection is made (after TLS, before authentication), so the
// password is fresh at each connection and the source is not asked for a
// configuration that is never connected.
func usePasswordSource(cfg *pgconn.Config) {
	box := passwordSource.Load()
	if box == nil {
		return
	}
	prev := cfg.AfterNetConnect
	cfg.AfterNetConnect = func(ctx context.Context, c *pgconn.Config, conn net.Conn) (net.Conn, error) {
		if prev != nil {
			var err error
			if conn, err = prev(ctx, c, conn); err != nil {
				return conn, err
			}
		}
		pw, err := box.src.Password(ctx, c.Host, c.Port, c.User)
		if err != nil {
			// pgconn closes the connection it is given back.
			return conn, &PasswordSourceError{Source: box.src.String(), Err: err}
		}
		c.Password = pw
		return conn, nil
	}
}

// passwordSourceHint adds to a refused login where its password came from
// when a source gave it: the source is what to check, not the URL.
func passwordSourceHint(err error) error {
	box := passwordSource.Load()
	var pgErr *pgconn.PgError
	if box == nil || !errors.As(err, &pgErr) || (pgErr.Code != "28P01" && pgErr.Code != "28000") {
		return err
	}
	return fmt.Errorf("%w (the password came from %s)", err, box.src)
}
