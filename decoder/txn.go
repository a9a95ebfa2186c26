package decoder

// txn.go: Begin and Commit, the transaction boundaries.
//
// pgoutput (protocol version 1, no streaming) sends every decoded transaction
// whole and in commit order: Begin, its changes, Commit. The decoder checks
// that pairing, because an Insert outside it would be a row whose commit is
// unknown, and remembers both messages: Begin gives events their commit time
// and xid, Commit gives the relay the end LSN it confirms once the
// transaction's records are acknowledged.

import (
	"fmt"
	"time"
)

// decodeBegin decodes a Begin message: final LSN, commit time, xid.
func (d *Decoder) decodeBegin(r *reader) (Kind, error) {
	b := Begin{
		FinalLSN:   LSN(r.u64("final LSN")),
		CommitTime: PGTime(r.u64("commit time")),
		Xid:        r.u32("xid"),
	}
	if err := d.end(r, 'B'); err != nil {
		return KindIgnored, err
	}
	if d.inTxn {
		return KindIgnored, malformed('B', "message", 0,
			fmt.Sprintf("Begin of xid %d inside xid %d, which has no Commit", b.Xid, d.begin.Xid))
	}
	d.begin, d.inTxn = b, true
	return KindBegin, nil
}

// decodeCommit decodes a Commit message: flags, commit LSN, end LSN, commit
// time.
func (d *Decoder) decodeCommit(r *reader) (Kind, error) {
	c := Commit{
		Flags:      r.u8("flags"),
		CommitLSN:  LSN(r.u64("commit LSN")),
		EndLSN:     LSN(r.u64("end LSN")),
		CommitTime: PGTime(r.u64("commit time")),
	}
	if err := d.end(r, 'C'); err != nil {
		return KindIgnored, err
	}
	if !d.inTxn {
		return KindIgnored, malformed('C', "message", 0, "Commit without Begin")
	}
	d.commit, d.inTxn = c, false
	return KindCommit, nil
}

// pgEpoch is 2000-01-01 00:00:00 UTC in Unix seconds: pgoutput times count
// microseconds from there.
const pgEpoch = 946684800

// PGTime converts microseconds since the PostgreSQL epoch (2000-01-01 UTC),
// as the replication protocol sends times, to a UTC time.
func PGTime(v uint64) time.Time {
	us := int64(v)
	return time.Unix(pgEpoch+us/1e6, (us%1e6)*1e3).UTC()
}
