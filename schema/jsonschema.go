package schema

import (
	"bytes"
	"fmt"
	"net/url"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// jsonSchemaBase is where the subject's schema is placed for the
// validator: references with relative names resolve beside it, and no
// name reaches the network or the file system (the compiler loads
// nothing it was not given).
const jsonSchemaBase = "walrelay:///subject/"

type jsonSchemaEncoder struct{ s *jsonschema.Schema }

func compileJSONSchema(text string, refs []reference) (encoder, error) {
	c := jsonschema.NewCompiler()
	c.UseLoader(noLoader{})
	add := func(name, text string) error {
		doc, err := jsonschema.UnmarshalJSON(strings.NewReader(text))
		if err != nil {
			return err
		}
		u := name
		if p, err := url.Parse(name); err != nil || !p.IsAbs() {
			u = jsonSchemaBase + name
		}
		return c.AddResource(u, doc)
	}
	for _, r := range refs {
		if err := add(r.name, r.schema.Schema); err != nil {
			return nil, fmt.Errorf("reference %s: %w", r.name, err)
		}
	}
	if err := add("value.json", text); err != nil {
		return nil, err
	}
	s, err := c.Compile(jsonSchemaBase + "value.json")
	if err != nil {
		return nil, err
	}
	return jsonSchemaEncoder{s}, nil
}

func (jsonSchemaEncoder) index(string) ([]int, error) { return nil, nil }

// appendValue validates payload and appends it unchanged: the JSON
// Schema wire format carries the JSON text.
func (e jsonSchemaEncoder) appendValue(dst, payload []byte, _ string) ([]byte, error) {
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
	if err != nil {
		return nil, fmt.Errorf("the payload is not JSON: %w", err)
	}
	if err := e.s.Validate(doc); err != nil {
		return nil, err
	}
	return append(dst, payload...), nil
}

// noLoader refuses every $ref the registry did not supply.
type noLoader struct{}

func (noLoader) Load(u string) (any, error) {
	return nil, fmt.Errorf("%s is not a reference of the subject's schema", u)
}
