package schema

import (
	"context"
	"fmt"

	"github.com/bufbuild/protocompile"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"
)

// protobufMain is the file name the subject's schema is compiled under;
// its references are compiled under the import paths they are named by.
const protobufMain = "walrelay-subject.proto"

// protobufEncoder encodes payloads as a message of one .proto schema: the
// message the event type names (its full name, or a top-level message's
// name), else the file's first.
type protobufEncoder struct {
	first    protoreflect.MessageDescriptor
	messages map[string]protoreflect.MessageDescriptor // by full name and by top-level name
	indexes  map[protoreflect.FullName][]int
}

func compileProtobuf(text string, refs []reference) (encoder, error) {
	sources := map[string]string{protobufMain: text}
	for _, r := range refs {
		sources[r.name] = r.schema.Schema
	}
	c := protocompile.Compiler{
		Resolver: protocompile.WithStandardImports(&protocompile.SourceResolver{Accessor: protocompile.SourceAccessorFromMap(sources)}),
	}
	files, err := c.Compile(context.Background(), protobufMain)
	if err != nil {
		return nil, err
	}
	fd := files[0]
	if fd.Messages().Len() == 0 {
		return nil, fmt.Errorf("the .proto schema defines no message")
	}
	e := &protobufEncoder{
		first:    fd.Messages().Get(0),
		messages: map[string]protoreflect.MessageDescriptor{},
		indexes:  map[protoreflect.FullName][]int{},
	}
	var walk func(ms protoreflect.MessageDescriptors, path []int)
	walk = func(ms protoreflect.MessageDescriptors, path []int) {
		for i := range ms.Len() {
			m := ms.Get(i)
			p := append(append([]int(nil), path...), i)
			e.indexes[m.FullName()] = p
			e.messages[string(m.FullName())] = m
			if len(path) == 0 {
				if _, ok := e.messages[string(m.Name())]; !ok {
					e.messages[string(m.Name())] = m
				}
			}
			walk(m.Messages(), p)
		}
	}
	walk(fd.Messages(), nil)
	return e, nil
}

func (e *protobufEncoder) message(eventType string) protoreflect.MessageDescriptor {
	if m, ok := e.messages[eventType]; ok {
		return m
	}
	return e.first
}

// index is the message's path of indexes in the file, as the wire header
// carries it ([0] for the first message).
func (e *protobufEncoder) index(eventType string) ([]int, error) {
	return e.indexes[e.message(eventType).FullName()], nil
}

// appendValue reads payload as the proto3 JSON mapping of the message and
// appends its binary encoding. Unknown fields are a mismatch.
func (e *protobufEncoder) appendValue(dst, payload []byte, eventType string) ([]byte, error) {
	md := e.message(eventType)
	m := dynamicpb.NewMessage(md)
	if err := protojson.Unmarshal(payload, m); err != nil {
		return nil, fmt.Errorf("message %s: %w", md.FullName(), err)
	}
	return proto.MarshalOptions{Deterministic: true}.MarshalAppend(dst, m)
}
