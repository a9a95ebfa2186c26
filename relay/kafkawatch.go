package relay

// kafkawatch.go: whether Kafka holds delivery, as the relay sees it (the
// kafka condition of package holds). Run's loop says so as it retries:
// the brokers cannot be reached, refuse the credentials, or refused a
// record for good. The session's housekeeping says so when the brokers
// answer for nothing while events wait: a broker stopped with SIGSTOP, or
// a network that drops its packets, leaves every connection open and
// every request unanswered, and nothing fails for minutes (the producer
// retries forever), so only the silence tells. The hold ends at Kafka's
// next answer, or once nothing has waited on Kafka for kafkaSilentAfter.

import (
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/walrelay/walrelay/holds"
)

// kafkaSilentAfter is how long Kafka may answer for nothing while events
// wait before it holds delivery: longer than a leader election or a
// broker's garbage collection, far shorter than the producer's retries.
const kafkaSilentAfter = 10 * time.Second

// kafkaWatch reports the kafka condition. Its fields belong to the
// goroutine running Run's loop and its sessions.
type kafkaWatch struct {
	cond *holds.Condition
	// rt is the router last looked at, answered what it had answered
	// then, and since when it has answered nothing while events waited.
	rt       kafkaProgress
	answered uint64
	since    time.Time
	// idle is since when nothing has waited on Kafka (zero while events
	// are in flight).
	idle time.Time
}

// failed reports err, what Run's loop got from Kafka (a router it could
// not make, a record or transaction refused), as Kafka holding delivery.
// A denial is the authorizer's, which the router reports itself.
func (w *kafkaWatch) failed(err error) {
	if kafkaDenied(err) {
		return
	}
	reason := "Refused"
	switch {
	case errors.Is(err, kerr.SaslAuthenticationFailed), errors.Is(err, kerr.IllegalSaslState):
		reason = "AuthenticationFailed"
	case errors.Is(err, errKafkaUnreachable):
		reason = "Unreachable"
	}
	w.cond.Hold(reason, err.Error())
}

// errKafkaUnreachable marks a router that could not reach a broker.
var errKafkaUnreachable = errors.New("reach kafka brokers")

// kafkaProgress is what the watch reads of a router (*router.Router).
type kafkaProgress interface {
	Answered() uint64
	Inflight() int64
	// Preparing counts topic preparations under way: the first event
	// for a topic waits on one with nothing in flight.
	Preparing() int64
}

// look is the session's housekeeping's look at rt at now.
func (w *kafkaWatch) look(rt kafkaProgress, now time.Time) {
	if rt == nil {
		return
	}
	n, inflight, preparing := rt.Answered(), rt.Inflight(), rt.Preparing()
	answered := rt == w.rt && n != w.answered
	waiting := inflight > 0 || preparing > 0
	if rt != w.rt || answered || !waiting {
		w.rt, w.answered, w.since = rt, n, now
	}
	if waiting {
		w.idle = time.Time{}
	} else if w.idle.IsZero() {
		w.idle = now
	}
	switch {
	case answered:
		w.cond.Clear()
	case !waiting:
		if now.Sub(w.idle) >= kafkaSilentAfter {
			w.cond.Clear()
		}
	case now.Sub(w.since) >= kafkaSilentAfter:
		what := fmt.Sprintf("%d events in flight", inflight)
		if inflight == 0 {
			what = "events waiting for their topic's metadata"
		}
		w.cond.Hold("NotAcknowledging", fmt.Sprintf("%s and no answer from Kafka for %s: the brokers are stopped, frozen or cut off; delivery resumes by itself once they answer",
			what, now.Sub(w.since).Round(time.Second)))
	}
}

// pgHoldReason is the reason a session's end or a failed start, for cause,
// holds delivery on PostgreSQL; "" when it is not PostgreSQL's doing.
func pgHoldReason(cause RestartCause, err error) string {
	var connect *pgconn.ConnectError
	switch {
	case cause != CausePostgres && cause != CauseConnection && cause != CauseSilent && cause != CauseSetup:
		return ""
	case errors.As(err, &connect):
		return "Unreachable"
	case cause == CauseSilent:
		return "NotAnswering"
	case cause == CausePostgres:
		return "Error"
	case cause == CauseSetup:
		return "SetupFailed"
	}
	return "ConnectionLost"
}
