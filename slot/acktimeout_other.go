//go:build !linux

package slot

import (
	"errors"
	"syscall"
	"time"
)

// setAckTimeout is Linux's TCP_USER_TIMEOUT, which other systems lack: a
// cut the relay does not see while it waits for Kafka is then noticed
// when it reads again.
func setAckTimeout(syscall.RawConn, time.Duration) error { return errors.ErrUnsupported }
