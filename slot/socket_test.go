package slot

import (
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// A read after a small one waits for what is left of the pause: all of
// it right after, none when the pause has passed anyway (as after a Kafka
// commit); a read after a large one never waits.
func TestPacedReaderSleepsWhatIsLeftOfThePause(t *testing.T) {
	const pause = 10 * time.Millisecond
	var slept []time.Duration
	p := &pacedReader{r: strings.NewReader(strings.Repeat("x", 100)), pause: pause, small: 8,
		sleep: func(d time.Duration) { slept = append(slept, d) }}
	b := make([]byte, 4)
	read := func() {
		if _, err := p.Read(b); err != nil {
			t.Fatal(err)
		}
	}
	read() // the first read: nothing before it
	if len(slept) != 0 {
		t.Fatalf("the first read slept %v", slept)
	}
	read() // right after a small read
	if len(slept) != 1 || slept[0] <= pause/2 || slept[0] > pause {
		t.Fatalf("a read right after a small one slept %v, want nearly %v", slept, pause)
	}
	p.lastAt = time.Now().Add(-pause) // the pause passed meanwhile
	read()
	if len(slept) != 1 {
		t.Fatalf("a read %v after a small one slept %v, want no sleep", pause, slept[1:])
	}
	p.last = 8 // a large read
	read()
	if len(slept) != 1 {
		t.Fatalf("a read after a large one slept %v", slept[1:])
	}
}

// socketEmpty asks the kernel: empty before a byte arrives, not once one
// has (waited for as the kernel reports it), empty again once read.
func TestSocketEmpty(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	client, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	defer server.Close()
	raw := rawSocket(client)
	if !socketEmpty(raw) {
		t.Fatal("a socket nothing was sent to is not empty")
	}
	if _, err := server.Write([]byte("abc")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for socketEmpty(raw) {
		if time.Now().After(deadline) {
			t.Fatal("three bytes sent on loopback never showed as queued")
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := io.ReadFull(client, make([]byte, 3)); err != nil {
		t.Fatal(err)
	}
	if !socketEmpty(raw) {
		t.Fatal("the socket is not empty once its bytes were read")
	}
	if socketEmpty(rawSocket(fakeConn{})) {
		t.Fatal("a connection that is no socket reads as empty, want false (cannot tell)")
	}
}

// fakeConn is a net.Conn without a file descriptor.
type fakeConn struct{ net.Conn }
