package checkpoint_test

import (
	"fmt"

	"github.com/walrelay/walrelay/checkpoint"
)

// With exactly-once delivery a checkpoint record travels in each Kafka
// transaction; after a restart, Skip says which resent events it covers.
func ExampleSkip() {
	d := checkpoint.Durable{
		Slot: "walrelay", SystemID: "7713984148484868534", LSN: 0x2000,
		// The transaction committing at 0x3000 was split: 2 events are in.
		Partial: &checkpoint.Partial{CommitLSN: 0x3000, Events: 2},
	}
	d, err := checkpoint.UnmarshalDurable(d.Marshal())
	if err != nil {
		panic(err)
	}
	skip := checkpoint.NewSkip(d, true)

	skip.Begin(0x1f00) // committed before the checkpoint: all in Kafka
	fmt.Println(skip.Event(), skip.Event())
	skip.Begin(0x3000) // the split one: the first two are in Kafka
	fmt.Println(skip.Event(), skip.Event(), skip.Event())
	skip.Begin(0x4000) // after the checkpoint: nothing skipped
	fmt.Println(skip.Event())
	// Output:
	// true true
	// true true false
	// false
}
