// Package fakenet gives tests TCP peers that are not what a client
// expects: one that accepts and never answers, one that answers with bytes
// of another protocol.
package fakenet

import (
	"net"
	"testing"
)

// Listen starts a listener on 127.0.0.1 that hands every connection to
// serve (which may hold it, write to it or close it), and returns its
// address. The listener and the connections close when the test ends.
func Listen(t testing.TB, serve func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		ln.Close()
		<-done
	})
	go func() {
		defer close(done)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
			serve(c)
		}
	}()
	return ln.Addr().String()
}

// Silent is a serve function that holds the connection and never answers.
func Silent(net.Conn) {}
