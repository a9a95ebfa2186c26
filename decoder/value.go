package decoder

// value.go: decoding one column value, chosen by the column's type OID.
//
// Kafka gets the text form of every value except bytea, which becomes its raw
// bytes (a payload column of type bytea carries a binary record value). In
// text format PostgreSQL already sends the text form, so only bytea needs work
// (its hex output "\x..."). In binary format (pgoutput's binary option) the
// few types an outbox uses are rendered to the same bytes the text format
// would have given, so the rest of the relay never knows which was used.
//
// Each value is decoded in two steps: valueLen validates it and returns its
// decoded size, decodeValue fills exactly that many bytes. This lets the
// caller allocate one buffer for all the values of a row.
//
// Note that Relation messages carry the column's own type OID: a column whose
// type is a domain over bytea is kept as text, and in binary format it is
// unsupported.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
)

// Built-in type OIDs (pg_type.dat). They are stable across PostgreSQL
// versions.
const (
	oidBytea   = 17
	oidName    = 19
	oidInt8    = 20
	oidInt2    = 21
	oidInt4    = 23
	oidText    = 25
	oidJSON    = 114
	oidBpchar  = 1042
	oidVarchar = 1043
	oidUUID    = 2950
	oidJSONB   = 3802
)

// jsonbVersion is the only version of jsonb's binary format (jsonb_send).
const jsonbVersion = 1

// Value errors. The caller adds table, column and offset.
var (
	errByteaPrefix = fmt.Errorf(`bytea text value without the "\x" hex prefix (is bytea_output 'hex'?): %w`, ErrMalformed)
	errByteaOdd    = fmt.Errorf("bytea hex value with an odd number of digits: %w", ErrMalformed)
	errByteaDigit  = fmt.Errorf("bytea hex value with a non-hex digit: %w", ErrMalformed)
	errJSONBEmpty  = fmt.Errorf("empty binary jsonb value: %w", ErrMalformed)
	errJSONBVer    = fmt.Errorf("binary jsonb value of a version other than %d: %w", jsonbVersion, ErrUnsupported)
	errBinaryType  = fmt.Errorf("binary value of a type the relay cannot render as text: %w", ErrUnsupported)
	errUnknownKind = errors.New("unknown value kind") // unreachable: walkTuple checks kinds
)

// valueLen validates a value and returns the size decodeValue will produce,
// or -1 for NULL. kind is the TupleData kind byte, typ the column's type OID.
func valueLen(kind byte, typ uint32, v []byte) (int, error) {
	switch kind {
	case 'n':
		return -1, nil
	case 't':
		if typ != oidBytea {
			return len(v), nil
		}
		if len(v) < 2 || v[0] != '\\' || v[1] != 'x' {
			return 0, errByteaPrefix
		}
		if len(v)%2 != 0 {
			return 0, errByteaOdd
		}
		return (len(v) - 2) / 2, nil
	case 'b':
		return binaryLen(typ, v)
	}
	return 0, errUnknownKind
}

// BinaryRenders reports whether a column of type OID typ can be mapped
// when pgoutput sends binary values (Config.Binary): the decoder renders
// only these types' binary form to the bytes the text format would give.
// Setup checks the mapped columns with it before streaming; a row whose
// column has another type (changed after that check) is an invalid event
// (Event.Undecodable). A domain has its own OID and is not among them.
func BinaryRenders(typ uint32) bool {
	switch typ {
	case oidBytea, oidText, oidVarchar, oidBpchar, oidName, oidJSON, oidJSONB, oidUUID, oidInt2, oidInt4, oidInt8:
		return true
	}
	return false
}

// binaryLen is valueLen for binary-format values. Its cases are the types
// of BinaryRenders.
func binaryLen(typ uint32, v []byte) (int, error) {
	switch typ {
	case oidBytea, oidText, oidVarchar, oidBpchar, oidName, oidJSON:
		return len(v), nil
	case oidJSONB:
		if len(v) == 0 {
			return 0, errJSONBEmpty
		}
		if v[0] != jsonbVersion {
			return 0, errJSONBVer
		}
		return len(v) - 1, nil
	case oidUUID:
		if len(v) != 16 {
			return 0, sizeError("uuid", 16, len(v))
		}
		return 36, nil
	case oidInt2, oidInt4, oidInt8:
		i, err := binaryInt(typ, v)
		if err != nil {
			return 0, err
		}
		return decimalLen(i), nil
	}
	return 0, errBinaryType
}

// sizeError reports a binary value of a fixed-size type with the wrong size.
func sizeError(typ string, want, got int) error {
	return fmt.Errorf("binary %s value of %d bytes, want %d: %w", typ, got, want, ErrMalformed)
}

// binaryInt decodes a big-endian int2, int4 or int8.
func binaryInt(typ uint32, v []byte) (int64, error) {
	switch typ {
	case oidInt2:
		if len(v) != 2 {
			return 0, sizeError("int2", 2, len(v))
		}
		return int64(int16(binary.BigEndian.Uint16(v))), nil
	case oidInt4:
		if len(v) != 4 {
			return 0, sizeError("int4", 4, len(v))
		}
		return int64(int32(binary.BigEndian.Uint32(v))), nil
	default:
		if len(v) != 8 {
			return 0, sizeError("int8", 8, len(v))
		}
		return int64(binary.BigEndian.Uint64(v)), nil
	}
}

// decimalLen returns the length of strconv.FormatInt(i, 10).
func decimalLen(i int64) int {
	n := 1
	u := uint64(i)
	if i < 0 {
		n++
		u = -u
	}
	for u >= 10 {
		u /= 10
		n++
	}
	return n
}

// decodeValue decodes v into dst, which is exactly valueLen(kind, typ, v)
// bytes long (never called for NULL). Errors left to it are only those
// valueLen cannot see without decoding, such as a bad hex digit.
func decodeValue(dst []byte, kind byte, typ uint32, v []byte) error {
	if kind == 't' {
		if typ == oidBytea {
			return decodeHex(dst, v[2:])
		}
		copy(dst, v)
		return nil
	}
	switch typ {
	case oidJSONB:
		copy(dst, v[1:])
	case oidUUID:
		formatUUID(dst, v)
	case oidInt2, oidInt4, oidInt8:
		i, _ := binaryInt(typ, v) // validated by binaryLen
		strconv.AppendInt(dst[:0], i, 10)
	default:
		copy(dst, v)
	}
	return nil
}

// decodeHex decodes the hex digits src into dst (len(dst)*2 == len(src)).
// PostgreSQL writes lowercase digits; uppercase is accepted as well.
func decodeHex(dst, src []byte) error {
	for i := range dst {
		hi, ok1 := unhex(src[2*i])
		lo, ok2 := unhex(src[2*i+1])
		if !ok1 || !ok2 {
			return errByteaDigit
		}
		dst[i] = hi<<4 | lo
	}
	return nil
}

// unhex returns the value of one hex digit.
func unhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// formatUUID writes the canonical lowercase 8-4-4-4-12 form of the 16 bytes
// u into dst (36 bytes): what uuid_out produces in text format.
func formatUUID(dst, u []byte) {
	const digits = "0123456789abcdef"
	j := 0
	for i, b := range u[:16] {
		if i == 4 || i == 6 || i == 8 || i == 10 {
			dst[j] = '-'
			j++
		}
		dst[j] = digits[b>>4]
		dst[j+1] = digits[b&0x0f]
		j += 2
	}
}
