package topics

import (
	"context"
	"errors"
	"fmt"
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

// Prepare readies topic name: creates it when creation is on, then reads
// its limits (zero when it cannot: the configured limits apply). An error
// for which Rejects is true means Kafka will never accept the topic from
// this relay; any other may pass on a later attempt.
func (a *Admin) Prepare(ctx context.Context, name string) (Limits, error) {
	if a.create {
		_, err := a.adm.CreateTopic(ctx, a.partitions, a.replication, nil, name)
		if notAllowed(err) {
			// Not allowed to create: fine if an administrator did;
			// if the topic is missing (or hidden from us), its events
			// can never be produced.
			if exists, lerr := a.exists(ctx, name); lerr != nil {
				return Limits{}, lerr
			} else if !exists {
				return Limits{}, fmt.Errorf("topic does not exist and creating it was refused: %w", err)
			}
			err = nil
		}
		if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return Limits{}, err
		}
	}
	return a.limits(ctx, name), nil
}

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

// exists reports whether the broker lists topic name to this relay.
// A topic it may not describe is listed with an authorization error and
// counts as missing: the relay could not produce to it either.
func (a *Admin) exists(ctx context.Context, name string) (bool, error) {
	details, err := a.adm.ListTopics(ctx, name)
	if err != nil {
		return false, err
	}
	d, ok := details[name]
	if ok && d.Err != nil && !errors.Is(d.Err, kerr.UnknownTopicOrPartition) && !notAllowed(d.Err) {
		return false, d.Err
	}
	return ok && d.Err == nil, nil
}

// Rejects reports whether err, from Prepare, means Kafka will never accept
// the topic from this relay (an invalid name, a creation policy, no
// authorization to create or use it), so its events belong on the
// dead-letter topic rather than to a retry.
func Rejects(err error) bool {
	return errors.Is(err, kerr.InvalidTopicException) || RefusedForGood(err) || notAllowed(err)
}

// RefusedForGood reports an error, from Prepare or from producing, by
// which Kafka refuses a topic to this relay for good: not authorized, or
// against the cluster's policy. Events of such a topic are dead-lettered;
// retrying cannot help.
func RefusedForGood(err error) bool {
	return errors.Is(err, kerr.TopicAuthorizationFailed) || errors.Is(err, kerr.PolicyViolation)
}

// notAllowed reports an authorization failure: the topic may exist
// already (created by an administrator), and producing will tell.
func notAllowed(err error) bool {
	return errors.Is(err, kerr.TopicAuthorizationFailed) || errors.Is(err, kerr.ClusterAuthorizationFailed)
}
