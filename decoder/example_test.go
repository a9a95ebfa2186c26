package decoder

import "fmt"

// A transaction with one outbox row, as the relay feeds it: the pgoutput
// message of each XLogData message, in stream order. (The messages are
// built here by the test helpers; the relay reads them from the slot.)
func ExampleDecoder() {
	d, err := New(Config{
		Tables:  []Table{{Schema: "public", Name: "outbox"}},
		Mapping: DefaultMapping(),
	})
	if err != nil {
		panic(err)
	}
	stream := [][]byte{
		relationMsg(16384, "public", "outbox", outboxCols()...),
		beginMsg(0x16B3800, 0, 731),
		insertMsg(16384, text("8c0e5a1e-0d6b-4a53-9d6a-2e9f7c9b1a01"), text("order"), text("o-17"), text("created"), text(`{"total":42}`)),
		commitMsg(0, 0x16B3800, 0x16B3830, 0),
	}
	for _, msg := range stream {
		kind, err := d.Decode(msg)
		if err != nil {
			panic(err)
		}
		switch kind {
		case KindBegin:
			fmt.Println("begin, commit record at", d.Begin().FinalLSN)
		case KindInsert:
			ev := d.Event() // valid until the next Decode
			fmt.Printf("event %s: %s/%s %s\n", ev.ID, ev.AggregateType, ev.AggregateID, ev.Payload)
		case KindCommit:
			fmt.Println("commit, confirmable at", d.Commit().EndLSN)
		}
	}
	// Output:
	// begin, commit record at 0/16B3800
	// event 8c0e5a1e-0d6b-4a53-9d6a-2e9f7c9b1a01: order/o-17 {"total":42}
	// commit, confirmable at 0/16B3830
}
