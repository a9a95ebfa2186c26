package decoder

// builder_test.go: the short names this package's tests, fuzz seeds and
// benchmarks use for test/pgoutputtest's pgoutput builders.

import pgo "github.com/walrelay/walrelay/test/pgoutputtest"

type (
	relCol = pgo.Column
	val    = pgo.Value
)

var (
	start       = pgo.Start
	col         = pgo.Col
	outboxCols  = pgo.OutboxColumns
	relationMsg = pgo.Relation
	beginMsg    = pgo.Begin
	commitMsg   = pgo.Commit
	insertMsg   = pgo.Insert
	updateMsg   = pgo.Update
	deleteMsg   = pgo.Delete
	truncateMsg = pgo.Truncate
	originMsg   = pgo.Origin
	typeMsg     = pgo.Type
	logicalMsg  = pgo.Logical
	tuple       = pgo.Tuple
	null        = pgo.Null
	toast       = pgo.Toast
	text        = pgo.Text
	binval      = pgo.Binary
	omitted     = pgo.Omitted
)
