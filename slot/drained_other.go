//go:build !linux

package slot

import (
	"net"
	"syscall"
)

// rawSocket and socketEmpty cannot ask the kernel here: a stream never
// says it is drained, and the relay waits for it instead.
func rawSocket(net.Conn) syscall.RawConn { return nil }

func socketEmpty(syscall.RawConn) bool { return false }
