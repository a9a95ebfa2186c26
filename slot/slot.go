// Package slot owns the replication stream from a logical slot and the
// connections walrelay opens to PostgreSQL: the stream and its protocol
// (START_REPLICATION, receiving, standby status updates, the read path that
// bounds a message's size), connecting (connection strings, the default
// sslmode, redaction of passwords, the session settings every connection
// sets), the slot's row of pg_replication_slots (Info), and the refusals
// that end a stream for good: a reason not to start (*SetupError) and a
// gap in what the slot streamed (*GapError).
//
// Preparing the source for the stream (checks, publication, creating the
// slot, walrelay's record) is package source's; explaining what holds a
// slot and whether it is healthy is package doctor's.
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

// GapError is a refusal to go on after something walrelay streamed from
// changed under it (a slot that vanished in a failover, a publication
// dropped or altered, an outbox table recreated or taken out of the
// publication): PostgreSQL did not send, or will not send, events
// committed after Since. Restarting cannot fix it; only the operator can
// accept the gap.
type GapError struct {
	// What changed, in words.
	What string
	// Since is the last position walrelay knows it published everything
	// before: events committed after it may be missing.
	Since decoder.LSN
	// Fix is what the operator can do, beyond accepting the gap.
	Fix string
}

func (e *GapError) Error() string {
	var b strings.Builder
	b.WriteString(e.What)
	fmt.Fprintf(&b, ": events committed after %s may be missing from Kafka. walrelay never replaces what it streamed from on its own", e.Since)
	if e.Fix != "" {
		b.WriteString("; ")
		b.WriteString(e.Fix)
	}
	// The command, not source.SetupConfig.AcceptGap: accepting a gap is an
	// operator's decision, made once with walrelay setup whatever embeds
	// the library, never a setting a relay keeps (relay.Config has none).
	b.WriteString("; to go on without them, run walrelay setup --accept-gap with the same database, slot, publication and tables, then publish the rows still in the outbox tables with relay.PublishSnapshot")
	return b.String()
}

// Fatal is true: restarting cannot bring the missing events back.
func (e *GapError) Fatal() bool { return true }

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
