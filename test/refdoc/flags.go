package refdoc

import (
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/alecthomas/kong"
)

// Flag is one row of a flags table, as kong's model has it.
type Flag struct {
	Name    string // e.g. --[no-]create-slot
	Aliases []string
	Env     string // the environment variable, "" for none
	Type    string // what the value is: duration, integer, one of …
	Default string // as kong applies it; "(required)" or "" for none
	Help    string
}

// Flags returns the flags of node itself (not its parents'), less --help,
// in the order the command declares them.
func Flags(node *kong.Node) []Flag {
	var out []Flag
	for _, f := range node.Flags {
		if f.Hidden || f.Name == "help" {
			continue
		}
		out = append(out, flagOf(f))
	}
	return out
}

func flagOf(f *kong.Flag) Flag {
	name := "--" + f.Name
	if f.IsBool() && f.Tag.Negatable != "" {
		name = "--[no-]" + f.Name
	}
	var aliases []string
	for _, a := range f.Aliases {
		aliases = append(aliases, "--"+a)
	}
	env := ""
	if len(f.Envs) > 0 {
		env = f.Envs[0]
	}
	def := f.Default
	switch {
	case f.Required:
		def = "(required)"
	case f.IsBool() && def == "":
		def = "false"
	}
	return Flag{Name: name, Aliases: aliases, Env: env, Type: valueType(f), Default: def, Help: f.Help}
}

var durationType = reflect.TypeFor[time.Duration]()

// valueType says what a flag takes, in the words of a person typing it.
func valueType(f *kong.Flag) string {
	if f.Enum != "" {
		var vs []string
		for _, v := range f.EnumSlice() {
			if v == "" {
				v = `""`
			}
			vs = append(vs, "`"+v+"`")
		}
		return strings.Join(vs, ", ")
	}
	t := f.Target.Type()
	list := ""
	if t.Kind() == reflect.Slice {
		list, t = "list of ", t.Elem()
	}
	var s string
	switch {
	case f.PlaceHolder != "" && t.Kind() != reflect.Bool:
		// The placeholder says more than the Go type: FILE, SQL,
		// COLUMN[=HEADER].
		return list + "`" + f.PlaceHolder + "`"
	case t == durationType:
		s = "duration"
	case t.Kind() == reflect.Bool:
		if f.Tag.Type == "counter" {
			return "counter"
		}
		return "boolean"
	case t.Kind() >= reflect.Int && t.Kind() <= reflect.Int64, t.Kind() >= reflect.Uint && t.Kind() <= reflect.Uint64:
		s = "integer"
	case t.Kind() == reflect.String && strings.Contains(f.Tag.Type, "file"):
		s = "file"
	case t.Kind() == reflect.String:
		s = "string"
	default:
		s = t.String()
	}
	if list != "" {
		return list + s + "s"
	}
	return s
}

// FlagTable is flags as a Markdown table: flag, environment variable, value,
// default, description.
func FlagTable(flags []Flag) string {
	var b strings.Builder
	b.WriteString("| flag | environment | value | default | description |\n| --- | --- | --- | --- | --- |\n")
	for _, f := range flags {
		name := "`" + f.Name + "`"
		for _, a := range f.Aliases {
			name += ", `" + a + "`"
		}
		def := Code(f.Default)
		if f.Default == "(required)" {
			def = "(required)"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", name, Code(f.Env), Cell(f.Type), Cell(def), Cell(f.Help))
	}
	return b.String()
}

// Commands returns the commands of app in the order it declares them,
// depth first, with their full names (walrelay run, …).
func Commands(app *kong.Application) []*kong.Node {
	var out []*kong.Node
	var walk func(n *kong.Node)
	walk = func(n *kong.Node) {
		for _, c := range n.Children {
			if c.Hidden || c.Type != kong.CommandNode {
				continue
			}
			out = append(out, c)
			walk(c)
		}
	}
	walk(app.Node)
	return out
}
