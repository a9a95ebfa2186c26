package topics

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"go.uber.org/zap"
)

// Admin prepares topics for producing: creates them when topic creation
// is on and reads the size of the largest record each accepts.
type Admin struct {
	adm         *kadm.Client
	create      bool
	partitions  int32
	replication int16
	log         *zap.Logger
}

// NewAdmin returns an Admin asking through adm. With create set, Prepare
// creates missing topics with partitions and replication (-1: the broker's
// default).
func NewAdmin(adm *kadm.Client, create bool, partitions int32, replication int16, log *zap.Logger) *Admin {
	return &Admin{adm: adm, create: create, partitions: partitions, replication: replication, log: log}
}

// Limits is what a topic's configuration says about the records it
// accepts. The zero value means nothing is known: the configured limits
// apply.
type Limits struct {
	// MaxBytes is max.message.bytes; 0: unknown.
	MaxBytes int
	// TimestampBefore and TimestampAfter are how far a record's timestamp
	// may lie behind or ahead of the broker's clock
	// (message.timestamp.before.max.ms, message.timestamp.after.max.ms and
	// the older message.timestamp.difference.max.ms, the least of them);
	// 0: no bound, or the broker sets the timestamp itself
	// (message.timestamp.type LogAppendTime).
	TimestampBefore, TimestampAfter time.Duration
}

// unbounded is the value from which a duration setting counts as no bound:
// Kafka's default for the timestamp bounds is Long.MAX_VALUE.
const unbounded = int64(1) << 53

// Prepare readies topic name: creates it when creation is on, checks that
// the relay may write to it, then reads its limits (zero when it cannot:
// the configured limits apply). An error for which Rejects is true means
// Kafka will never accept the topic from this relay; a *Denial means
// Kafka's authorizer denies the relay an operation on it, which an ACL
// can change at any time; any other may pass on a later attempt.
func (a *Admin) Prepare(ctx context.Context, name string) (Limits, error) {
	var createDenied error
	if a.create {
		_, err := a.adm.CreateTopic(ctx, a.partitions, a.replication, nil, name)
		switch {
		case err == nil, errors.Is(err, kerr.TopicAlreadyExists):
		case notAllowed(err):
			// Not allowed to create: fine if an administrator did, as
			// the topic's metadata tells.
			createDenied = err
		default:
			return Limits{}, err
		}
	}
	if err := a.writable(ctx, name, createDenied); err != nil {
		return Limits{}, err
	}
	return a.limits(ctx, name), nil
}

// writable asks the broker for the topic's metadata with the operations
// the relay's principal may do on it: a topic it may not describe, or
// whose operations lack WRITE, is a Denial; a topic that does not exist
// when creating it was denied (createDenied) is rejected for good. A
// broker that does not report the operations (before Kafka 2.3) passes:
// a produce will tell.
func (a *Admin) writable(ctx context.Context, name string, createDenied error) error {
	details, err := a.adm.ListTopics(kadm.WithAuthorizedOps(ctx), name)
	d, ok := details[name]
	switch {
	case notAllowed(err):
		// kadm returns a topic's authorization error for the whole
		// request.
		d, ok = kadm.TopicDetail{Topic: name, Err: err}, true
	case err != nil:
		return err
	}
	switch {
	case !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition):
		if createDenied != nil {
			// Visible as missing, with DESCRIBE allowed: its events
			// could never be produced, and an aggregate type nobody
			// made a topic for is the events' matter.
			return fmt.Errorf("%w: %w", errMissing, createDenied)
		}
		return nil // without creation: the produce says to create it
	case notAllowed(d.Err):
		// Kafka answers so whether or not the topic exists: it does not
		// tell a principal that may not describe it.
		return &Denial{Op: "DESCRIBE", Err: d.Err}
	case d.Err != nil:
		return d.Err
	case len(d.AuthorizedOperations) > 0 && !slices.Contains(d.AuthorizedOperations, kadm.OpWrite):
		// A principal that may describe the topic is told its
		// operations (DESCRIBE among them, so the list is not empty).
		return &Denial{Op: "WRITE", Err: fmt.Errorf("the topic's authorized operations lack WRITE: %w", kerr.TopicAuthorizationFailed)}
	}
	return nil
}

// errMissing: the topic does not exist and the relay may not create it.
var errMissing = errors.New("topic does not exist and creating it was refused")

// Denial is Kafka's authorizer denying the relay's principal an operation
// on a topic (Prepare): an ACL an operator can grant at any time, not a
// property of the topic's events.
type Denial struct {
	Op  string // the ACL operation denied: DESCRIBE or WRITE
	Err error  // Kafka's answer
}

func (d *Denial) Error() string { return d.Op + " denied: " + d.Err.Error() }
func (d *Denial) Unwrap() error { return d.Err }

// limits reads the topic's configuration; zero when it cannot (not
// authorized, topic missing, an old broker): the configured limits apply.
func (a *Admin) limits(ctx context.Context, name string) Limits {
	rcs, err := a.adm.DescribeTopicConfigs(ctx, name)
	if err != nil {
		a.log.Debug("cannot read topic config; using router.Config.MaxRecordBytes", zap.String("topic", name), zap.Error(err))
		return Limits{}
	}
	var l Limits
	for _, rc := range rcs {
		if rc.Err != nil {
			a.log.Debug("cannot read topic config; using router.Config.MaxRecordBytes", zap.String("topic", name), zap.Error(rc.Err))
			return Limits{}
		}
		values := map[string]string{}
		for _, c := range rc.Configs {
			if c.Value != nil {
				values[c.Key] = *c.Value
			}
		}
		l = limitsOf(values)
	}
	return l
}

// limitsOf reads Limits from a topic's configuration values.
func limitsOf(values map[string]string) Limits {
	var l Limits
	l.MaxBytes, _ = strconv.Atoi(values["max.message.bytes"])
	if values["message.timestamp.type"] == "LogAppendTime" {
		return l // the broker stamps records itself and checks none
	}
	bound := func(keys ...string) time.Duration {
		var least time.Duration
		for _, k := range keys {
			ms, err := strconv.ParseInt(values[k], 10, 64)
			if err != nil || ms < 0 || ms >= unbounded {
				continue
			}
			if d := max(time.Duration(ms)*time.Millisecond, time.Millisecond); least == 0 || d < least {
				least = d
			}
		}
		return least
	}
	l.TimestampBefore = bound("message.timestamp.before.max.ms", "message.timestamp.difference.max.ms")
	l.TimestampAfter = bound("message.timestamp.after.max.ms", "message.timestamp.difference.max.ms")
	return l
}

// Rejects reports whether err, from Prepare, means Kafka will never accept
// the topic from this relay (an invalid name, a creation policy, a topic
// that does not exist and that the relay may not create), so its events
// belong on the dead-letter topic rather than to a retry. A Denial is not
// one: an ACL can change.
func Rejects(err error) bool {
	return errors.Is(err, kerr.InvalidTopicException) || errors.Is(err, errMissing) || RefusedForGood(err)
}

// RefusedForGood reports an error, from Prepare or from producing, by
// which Kafka refuses a topic for good whoever asks: the cluster's
// creation policy. Events of such a topic are dead-lettered; retrying
// cannot help. An authorization failure is not one (see Denial).
func RefusedForGood(err error) bool {
	return errors.Is(err, kerr.PolicyViolation)
}

// notAllowed reports an authorization failure: the topic may exist
// already (created by an administrator), and its metadata will tell.
func notAllowed(err error) bool {
	return errors.Is(err, kerr.TopicAuthorizationFailed) || errors.Is(err, kerr.ClusterAuthorizationFailed)
}
