package refdoc

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Const is a named constant of a package's source, with its doc comment.
type Const struct {
	Name  string // the Go name, e.g. ReasonTooLarge
	Value string // its value: a string's text, an integer's digits
	Doc   string // the doc comment (or the comment after it), one paragraph per line break
	Group string // the doc comment of the const ( … ) block it is in
	File  string // the file's base name
}

// Consts returns the constants of the Go package in dir (its non-test
// files) whose declared type is typeName, or, with typeName "", the
// untyped ones whose name starts with prefix. Only constants written as a
// literal are returned; another form (iota, an expression) is an error, so
// that a page never shows a value it guessed.
func Consts(dir, typeName, prefix string) ([]Const, error) {
	fset := token.NewFileSet()
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []Const
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.CONST {
				continue
			}
			for _, s := range gd.Specs {
				vs := s.(*ast.ValueSpec)
				typ := ""
				if id, ok := vs.Type.(*ast.Ident); ok {
					typ = id.Name
				}
				for i, n := range vs.Names {
					if typ != typeName || !strings.HasPrefix(n.Name, prefix) {
						continue
					}
					if i >= len(vs.Values) {
						return nil, fmt.Errorf("%s: constant %s has no value of its own", fset.Position(n.Pos()), n.Name)
					}
					lit, ok := vs.Values[i].(*ast.BasicLit)
					if !ok {
						return nil, fmt.Errorf("%s: constant %s is not a literal", fset.Position(n.Pos()), n.Name)
					}
					v := lit.Value
					if lit.Kind == token.STRING {
						if v, err = strconv.Unquote(v); err != nil {
							return nil, err
						}
					}
					doc := vs.Doc.Text()
					if doc == "" {
						doc = vs.Comment.Text()
					}
					out = append(out, Const{Name: n.Name, Value: v, Doc: Sentence(n.Name, doc), Group: paragraphs(gd.Doc.Text()), File: name})
				}
			}
		}
	}
	return out, nil
}

// ByValue indexes cs by value.
func ByValue(cs []Const) map[string]Const {
	m := make(map[string]Const, len(cs))
	for _, c := range cs {
		m[c.Value] = c
	}
	return m
}

// Sentence is a doc comment as a table cell's text: its paragraphs on one
// line each, and the constant's own name taken off its start ("CauseKafka
// is a restart because …" becomes "A restart because …", "exitFenced:
// another producer …" becomes "Another producer …").
func Sentence(name, doc string) string {
	doc = paragraphs(doc)
	for _, p := range []string{name + " is ", name + ": ", name + " "} {
		if rest, ok := strings.CutPrefix(doc, p); ok {
			doc = rest
			break
		}
	}
	if doc == "" {
		return ""
	}
	r, n := utf8.DecodeRuneInString(doc)
	return string(unicode.ToUpper(r)) + doc[n:]
}

// paragraphs joins the lines of each paragraph of a comment, keeping the
// breaks between paragraphs.
func paragraphs(doc string) string {
	var ps []string
	for _, p := range strings.Split(strings.TrimSpace(doc), "\n\n") {
		ps = append(ps, strings.Join(strings.Fields(p), " "))
	}
	return strings.Join(ps, "\n")
}

// SortedKeys returns m's keys in order.
func SortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
