package schema

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"reflect"
	"sort"
	"strings"

	"github.com/hamba/avro/v2"
)

// avroEncoder encodes payloads with one Avro schema. The payload is plain
// JSON (what a jsonb column holds), not Avro's JSON encoding: a union's
// value is given bare, and takes the first branch it fits (null for
// null); bytes and fixed values are strings of code points 0-255, as in
// Avro's JSON encoding; a decimal is a JSON number or a string of one. A
// field the payload lacks takes the schema's default; a field the schema
// lacks is a mismatch.
type avroEncoder struct{ s avro.Schema }

// avroAPI writes arrays and maps as Avro's Java library does, each in one
// block of its item count, without the block's byte size: both forms are
// valid Avro, but only this one gives the bytes Java writers (Debezium's
// converters among them) give, and every decoder reads it.
var avroAPI = avro.Config{DisableBlockSizeHeader: true, BlockLength: math.MaxInt32}.Freeze()

func compileAvro(text string, refs []reference) (encoder, error) {
	cache := &avro.SchemaCache{}
	for _, r := range refs {
		if _, err := avro.ParseWithCache(r.schema.Schema, "", cache); err != nil {
			return nil, fmt.Errorf("reference %s: %w", r.name, err)
		}
	}
	s, err := avro.ParseWithCache(text, "", cache)
	if err != nil {
		return nil, err
	}
	return avroEncoder{s}, nil
}

func (avroEncoder) index(string) ([]int, error) { return nil, nil }

func (e avroEncoder) appendValue(dst, payload []byte, _ string) ([]byte, error) {
	v, err := decodeJSON(payload)
	if err != nil {
		return nil, err
	}
	native, err := avroNative(e.s, v, "")
	if err != nil {
		return nil, err
	}
	b, err := avroAPI.Marshal(e.s, native)
	if err != nil {
		return nil, err
	}
	return append(dst, b...), nil
}

// decodeJSON decodes one JSON value, numbers kept exact.
func decodeJSON(payload []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(payload))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, fmt.Errorf("the payload is not JSON: %w", err)
	}
	if _, err := d.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("the payload is not JSON: more than one value")
	}
	return v, nil
}

// avroNative converts v, decoded JSON, to what hamba/avro encodes for s;
// at names the place in the payload for an error.
func avroNative(s avro.Schema, v any, at string) (any, error) {
	if ref, ok := s.(*avro.RefSchema); ok {
		s = ref.Schema()
	}
	wrong := func(want string) error {
		return fmt.Errorf("%s: want %s, got %s", place(at), want, jsonKind(v))
	}
	switch s.Type() {
	case avro.Null:
		if v != nil {
			return nil, wrong("null")
		}
		return nil, nil
	case avro.Boolean:
		b, ok := v.(bool)
		if !ok {
			return nil, wrong("a boolean")
		}
		return b, nil
	case avro.Int, avro.Long:
		n, ok := v.(json.Number)
		if !ok {
			return nil, wrong("an integer")
		}
		i, err := n.Int64()
		if err != nil {
			return nil, wrong("an integer")
		}
		if s.Type() == avro.Int {
			if i < math.MinInt32 || i > math.MaxInt32 {
				return nil, fmt.Errorf("%s: %d does not fit an Avro int", place(at), i)
			}
			return int32(i), nil
		}
		return i, nil
	case avro.Float, avro.Double:
		n, ok := v.(json.Number)
		if !ok {
			return nil, wrong("a number")
		}
		f, err := n.Float64()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", place(at), err)
		}
		if s.Type() == avro.Float {
			return float32(f), nil
		}
		return f, nil
	case avro.String:
		str, ok := v.(string)
		if !ok {
			return nil, wrong("a string")
		}
		return str, nil
	case avro.Bytes, avro.Fixed:
		if isDecimal(s) {
			return avroDecimal(v, at)
		}
		str, ok := v.(string)
		if !ok {
			return nil, wrong("a string of bytes")
		}
		b, err := codePoints(str)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", place(at), err)
		}
		if f, ok := s.(*avro.FixedSchema); ok {
			if len(b) != f.Size() {
				return nil, fmt.Errorf("%s: fixed %s holds %d bytes, got %d", place(at), f.FullName(), f.Size(), len(b))
			}
			return fixedArray(b), nil
		}
		return b, nil
	case avro.Enum:
		str, ok := v.(string)
		if !ok {
			return nil, wrong("a string")
		}
		e := s.(*avro.EnumSchema)
		for _, sym := range e.Symbols() {
			if sym == str {
				return str, nil
			}
		}
		return nil, fmt.Errorf("%s: %q is not a symbol of enum %s", place(at), str, e.FullName())
	case avro.Array:
		a, ok := v.([]any)
		if !ok {
			return nil, wrong("an array")
		}
		items := s.(*avro.ArraySchema).Items()
		out := make([]any, len(a))
		for i, x := range a {
			var err error
			if out[i], err = avroNative(items, x, fmt.Sprintf("%s[%d]", at, i)); err != nil {
				return nil, err
			}
		}
		return out, nil
	case avro.Map:
		m, ok := v.(map[string]any)
		if !ok {
			return nil, wrong("an object")
		}
		vals := s.(*avro.MapSchema).Values()
		out := make(map[string]any, len(m))
		for k, x := range m {
			var err error
			if out[k], err = avroNative(vals, x, at+"."+k); err != nil {
				return nil, err
			}
		}
		return out, nil
	case avro.Record:
		m, ok := v.(map[string]any)
		if !ok {
			return nil, wrong("an object")
		}
		r := s.(*avro.RecordSchema)
		out := make(map[string]any, len(r.Fields()))
		for _, f := range r.Fields() {
			x, ok := m[f.Name()]
			if !ok {
				if !f.HasDefault() {
					return nil, fmt.Errorf("%s: field %s of record %s is missing and has no default", place(at), f.Name(), r.FullName())
				}
				continue // hamba/avro writes the default
			}
			var err error
			if out[f.Name()], err = avroNative(f.Type(), x, at+"."+f.Name()); err != nil {
				return nil, err
			}
		}
		if len(m) > len(out) {
			var extra []string
			for k := range m {
				if _, ok := out[k]; !ok && !hasField(r, k) {
					extra = append(extra, k)
				}
			}
			if len(extra) > 0 {
				sort.Strings(extra)
				return nil, fmt.Errorf("%s: record %s has no field %s", place(at), r.FullName(), strings.Join(extra, ", "))
			}
		}
		return out, nil
	case avro.Union:
		u := s.(*avro.UnionSchema)
		var errs []string
		for _, b := range u.Types() {
			if v == nil && b.Type() != avro.Null {
				continue
			}
			x, err := avroNative(b, v, at)
			if err != nil {
				errs = append(errs, err.Error())
				continue
			}
			// hamba/avro's form of a union value: the branch's name to
			// its value.
			return map[string]any{unionName(b): x}, nil
		}
		if v == nil {
			return nil, fmt.Errorf("%s: null is not a branch of the union", place(at))
		}
		return nil, fmt.Errorf("%s: %s fits no branch of the union (%s)", place(at), jsonKind(v), strings.Join(errs, "; "))
	}
	return nil, fmt.Errorf("%s: Avro type %s is not supported", place(at), s.Type())
}

func hasField(r *avro.RecordSchema, name string) bool {
	for _, f := range r.Fields() {
		if f.Name() == name {
			return true
		}
	}
	return false
}

// unionName is the name hamba/avro knows a union branch by: a named
// type's full name, else the type with its logical type.
func unionName(s avro.Schema) string {
	if ref, ok := s.(*avro.RefSchema); ok {
		s = ref.Schema()
	}
	if n, ok := s.(avro.NamedSchema); ok {
		return n.FullName()
	}
	name := string(s.Type())
	if l, ok := s.(avro.LogicalTypeSchema); ok && l.Logical() != nil {
		name += "." + string(l.Logical().Type())
	}
	return name
}

func isDecimal(s avro.Schema) bool {
	l, ok := s.(avro.LogicalTypeSchema)
	return ok && l.Logical() != nil && l.Logical().Type() == avro.Decimal
}

// avroDecimal reads a decimal from a JSON number or a string holding
// one; hamba/avro scales and encodes it.
func avroDecimal(v any, at string) (any, error) {
	var text string
	switch x := v.(type) {
	case json.Number:
		text = x.String()
	case string:
		text = x
	default:
		return nil, fmt.Errorf("%s: want a decimal number, got %s", place(at), jsonKind(v))
	}
	r, ok := new(big.Rat).SetString(text)
	if !ok {
		return nil, fmt.Errorf("%s: %q is not a decimal number", place(at), text)
	}
	return r, nil
}

// codePoints is Avro's JSON form of bytes: each character one byte.
func codePoints(s string) ([]byte, error) {
	b := make([]byte, 0, len(s))
	for _, r := range s {
		if r > 255 {
			return nil, fmt.Errorf("character %q is not a byte (bytes are given as code points 0-255)", r)
		}
		b = append(b, byte(r))
	}
	return b, nil
}

func place(at string) string {
	if at == "" {
		return "the payload"
	}
	return strings.TrimPrefix(at, ".")
}

func jsonKind(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case json.Number:
		return "the number " + x.String()
	case string:
		return "a string"
	case []any:
		return "an array"
	case map[string]any:
		return "an object"
	}
	return fmt.Sprintf("%T", v)
}

// fixedArray is b as a [len(b)]byte, the form hamba/avro encodes a fixed
// from.
func fixedArray(b []byte) any {
	a := reflect.New(reflect.ArrayOf(len(b), reflect.TypeFor[byte]())).Elem()
	reflect.Copy(a, reflect.ValueOf(b))
	return a.Interface()
}
