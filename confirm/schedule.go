package confirm

import (
	"time"

	"github.com/walrelay/walrelay/decoder"
)

// Schedule decides when the replication loop sends a standby status update.
// It is owned by that loop.
type Schedule struct {
	interval time.Duration // longest time between two updates
	minGap   time.Duration // shortest time between two updates that only advance
	sent     decoder.LSN   // position in the last update
	sentAt   time.Time
	next     time.Time // next periodic update
}

// NewSchedule returns a Schedule sending an update at least every interval,
// and one that only advances the confirmed position at most every minGap.
// The first update is due at once.
func NewSchedule(interval, minGap time.Duration) *Schedule {
	return &Schedule{interval: interval, minGap: minGap}
}

// Due reports whether an update carrying confirmable should be sent now:
// force (the server asked for a reply), the periodic update is due, or the
// position advanced and the last update is at least minGap old.
func (s *Schedule) Due(now time.Time, confirmable decoder.LSN, force bool) bool {
	return force || !now.Before(s.next) ||
		confirmable > s.sent && now.Sub(s.sentAt) >= s.minGap
}

// Sent records an update of pos at now and schedules the next periodic one
// a jittered interval later, so relays started together do not update in
// step.
func (s *Schedule) Sent(now time.Time, pos decoder.LSN) {
	s.sent, s.sentAt = pos, now
	s.next = now.Add(s.interval - s.interval/10 + time.Duration(now.UnixNano()%int64(s.interval/5+1)))
}

// Confirmed is the position sent in the last update.
func (s *Schedule) Confirmed() decoder.LSN { return s.sent }

// Pending reports whether confirmable is ahead of what was sent: the loop
// should then wake soon (the relay wakes every few tens of milliseconds) to
// send it once Due allows, rather than sleep until Next.
func (s *Schedule) Pending(confirmable decoder.LSN) bool { return confirmable > s.sent }

// Next is when the next periodic update is due.
func (s *Schedule) Next() time.Time { return s.next }
