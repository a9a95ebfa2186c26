package docblocks

import (
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

const root = "../.."

func TestParseText(t *testing.T) {
	page := "# A page\n\n" +
		"<!-- exercised: TestOne -->\n```sh\nmake demo\n```\n\n" +
		"Not marked:\n\n```bash\necho hi\n```\n\n" +
		"<!-- illustrative: a synopsis -->\n\n```sh\nwalrelay status [--json]\n```\n\n" +
		"<!-- exercised: TestTwo -->\n```sql\nSELECT 1;\n```\n\n" +
		"```sh\n```\n\n" +
		"1. In a list:\n\n   <!-- exercised: TestThree -->\n   ```sh\n   walrelay run \\\n     --slot s\n   ```\n\n" +
		"````md\n```sh\nnot a block of this page\n```\n````\n"
	got, err := ParseText("p.md", page)
	if err != nil {
		t.Fatal(err)
	}
	want := []Block{
		{File: "p.md", Line: 4, Lang: "sh", Text: "make demo\n", Exercised: "TestOne", Marked: true},
		{File: "p.md", Line: 10, Lang: "bash", Text: "echo hi\n"},
		{File: "p.md", Line: 16, Lang: "sh", Text: "walrelay status [--json]\n", Illustrative: "a synopsis", Marked: true},
		// The sql block's marker is its own: the empty sh block after it has none.
		{File: "p.md", Line: 25, Lang: "sh", Text: "\n"},
		{File: "p.md", Line: 31, Lang: "sh", Text: "walrelay run \\\n  --slot s\n", Exercised: "TestThree", Marked: true},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseText:\n got %+v\nwant %+v", got, want)
	}
	if _, err := ParseText("q.md", "```sh\nmake\n"); err == nil {
		t.Error("an unclosed block parsed without an error")
	}
}

func TestCommands(t *testing.T) {
	got := Commands("# a comment\nmake demo            # = go build && bin/walrelay dev --demo 10\n\n" +
		"walrelay run --pg-url \"$PG_URL\" \\\n  --slot debezium   \\\n  --preset debezium\necho '# not a comment'\n")
	want := []string{"make demo", `walrelay run --pg-url "$PG_URL" --slot debezium --preset debezium`, "echo '# not a comment'"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Commands:\n got %q\nwant %q", got, want)
	}
}

// TestShellBlocksAreMarked holds every shell block of README.md and docs/
// to a marker: exercised by a test that exists (or by .ci/run, which must
// run each of its commands), or illustrative with a reason.
func TestShellBlocksAreMarked(t *testing.T) {
	pages, err := Pages(root)
	if err != nil {
		t.Fatal(err)
	}
	tests := testNames(t)
	ci := ciCommands(t)
	n := 0
	for _, p := range pages {
		blocks, err := Parse(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range blocks {
			n++
			where := strings.TrimPrefix(b.File, root+"/") + ":" + strconv.Itoa(b.Line)
			switch {
			case !b.Marked:
				t.Errorf("%s: a ```%s block a user may paste, marked neither <!-- exercised: TestName --> (and run by that test) nor <!-- illustrative: why it is not run -->", where, b.Lang)
			case b.Exercised == CIScript:
				for _, c := range Commands(b.Text) {
					if !ci[c] {
						t.Errorf("%s: marked exercised by %s, which does not run %q", where, CIScript, c)
					}
				}
			case b.Exercised != "":
				if !tests[b.Exercised] {
					t.Errorf("%s: marked exercised by %s, which is no test of this repository", where, b.Exercised)
				}
			case b.Illustrative == "":
				t.Errorf("%s: marked illustrative without the reason it is not run", where)
			}
		}
	}
	if n < 10 {
		t.Fatalf("found only %d shell blocks in %d pages", n, len(pages))
	}
}

// testNames are the Test functions of every package of the repository
// (deploy/'s modules included).
func testNames(t *testing.T) map[string]bool {
	t.Helper()
	re := regexp.MustCompile(`(?m)^func (Test\w*)\(`)
	names := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "bin" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			names[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !names["TestShellBlocksAreMarked"] {
		t.Fatal("the walk found no test functions")
	}
	return names
}

// ciCommands are the commands .ci/run runs, as lines (a leading `time`
// dropped).
func ciCommands(t *testing.T) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, CIScript))
	if err != nil {
		t.Fatal(err)
	}
	cmds := map[string]bool{}
	for _, c := range Commands(string(b)) {
		cmds[strings.TrimPrefix(c, "time ")] = true
	}
	return cmds
}
