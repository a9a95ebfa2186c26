// Package letter builds dead-letter records: the event's key, payload and
// headers plus the headers of the deadletter contract naming the reason,
// the table, the LSN and the topic it was meant for, shrunk to what the
// dead-letter topic accepts. It builds records and produces none: the
// router produces a dead letter in the event's place (its in-flight slot,
// its acker and, with exactly-once delivery, its place in the Kafka
// transaction), and applies the on-invalid policy.
package letter

import (
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/router/internal/topics"
)

// Check finds what makes ev invalid whatever its topic, or "" when
// nothing does: a row its table's columns could not map, a value that
// could not be decoded, or a missing
// aggregate type (unless fixed: a template without placeholder needs
// none), aggregate id or id. Whether its topic will take it is for the
// router and package topics to say.
func Check(ev *decoder.Event, fixed bool) (reason deadletter.Reason, detail string) {
	switch {
	case ev.Unmappable != nil:
		return deadletter.ReasonUnmappable, ev.Unmappable.Error()
	case ev.Undecodable != nil:
		return deadletter.ReasonUndecodable, ev.Undecodable.Error()
	case len(ev.AggregateType) == 0 && !fixed:
		return deadletter.ReasonNoAggregateType, "aggregate type is NULL or empty"
	case ev.AggregateID == nil:
		return deadletter.ReasonNoAggregateID, "aggregate id is NULL"
	case ev.ID == nil:
		return deadletter.ReasonNoID, "id is NULL"
	}
	return "", ""
}

// Letter says what a dead letter is about.
type Letter struct {
	Reason deadletter.Reason
	Detail string
	LSN    decoder.LSN // the WAL position of the event's message
	// Topic is the topic the event was meant for; named in a header when
	// the reason concerns the topic.
	Topic string
	// HeaderID and HeaderType are the configured names of the event's id
	// and type headers.
	HeaderID, HeaderType string
	// Extra are headers of the reason's own (the schema subject and
	// version of a schema_mismatch).
	Extra []kgo.RecordHeader
}

// ForEvent builds the dead letter of ev for the dead-letter topic dlq,
// whose records may be at most maxBytes (topics.RecordSize), and returns
// it with its size. The payload rides along when it fits; a record that
// does not (or whose headers alone do not) keeps only what identifies it,
// with values cut to 1 KiB: Kafka would refuse it for good otherwise, and
// the relay would restart into the same event forever.
func ForEvent(ev *decoder.Event, l Letter, dlq string, maxBytes int) (kgo.Record, int) {
	rec := kgo.Record{Topic: dlq, Key: ev.AggregateID, Timestamp: ev.CommitTime}
	h := []kgo.RecordHeader{
		{Key: deadletter.HeaderReason, Value: []byte(l.Reason)},
		{Key: deadletter.HeaderDetail, Value: []byte(l.Detail)},
		{Key: deadletter.HeaderTable, Value: []byte(ev.Table.String())},
		{Key: deadletter.HeaderLSN, Value: []byte(l.LSN.String())},
	}
	if ev.ID != nil {
		h = append(h, kgo.RecordHeader{Key: l.HeaderID, Value: ev.ID})
	}
	if ev.Type != nil {
		h = append(h, kgo.RecordHeader{Key: l.HeaderType, Value: ev.Type})
	}
	if ev.AggregateType != nil {
		h = append(h, kgo.RecordHeader{Key: deadletter.HeaderAggregateType, Value: truncate(ev.AggregateType, 1024)})
	}
	if ev.AggregateID != nil {
		// Also the key, but a header survives tools that show headers only.
		h = append(h, kgo.RecordHeader{Key: deadletter.HeaderAggregateID, Value: truncate(ev.AggregateID, 1024)})
	}
	if l.Reason.AboutTopic() {
		h = append(h, kgo.RecordHeader{Key: deadletter.HeaderTopic, Value: truncate([]byte(l.Topic), 1024)})
	}
	for _, x := range ev.Headers {
		if x.Value != nil {
			h = append(h, kgo.RecordHeader{Key: x.Key, Value: x.Value})
		}
	}
	if ev.Omitted > 0 {
		h = append(h, kgo.RecordHeader{Key: deadletter.HeaderPayloadOmit, Value: []byte(fmt.Sprint(ev.Omitted))})
	}
	h = append(h, l.Extra...)
	rec.Headers = h
	rec.Value = ev.Payload
	size := topics.RecordSize(rec.Key, rec.Value, h)
	if size > maxBytes {
		rec.Value = nil
		rec.Key = truncate(rec.Key, 1024)
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: deadletter.HeaderPayloadOmit, Value: []byte(fmt.Sprint(len(ev.Payload)))})
		for i := range rec.Headers {
			rec.Headers[i].Value = truncate(rec.Headers[i].Value, 1024)
		}
		size = topics.RecordSize(rec.Key, nil, rec.Headers)
	}
	return rec, size
}

// ForRefused builds the dead letter of orig, a record of table's event at
// lsn of aggregate type aggType that Kafka refused because of its topic
// (why), for the dead-letter topic dlq, and returns it with its size. It
// keeps orig's key, value and headers, and names the aggregate type and id
// (orig's key) in headers as ForEvent does; the value is left out when the
// record would exceed maxBytes.
func ForRefused(orig *kgo.Record, aggType []byte, table string, lsn decoder.LSN, why, dlq string, maxBytes int) (kgo.Record, int) {
	rec := kgo.Record{Topic: dlq, Key: orig.Key, Timestamp: orig.Timestamp}
	h := []kgo.RecordHeader{
		{Key: deadletter.HeaderReason, Value: []byte(deadletter.ReasonTopicRejected)},
		{Key: deadletter.HeaderDetail, Value: truncate([]byte(why), 1024)},
		{Key: deadletter.HeaderTable, Value: []byte(table)},
		{Key: deadletter.HeaderLSN, Value: []byte(lsn.String())},
		{Key: deadletter.HeaderTopic, Value: []byte(orig.Topic)},
	}
	if aggType != nil {
		h = append(h, kgo.RecordHeader{Key: deadletter.HeaderAggregateType, Value: truncate(aggType, 1024)})
	}
	if orig.Key != nil {
		h = append(h, kgo.RecordHeader{Key: deadletter.HeaderAggregateID, Value: truncate(orig.Key, 1024)})
	}
	h = append(h, orig.Headers...)
	rec.Headers = h
	rec.Value = orig.Value
	size := topics.RecordSize(rec.Key, rec.Value, h)
	if size > maxBytes {
		rec.Value = nil
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: deadletter.HeaderPayloadOmit, Value: []byte(strconv.Itoa(len(orig.Value)))})
		size = topics.RecordSize(rec.Key, nil, rec.Headers)
	}
	return rec, size
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}
