package topics

import "github.com/twmb/franz-go/pkg/kgo"

// batchOverhead is what a record batch (format v2) adds around a lone
// record: its 61-byte header and the 4-byte length the producer counts.
const batchOverhead = 65

// RecordSize is the encoded size of a record alone in a batch, as the
// broker compares it with the topic's max.message.bytes: varint lengths,
// attributes, the largest timestamp and offset deltas, key, value and
// headers. It errs high by a few bytes, never low: an event it passes must
// not fail in the producer with MESSAGE_TOO_LARGE.
func RecordSize(key, value []byte, headers []kgo.RecordHeader) int {
	n := 1 + 10 + 5 // attributes, timestamp delta, offset delta (varint maxima)
	n += bytesField(key) + bytesField(value) + varintLen(len(headers))
	for _, h := range headers {
		n += varintLen(len(h.Key)) + len(h.Key) + bytesField(h.Value)
	}
	return batchOverhead + varintLen(n) + n
}

// bytesField is a varint length (-1 for nil) and the bytes.
func bytesField(b []byte) int {
	if b == nil {
		return 1
	}
	return varintLen(len(b)) + len(b)
}

// varintLen is the size of n as a zig-zag varint.
func varintLen(n int) int {
	u := uint64(n) << 1
	l := 1
	for u >= 0x80 {
		u >>= 7
		l++
	}
	return l
}
