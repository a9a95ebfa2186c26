package decoder

// relation.go: the relation cache.
//
// pgoutput sends a Relation message before the first row of a table on a
// connection and again whenever the table's definition may have changed (for
// example after ALTER TABLE ADD or DROP COLUMN, which shifts the positions of
// the columns after it). Rows carry only the relation OID and positional
// values, so every Insert decodes against the latest Relation of its OID.
//
// For outbox tables the mapped column names are resolved to positions here,
// once per Relation message, so that Insert decoding does no name lookups.

import (
	"fmt"
	"strings"
)

// column is one column of a Relation message.
type column struct {
	name   string
	typ    uint32 // type OID: decides how values are decoded
	typmod int32
	flags  uint8 // 1 when the column is part of the replica identity key
}

// relation is one cached Relation message.
type relation struct {
	oid             uint32
	namespace, name string
	replicaIdentity uint8
	columns         []column

	// table is the configured outbox table, nil for other tables (whose
	// rows are KindUnmapped).
	table *Table
	// fieldCols holds, per Decoder.fields entry, the position of its column.
	fieldCols []int
	// err is set when an outbox table lacks mapped columns (their
	// fieldCols are -1); its rows become events marked Unmappable with it.
	err error
}

// minColumnSize is the smallest encoding of a column in a Relation message:
// flags, an empty name's NUL, type OID and type modifier. It bounds the
// preallocation for a column count read from the wire.
const minColumnSize = 1 + 1 + 4 + 4

// decodeRelation decodes a Relation message and replaces the cached relation
// of its OID.
func (d *Decoder) decodeRelation(r *reader) (Kind, error) {
	oid := r.u32("relation OID")
	ns := r.cstring("namespace")
	name := r.cstring("relation name")
	ident := r.u8("replica identity")
	n := int(r.u16("column count"))
	if r.failed {
		return KindIgnored, d.end(r, 'R')
	}

	rel := &relation{
		oid:             oid,
		namespace:       string(ns),
		name:            string(name),
		replicaIdentity: ident,
		columns:         make([]column, 0, min(n, r.rest()/minColumnSize)),
	}
	for i := 0; i < n; i++ {
		flags := r.u8("column flags")
		cname := r.cstring("column name")
		typ := r.u32("column type OID")
		mod := int32(r.u32("column type modifier"))
		if r.failed {
			return KindIgnored, malformed('R', fmt.Sprintf("column %d %s", i, r.field), r.at, "message truncated")
		}
		rel.columns = append(rel.columns, column{name: string(cname), typ: typ, typmod: mod, flags: flags})
	}
	if err := d.end(r, 'R'); err != nil {
		return KindIgnored, err
	}

	rel.table = d.lookupTable(rel.namespace, rel.name)
	if rel.table != nil {
		rel.err = d.resolve(rel)
		if len(d.cols) < len(rel.columns) {
			d.cols = make([]colSpan, len(rel.columns))
		}
	}
	d.relations[oid] = rel
	return KindRelation, nil
}

// lookupTable returns the configured table with this schema and name, or nil.
// A linear scan: there are few outbox tables and Relation messages are rare.
func (d *Decoder) lookupTable(schema, name string) *Table {
	for i := range d.tables {
		if d.tables[i].Schema == schema && d.tables[i].Name == name {
			return &d.tables[i]
		}
	}
	return nil
}

// resolve finds the position of every mapped column of an outbox relation,
// -1 for a column the relation lacks (an optional one is then nil, as for
// a NULL). All missing columns are named in the
// error at once, so that one dead-letter record tells the operator
// everything to fix.
func (d *Decoder) resolve(rel *relation) error {
	rel.fieldCols = make([]int, len(d.fields))
	var missing []string
	for f, fl := range d.fields {
		rel.fieldCols[f] = -1
		for c := range rel.columns {
			if rel.columns[c].name == fl.column {
				rel.fieldCols[f] = c
				break
			}
		}
		if rel.fieldCols[f] < 0 && !fl.optional {
			missing = append(missing, fmt.Sprintf("%q (%s)", fl.column, fl.role))
		}
	}
	if missing == nil {
		return nil
	}
	return fmt.Errorf("decoder: outbox table %s (relation OID %d) has no column %s: %w",
		rel.table, rel.oid, strings.Join(missing, ", "), ErrMissingColumn)
}
