package checkpoint

import "testing"

func TestCounterCountsPending(t *testing.T) {
	var c Counter
	c.Add()
	c.Add()
	c.Ack()
	if c.Pending() != 1 || c.Added() != 2 {
		t.Fatalf("pending %d added %d, want 1 and 2", c.Pending(), c.Added())
	}
	c.Ack()
	if c.Pending() != 0 {
		t.Fatalf("pending %d after every ack, want 0", c.Pending())
	}
}
