package topics

import (
	"context"
	"errors"
	"fmt"
	"strconv"

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

// Prepare readies topic name: creates it when creation is on, then reads
// its max.message.bytes (0: unknown, the configured limit applies). An
// error for which Rejects is true means Kafka will never accept the topic
// from this relay; any other may pass on a later attempt.
func (a *Admin) Prepare(ctx context.Context, name string) (maxBytes int, err error) {
	if a.create {
		_, err := a.adm.CreateTopic(ctx, a.partitions, a.replication, nil, name)
		if notAllowed(err) {
			// Not allowed to create: fine if an administrator did;
			// if the topic is missing (or hidden from us), its events
			// can never be produced.
			if exists, lerr := a.exists(ctx, name); lerr != nil {
				return 0, lerr
			} else if !exists {
				return 0, fmt.Errorf("topic does not exist and creating it was refused: %w", err)
			}
			err = nil
		}
		if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return 0, err
		}
	}
	return a.limit(ctx, name), nil
}

// limit reads the topic's max.message.bytes; 0 when it cannot (not
// authorized, topic missing, an old broker): the configured limit applies.
func (a *Admin) limit(ctx context.Context, name string) int {
	rcs, err := a.adm.DescribeTopicConfigs(ctx, name)
	if err != nil {
		a.log.Debug("cannot read topic config; using --max-record-bytes", zap.String("topic", name), zap.Error(err))
		return 0
	}
	for _, rc := range rcs {
		if rc.Err != nil {
			a.log.Debug("cannot read topic config; using --max-record-bytes", zap.String("topic", name), zap.Error(rc.Err))
			return 0
		}
		for _, c := range rc.Configs {
			if c.Key == "max.message.bytes" && c.Value != nil {
				n, _ := strconv.Atoi(*c.Value)
				return n
			}
		}
	}
	return 0
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
