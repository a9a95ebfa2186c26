// Package topics knows what a Kafka topic accepts from the relay: which
// names are valid, which name an event's aggregate type makes (Template),
// which topics writers may make the relay use (an allowlist and bounds on
// the number of topics and of their metric series, kept in a Set that
// outlives a producer), how a topic is created, and the size of the
// largest record it takes (Admin, RecordSize).
//
// It answers questions and creates topics; it produces nothing. The
// router asks it before producing to a topic, and turns its answers into
// dead letters (package deadletter) when a topic will never do.
package topics
