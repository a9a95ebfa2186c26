// Package checkpointtopic is the Kafka topic of exactly-once checkpoints:
// preparing it (compacted, one partition) and reading the newest committed
// checkpoint of a key from it.
//
// The records themselves are written by the relay's transactional producer,
// one in each Kafka transaction (see checkpoint.Durable for their format).
// Reading relies on the order of the single partition: a reader first
// commits a probe record of its own (Probe gives its key and value), then
// reads read_committed from the start up to the probe. Every checkpoint
// committed before the probe has then been seen, whatever transaction
// markers or aborted records lie in between.
package checkpointtopic

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Prepare creates the checkpoint topic name (compacted, one partition,
// replicationFactor; -1 for the broker's default) when create is set, and
// checks that it exists with exactly one partition. Creation that is not
// authorized is fine when an administrator created the topic.
func Prepare(ctx context.Context, admin *kadm.Client, name string, create bool, replicationFactor int16) error {
	created := false
	if create {
		compact, segment := "compact", "3600000"
		_, err := admin.CreateTopic(ctx, 1, replicationFactor, map[string]*string{
			"cleanup.policy": &compact,
			"segment.ms":     &segment, // let compaction reach recent checkpoints
		}, name)
		if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) && !notAllowed(err) {
			return fmt.Errorf("create checkpoint topic %q: %w", name, err)
		}
		created = err == nil || errors.Is(err, kerr.TopicAlreadyExists)
	}
	list := func(ctx context.Context) (kadm.TopicDetails, error) { return admin.ListTopics(ctx, name) }
	d, ok, err := describe(ctx, list, name, created)
	if err != nil {
		return fmt.Errorf("describe checkpoint topic %q: %w", name, err)
	}
	if ok && notAllowed(d.Err) {
		// Kafka hides whether a topic exists from a principal that may
		// not describe it: an ACL to grant, not a topic to create.
		return fmt.Errorf("describe checkpoint topic %q: %w", name, d.Err)
	}
	if !ok || d.Err != nil {
		return fmt.Errorf("checkpoint topic %q does not exist: create it (compacted, one partition) or turn on router.Config.CreateTopics", name)
	}
	if n := len(d.Partitions); n != 1 {
		return fmt.Errorf("checkpoint topic %q has %d partitions: it needs exactly one", name, n)
	}
	return nil
}

// visibleWithin bounds describe's wait for a topic the controller has
// created: brokers learn of it from the metadata log, in milliseconds
// normally, seconds on a loaded machine.
const visibleWithin = 15 * time.Second

// describe reads name's metadata. When the topic was just created (or
// another relay was creating it), a broker whose metadata cache has not
// caught up with the controller calls it unknown or leaderless for a
// moment: describe asks again until it shows, for visibleWithin at most,
// so that this is not taken for a topic that does not exist.
func describe(ctx context.Context, list func(context.Context) (kadm.TopicDetails, error), name string, created bool) (kadm.TopicDetail, bool, error) {
	deadline := time.Now().Add(visibleWithin)
	for {
		details, err := list(ctx)
		if err != nil {
			return kadm.TopicDetail{}, false, err
		}
		d, ok := details[name]
		catchingUp := !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition) || errors.Is(d.Err, kerr.LeaderNotAvailable)
		if !created || !catchingUp || time.Now().After(deadline) {
			return d, ok, nil
		}
		select {
		case <-ctx.Done():
			return d, ok, nil
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func notAllowed(err error) bool {
	return errors.Is(err, kerr.TopicAuthorizationFailed) || errors.Is(err, kerr.ClusterAuthorizationFailed)
}

// Probe returns the key ("<key>/probe") and a fresh random value of a probe
// record for key: commit it to the topic, then read up to it (Reader.Until).
func Probe(key []byte) (probeKey, probe []byte) {
	nonce := make([]byte, 16)
	rand.Read(nonce)
	return append(append([]byte(nil), key...), "/probe"...), []byte(hex.EncodeToString(nonce))
}

// Reader reads the checkpoint topic read_committed, with a client built
// from the connection options (seed brokers, TLS, SASL), for the newest
// committed record of a key before a probe record. OpenReader starts
// reading the topic from its start at once (connecting, looking up the
// partition, fetching), so that this overlaps the probe's commit; Until
// returns once it reaches the probe. Opening it before the probe is
// committed changes nothing it returns: a read_committed fetch stops at the
// first transaction still undecided, so the probe is reached only once
// everything before it is decided. The probe must be committed by a
// producer that fenced every older one.
type Reader struct {
	cl    *kgo.Client
	topic string
}

// OpenReader starts reading topic; Close stops it.
func OpenReader(opts []kgo.Opt, topic string) (*Reader, error) {
	cl, err := kgo.NewClient(append(append([]kgo.Opt(nil), opts...),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: {0: kgo.NewOffset().AtStart()}}),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
	)...)
	if err != nil {
		return nil, err
	}
	return &Reader{cl: cl, topic: topic}, nil
}

// Close stops the reader.
func (rd *Reader) Close() { rd.cl.Close() }

// Until reads on until the probe record (probeKey, probe), or until ctx
// ends, and returns the newest committed value of key before it. A
// tombstone (a null value) for key deletes the checkpoint, as compaction
// will once delete.retention.ms has passed: found is false until a newer
// record.
func (rd *Reader) Until(ctx context.Context, key, probeKey, probe []byte) (value []byte, found bool, err error) {
	topic := rd.topic
	for {
		fs := rd.cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return nil, false, fmt.Errorf("read checkpoint topic %q: %w", topic, err)
		}
		var fetchErr error
		fs.EachError(func(_ string, _ int32, err error) { fetchErr = err })
		if fetchErr != nil {
			return nil, false, fmt.Errorf("read checkpoint topic %q: %w", topic, fetchErr)
		}
		done := false
		fs.EachRecord(func(rec *kgo.Record) {
			switch {
			case done:
			case string(rec.Key) == string(key):
				value, found = rec.Value, rec.Value != nil
			case string(rec.Key) == string(probeKey) && string(rec.Value) == string(probe):
				done = true
			}
		})
		if done {
			return value, found, nil
		}
	}
}
