package devcluster

import (
	"fmt"

	"github.com/twmb/franz-go/pkg/kfake"
)

// KafkaOptions configures StartKafka.
type KafkaOptions struct {
	// Port to listen on; 0 picks a free one. Restarting on the same port
	// with the same DataDir brings the same log back.
	Port int
	// DataDir persists the log; empty keeps it in memory.
	DataDir string
	// Partitions is the default partition count of created topics
	// (default 3).
	Partitions int
	// Discard accepts produce requests without storing records, for
	// throughput measurements.
	Discard bool
	// Extra options, e.g. SASL users.
	Extra []kfake.Opt
}

// Kafka is an in-process Kafka-protocol broker (one node).
type Kafka struct {
	*kfake.Cluster
	Port int
}

// StartKafka starts a one-broker kfake cluster.
func StartKafka(opts KafkaOptions) (*Kafka, error) {
	port := opts.Port
	if port == 0 {
		var err error
		if port, err = FreePort(); err != nil {
			return nil, err
		}
	}
	parts := opts.Partitions
	if parts == 0 {
		parts = 3
	}
	kopts := []kfake.Opt{kfake.NumBrokers(1), kfake.Ports(port), kfake.DefaultNumPartitions(parts)}
	if opts.DataDir != "" {
		kopts = append(kopts, kfake.DataDir(opts.DataDir))
	}
	if opts.Discard {
		kopts = append(kopts, kfake.BlackholeProduce())
	}
	kopts = append(kopts, opts.Extra...)
	c, err := kfake.NewCluster(kopts...)
	if err != nil {
		return nil, fmt.Errorf("start kfake broker: %w", err)
	}
	return &Kafka{Cluster: c, Port: port}, nil
}

// Addr is the broker's address.
func (k *Kafka) Addr() string { return k.ListenAddrs()[0] }
