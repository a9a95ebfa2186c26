package slot

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// setAckTimeout sets TCP_USER_TIMEOUT, in milliseconds, on the socket.
func TestSetAckTimeout(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	raw := rawSocket(c)
	if err := setAckTimeout(raw, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	var got int
	var gerr error
	if err := raw.Control(func(fd uintptr) {
		got, gerr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)
	}); err != nil || gerr != nil {
		t.Fatal(err, gerr)
	}
	if got != 3000 {
		t.Errorf("TCP_USER_TIMEOUT %d ms, want 3000", got)
	}
}
