package slot

import (
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// setAckTimeout makes the kernel end the TCP connection under rc, with
// ETIMEDOUT, once data written to it has gone unacknowledged for d
// (TCP_USER_TIMEOUT). See Stream.AckTimeout for why.
func setAckTimeout(rc syscall.RawConn, d time.Duration) error {
	var serr error
	err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(d.Milliseconds()))
	})
	if err != nil {
		return err
	}
	return serr
}
