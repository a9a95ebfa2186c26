// Package source owns preparing the source database for a relay's stream:
// the checks that must pass before anything is created (preflight.go: the
// endpoint, the server, the outbox tables and their columns, free slots,
// another relay on the same topics), the publication and what it publishes
// (publication.go), creating the slot, with or without an initial snapshot,
// while PostgreSQL waits for transactions to end (setup.go, slotwait.go),
// walrelay's record of what the slot streams from and the refusal when
// something it names changed (record.go), and the publication watch that
// stops a streaming relay when the publication stops publishing an outbox
// table (watch.go). Prepare is the entry: it checks, creates what it may,
// and returns the record, or a *slot.SetupError or *slot.GapError naming
// the fix.
//
// The stream itself is package slot's; the words for what is wrong with a
// slot (invalidated, gone, what a creation waits for) are package
// doctor's.
package source
