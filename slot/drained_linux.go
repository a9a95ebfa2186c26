package slot

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// rawSocket is the socket under c (under TLS too) for socketEmpty, nil
// when c has none. Asked once per stream: SyscallConn allocates.
func rawSocket(c net.Conn) syscall.RawConn {
	if t, ok := c.(interface{ NetConn() net.Conn }); ok {
		c = t.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// socketEmpty reports whether the kernel holds no received byte of rc
// (SIOCINQ); false when it cannot tell.
func socketEmpty(rc syscall.RawConn) bool {
	if rc == nil {
		return false
	}
	queued := -1
	if err := rc.Control(func(fd uintptr) {
		if n, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil {
			queued = n
		}
	}); err != nil {
		return false
	}
	return queued == 0
}
