// Package slot owns walrelay's side of PostgreSQL logical replication: the
// checks that must pass before streaming (wal_level, privileges, tables and
// columns, publication, slot), creating the publication and slot, the
// replication stream itself (START_REPLICATION, receiving, standby status
// updates) and slot figures from pg_replication_slots.
//
// The stream is owned by one goroutine; it never blocks on anything but the
// socket, and its reads have deadlines so the owner can keep sending status
// updates while Kafka is slow.
package slot

import (
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/walrelay/walrelay/decoder"
)

// ParseTable parses "schema.table" or "table" (schema public). Names are
// taken literally (case-sensitive, as PostgreSQL stores them).
func ParseTable(s string) (decoder.Table, error) {
	schema, name, ok := strings.Cut(s, ".")
	if !ok {
		schema, name = "public", s
	}
	if schema == "" || name == "" || strings.Contains(name, ".") {
		return decoder.Table{}, fmt.Errorf("table %q: want schema.table or table", s)
	}
	return decoder.Table{Schema: schema, Name: name}, nil
}

var slotNameRE = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// ValidSlotName reports why PostgreSQL would refuse name as a slot name.
func ValidSlotName(name string) error {
	if !slotNameRE.MatchString(name) {
		return fmt.Errorf("slot name %q: PostgreSQL allows 1 to 63 characters from [a-z0-9_]", name)
	}
	return nil
}

// SetupError is a reason not to start, worded to name the fix.
type SetupError struct{ Msg string }

func (e *SetupError) Error() string { return e.Msg }

// Fatal is true: retrying does not fix a setup refusal.
func (e *SetupError) Fatal() bool { return true }

func setupErrorf(format string, args ...any) error {
	return &SetupError{Msg: fmt.Sprintf(format, args...)}
}

// IsSetupError reports whether err is a reason not to start that retrying
// will not fix.
func IsSetupError(err error) bool {
	var se *SetupError
	return errors.As(err, &se)
}

// redactedError is an error whose message had the password taken out. It
// still unwraps to the original, so that callers can tell what kind of
// failure it was (errors.As a certificate error, a *pgconn.PgError); only
// its message is what gets printed.
type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }
