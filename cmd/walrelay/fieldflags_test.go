package main

import (
	"bytes"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/alecthomas/kong"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/kafkaauth"
	"github.com/walrelay/walrelay/pgauth"
	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/schema"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/snapshot"
	"github.com/walrelay/walrelay/source"
)

// configTypes are the types whose fields the libraries name.
var configTypes = map[string]reflect.Type{
	"relay.Config":         reflect.TypeFor[relay.Config](),
	"router.Config":        reflect.TypeFor[router.Config](),
	"source.SetupConfig":   reflect.TypeFor[source.SetupConfig](),
	"slot.ReadOptions":     reflect.TypeFor[slot.ReadOptions](),
	"snapshot.Config":      reflect.TypeFor[snapshot.Config](),
	"decoder.Mapping":      reflect.TypeFor[decoder.Mapping](),
	"doctor.StatusOptions": reflect.TypeFor[doctor.StatusOptions](),
	"kafkaauth.OAuth":      reflect.TypeFor[kafkaauth.OAuth](),
	"kafkaauth.TLSFiles":   reflect.TypeFor[kafkaauth.TLSFiles](),
	"kafkaauth.MSKIAM":     reflect.TypeFor[kafkaauth.MSKIAM](),
	"pgauth.Command":       reflect.TypeFor[pgauth.Command](),
	"pgauth.RDSIAM":        reflect.TypeFor[pgauth.RDSIAM](),
	"schema.Config":        reflect.TypeFor[schema.Config](),
}

// commandFuncs are the library functions the libraries name where walrelay
// runs a command (relay.PublishSnapshot: walrelay snapshot); the values
// make the compiler check that each exists.
var commandFuncs = map[string]any{
	"relay.PublishSnapshot": relay.PublishSnapshot,
	"relay.Relay.Run":       (*relay.Relay).Run,
	"source.Prepare":        source.Prepare,
}

// unflagged are fields the libraries name that no flag sets: their names
// stay as they are.
var unflagged = map[string]string{
	"relay.Config.BackoffMin":      "the backoff starts at its default; only --backoff-max is a flag",
	"kafkaauth.OAuth.RefreshAfter": "walrelay refreshes at Kafka's default, 80% of a token's lifetime",
	"schema.Config.Timeout":        "a registry request is bounded by its default; the flags tune what operators asked for",
	"schema.Config.RetryPause":     "the pause between failed registry reads is its default",
}

// realField reports whether name (relay.Config.Read.MaxMessageBytes,
// decoder.Mapping, kgo.SeedBrokers) is a field, type or option that exists.
func realField(t *testing.T, name string) bool {
	name, _, _ = strings.Cut(name, "=") // a setting: its field
	if commandFuncs[name] != nil {
		return true
	}
	if opt, ok := strings.CutPrefix(name, "kgo."); ok {
		cl, err := kgo.NewClient()
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		return cl.OptValue(opt) != nil
	}
	for prefix, typ := range configTypes {
		rest, ok := strings.CutPrefix(name, prefix)
		if !ok || rest != "" && rest[0] != '.' {
			continue
		}
		for _, f := range strings.Split(strings.TrimPrefix(rest, "."), ".") {
			if f == "" {
				break
			}
			sf, ok := typ.FieldByName(f)
			if !ok {
				return false
			}
			typ = sf.Type
		}
		return true
	}
	return false
}

// allFlags are the flags of every walrelay command.
func allFlags(t *testing.T) map[string]bool {
	t.Helper()
	var c cli
	k, err := kong.New(&c, parserOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	flags := map[string]bool{}
	var walk func(n *kong.Node)
	walk = func(n *kong.Node) {
		for _, f := range n.Flags {
			flags[f.Name] = true
		}
		for _, ch := range n.Children {
			walk(ch)
		}
	}
	walk(k.Model.Node)
	return flags
}

var flagToken = regexp.MustCompile(`--([a-z][a-z0-9-]*)(\*?)`)

// allCommands are walrelay's commands.
func allCommands(t *testing.T) map[string]bool {
	t.Helper()
	var c cli
	k, err := kong.New(&c, parserOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	commands := map[string]bool{}
	for _, n := range k.Model.Node.Children {
		commands[n.Name] = true
	}
	return commands
}

// commandToken is a walrelay command in a message ("walrelay setup").
var commandToken = regexp.MustCompile(`\bwalrelay ([a-z]+)\b`)

// TestFieldFlags: every field the table maps exists, every flag it maps
// to is a flag of walrelay, and every field the libraries name in a
// message is in the table (or has no flag, said why), so that renaming a
// field or a flag fails here rather than leaving messages that name
// neither.
func TestFieldFlags(t *testing.T) {
	flags, commands := allFlags(t), allCommands(t)
	for field, flag := range fieldFlags {
		if !realField(t, field) {
			t.Errorf("fieldFlags maps %s, which is no field", field)
		}
		tokens := flagToken.FindAllStringSubmatch(flag, -1)
		named := commandToken.FindAllStringSubmatch(flag, -1)
		if len(tokens) == 0 && len(named) == 0 {
			t.Errorf("fieldFlags maps %s to %q, which names no flag", field, flag)
		}
		for _, cmd := range named {
			if !commands[cmd[1]] {
				t.Errorf("fieldFlags maps %s to %s, which is no command of walrelay", field, cmd[0])
			}
		}
		for _, tok := range tokens {
			if tok[2] == "*" {
				found := false
				for f := range flags {
					found = found || strings.HasPrefix(f, tok[1])
				}
				if !found {
					t.Errorf("fieldFlags maps %s to %s, and no flag starts with --%s", field, tok[0], tok[1])
				}
			} else if !flags[tok[1]] {
				t.Errorf("fieldFlags maps %s to --%s, which is no flag of walrelay", field, tok[1])
			}
		}
	}
	for field, why := range unflagged {
		if !realField(t, field) {
			t.Errorf("unflagged lists %s, which is no field (%s)", field, why)
		}
	}

	named := libraryFieldNames(t)
	if len(named) < 20 {
		t.Fatalf("found only %d field names in the libraries' messages", len(named))
	}
	for name, where := range named {
		if _, ok := fieldFlags[name]; !ok && unflagged[name] == "" {
			t.Errorf("%s names %s, which fieldFlags maps to no flag", where, name)
		}
	}
	for field := range fieldFlags {
		if named[field] == "" {
			t.Errorf("fieldFlags maps %s, which no library message names: a stale entry?", field)
		}
	}
}

// fieldName is how a library names a field in a message.
var fieldName = regexp.MustCompile(`\b(?:relay|router|slot|source|doctor|snapshot|decoder|kgo|kafkaauth|pgauth|schema)\.[A-Z]\w*(?:\.[A-Z]\w*)*(?:=\w+)?`)

// libraryStrings calls f with each string literal of the libraries' code
// (tests aside) and where it is.
func libraryStrings(t *testing.T, f func(s, where string)) {
	t.Helper()
	var files []string
	for _, dir := range []string{"relay", "router", "slot", "source", "doctor", "checkpoint", "confirm", "snapshot", "decoder", "heartbeat", "deadletter", "metrics", "kafkaauth", "pgauth", "schema"} {
		err := filepath.WalkDir(filepath.Join("../..", dir), func(path string, d fs.DirEntry, err error) error {
			if err == nil && strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
				files = append(files, path)
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, file := range files {
		fset := token.NewFileSet()
		syntax, err := parser.ParseFile(fset, file, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(syntax, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING {
				if s, err := strconv.Unquote(lit.Value); err == nil {
					f(s, fset.Position(lit.Pos()).String())
				}
			}
			return true
		})
	}
}

// libraryFieldNames returns the field names in the libraries' string
// literals, each with where it was found.
func libraryFieldNames(t *testing.T) map[string]string {
	t.Helper()
	named := map[string]string{}
	libraryStrings(t, func(s, where string) {
		for _, name := range fieldName.FindAllString(s, -1) {
			// A call in a message (relay.DefaultConfig()) is not a field.
			if i := strings.Index(s, name) + len(name); i < len(s) && s[i] == '(' {
				continue
			}
			named[name] = where
		}
	})
	return named
}

// commandFlag is a flag in an instruction to run a walrelay command
// ("walrelay setup --accept-gap"): the command exists whatever embeds the
// library, so the flag stays.
var commandFlag = regexp.MustCompile(`walrelay [a-z]+ --[a-z][a-z0-9-]*`)

// TestLibrariesNameNoFlags: the libraries' messages name fields, not
// flags, but in an instruction to run a walrelay command.
func TestLibrariesNameNoFlags(t *testing.T) {
	flags := allFlags(t)
	libraryStrings(t, func(s, where string) {
		rest := commandFlag.ReplaceAllString(s, "")
		for _, tok := range flagToken.FindAllStringSubmatch(rest, -1) {
			if flags[tok[1]] {
				t.Errorf("%s names the flag %s: name the field (and map it in fieldFlags)", where, tok[0])
			}
		}
	})
}

// commandsNamed are the only library strings that name a walrelay command
// (each the part that does), and why: everywhere else a library names the
// field or function, and fieldFlags speaks it as the command.
var commandsNamed = map[string]string{
	"walrelay drop --slot ":                "source/preflight.go: no library function drops a slot; walrelay drop counts what it holds and drops walrelay's record with it",
	"walrelay snapshot --table ":           "source/publication.go: the fix field of a log line, a command line to paste",
	"run walrelay setup --accept-gap with": "slot/slot.go: accepting a gap is an operator's one-off decision, never a setting a relay keeps",
}

// TestLibrariesNameNoCommands: the libraries' messages name fields and
// functions, not walrelay's commands, but in the few strings
// commandsNamed lists.
func TestLibrariesNameNoCommands(t *testing.T) {
	if len(commandsNamed) > 3 {
		t.Errorf("%d library strings may name a command, want at most 3: name fields and functions, and map them in fieldFlags", len(commandsNamed))
	}
	commands := allCommands(t)
	seen := map[string]bool{}
	libraryStrings(t, func(s, where string) {
		for _, cmd := range commandToken.FindAllStringSubmatch(s, -1) {
			if !commands[cmd[1]] {
				continue // "walrelay streams", not a command
			}
			allowed := false
			for part := range commandsNamed {
				if strings.Contains(s, part) {
					allowed, seen[part] = true, true
				}
			}
			if !allowed {
				t.Errorf("%s names the command %q: name the field or function, and map it in fieldFlags", where, cmd[0])
			}
		}
	})
	for part, why := range commandsNamed {
		if !seen[part] {
			t.Errorf("commandsNamed lists %q (%s), which no library string holds: remove it", part, why)
		}
	}
}

// TestSpeakFlags: what walrelay prints and logs names flags where the
// libraries named fields, and the library's error is still under it.
func TestSpeakFlags(t *testing.T) {
	got := speakFlags("gave up after relay.Config.StartupTimeout 2m0s: relay.Config.Router.TransactionalID and router.Config.TransactionTimeout; map another column (decoder.Mapping)")
	want := "gave up after --startup-timeout 2m0s: --transactional-id and --txn-timeout; map another column (the matching --column-* or --header-column flag)"
	if got != want {
		t.Errorf("speakFlags = %q\nwant %q", got, want)
	}

	var buf bytes.Buffer
	core := zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(&buf), zap.DebugLevel)
	log := zap.New(flagCore{core}).With(zap.String("hint", "raise router.Config.MaxTopics"))
	cause := errors.New("relay.Config.Read.MaxMessageBytes too small")
	log.Warn("reached router.Config.MaxTopics", zap.String("fix", "turn on source.SetupConfig.CreateSlot"), zap.Error(cause), zap.Int("n", 3))
	line := buf.String()
	for _, w := range []string{`"msg":"reached --max-topics"`, `"hint":"raise --max-topics"`, `"fix":"turn on --create-slot"`, `"error":"--max-message-bytes too small"`, `"n":3`} {
		if !strings.Contains(line, w) {
			t.Errorf("log line %s lacks %s", line, w)
		}
	}
	if err := speakingFlags(cause); !errors.Is(err, cause) || err.Error() != "--max-message-bytes too small" {
		t.Errorf("speakingFlags = %v (is the cause: %v)", err, errors.Is(err, cause))
	}
}
