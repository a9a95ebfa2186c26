package docblocks

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// snippetImports are the packages a Go block of the documentation may name,
// by the name it uses. A block naming another package fails the test until
// it is added here.
var snippetImports = map[string]string{
	"context":    "context",
	"sql":        "database/sql",
	"pgx":        "github.com/jackc/pgx/v5",
	"pgxpool":    "github.com/jackc/pgx/v5/pgxpool",
	"kgo":        "github.com/twmb/franz-go/pkg/kgo",
	"prometheus": "github.com/prometheus/client_golang/prometheus",
	"zap":        "go.uber.org/zap",
	"outbox":     "github.com/walrelay/walrelay/outbox",
	"inbox":      "github.com/walrelay/walrelay/inbox",
	"relay":      "github.com/walrelay/walrelay/relay",
	"metrics":    "github.com/walrelay/walrelay/metrics",
	"schema":     "github.com/walrelay/walrelay/schema",
}

// snippetParams are the variables a block uses without declaring them: the
// program around a snippet, as a reader would have it.
const snippetParams = "ctx context.Context, pool *pgxpool.Pool, db *pgxpool.Pool, payload []byte, pgURL string"

// TestGoBlocksCompile compiles every ```go block of README.md and docs/ as
// the body of a function (with snippetParams in scope) against this
// module's packages, so that a renamed function, field or option fails
// here rather than in a reader's paste. Variables a block declares and
// leaves for the reader's code to use are allowed; errors name the page
// and line.
func TestGoBlocksCompile(t *testing.T) {
	pages, err := Pages(root)
	if err != nil {
		t.Fatal(err)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	overlay := map[string]string{}
	var pkgs []string
	for _, p := range pages {
		blocks, err := GoBlocks(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range blocks {
			page := strings.TrimPrefix(b.File, root+"/")
			src, err := snippetSource(page, b)
			if err != nil {
				t.Errorf("%s:%d: %v", page, b.Line, err)
				continue
			}
			name := fmt.Sprintf("b%d", len(pkgs)+1)
			file := filepath.Join(dir, name+".go")
			if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			// A package that exists only in the overlay: nothing is written
			// into the source tree, which other packages' tests may be
			// walking meanwhile.
			overlay[filepath.Join(abs, "test", "docblocks", "snippets", name, "snippet.go")] = file
			pkgs = append(pkgs, "./test/docblocks/snippets/"+name)
		}
	}
	if len(pkgs) < 3 {
		t.Fatalf("found %d Go blocks in %d pages, want the README's chain and packages.md's writer and consumer", len(pkgs), len(pages))
	}
	o, err := json.Marshal(map[string]map[string]string{"Replace": overlay})
	if err != nil {
		t.Fatal(err)
	}
	oFile := filepath.Join(dir, "overlay.json")
	if err := os.WriteFile(oFile, o, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", append([]string{"build", "-overlay", oFile}, pkgs...)...)
	cmd.Dir = abs
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the documentation's Go blocks do not compile (%v):\n%s", err, out)
	}
	t.Logf("%d Go blocks compiled", len(pkgs))
}

// snippetSource is a Go file whose one function's body is the block, with
// //line directives so that errors name the page's lines, and a blank use
// of each variable the block declares at its top level.
func snippetSource(page string, b Block) (string, error) {
	wrapped := "package p\nfunc _() {\n" + b.Text + "\n}\n"
	f, err := parser.ParseFile(token.NewFileSet(), "", wrapped, parser.SkipObjectResolution)
	if err != nil {
		return "", fmt.Errorf("not a function body: %w", err)
	}
	body := f.Decls[0].(*ast.FuncDecl).Body
	var declared []string
	for _, st := range body.List {
		if as, ok := st.(*ast.AssignStmt); ok && as.Tok == token.DEFINE {
			for _, l := range as.Lhs {
				if id, ok := l.(*ast.Ident); ok && id.Name != "_" {
					declared = append(declared, id.Name)
				}
			}
		}
	}
	// Imports are the packages the block names; a name that is neither a
	// package of snippetImports nor declared fails to compile as undefined.
	used := map[string]bool{"context": true, "pgxpool": true} // by snippetParams
	ast.Inspect(body, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := sel.X.(*ast.Ident); ok && snippetImports[id.Name] != "" && !isLocal(id.Name, declared) {
				used[id.Name] = true
			}
		}
		return true
	})
	var imports []string
	for n := range used {
		imports = append(imports, strconv.Quote(snippetImports[n]))
	}
	sort.Strings(imports)
	var sb strings.Builder
	fmt.Fprintf(&sb, "package snippet\n\nimport (\n\t%s\n)\n\nfunc _(%s) {\n", strings.Join(imports, "\n\t"), snippetParams)
	fmt.Fprintf(&sb, "//line %s:%d\n%s", page, b.Line+1, b.Text)
	for _, d := range declared {
		fmt.Fprintf(&sb, "\t_ = %s\n", d)
	}
	sb.WriteString("}\n")
	return sb.String(), nil
}

func isLocal(name string, declared []string) bool {
	for _, d := range declared {
		if d == name {
			return true
		}
	}
	return false
}
