package relay

// status.go: what the relay reports of itself (its /status endpoint, read
// by `walrelay status`): readiness and what holds delivery, from the one
// board every part reports into (package holds).

import (
	"github.com/walrelay/walrelay/holds"
)

// Status is the relay now: ready or why not, streaming, its lag, the
// position it confirmed and what holds delivery.
func (r *Relay) Status() holds.Status {
	st := holds.Status{
		Streaming:             r.Streaming(),
		ReplicationLagSeconds: r.ReplicationLag().Seconds(),
		ConfirmedLSN:          r.Confirmed().String(),
		Holds:                 r.cfg.Holds.Holds(),
	}
	if st.Holds == nil {
		st.Holds = []holds.Hold{}
	}
	if err := r.Ready(); err != nil {
		st.NotReady = err.Error()
	} else {
		st.Ready = true
	}
	return st
}
