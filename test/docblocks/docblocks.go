// Package docblocks finds the shell blocks of walrelay's documentation
// (README.md and docs/) and what each is marked as, so that tests can run
// the commands a user would paste and fail on a block nobody runs.
//
// A shell block (a fence of sh, bash, shell, console or zsh) is preceded,
// on the nearest line that is not blank, by one of
//
//	<!-- exercised: TestName -->   run by that Go test (or by .ci/run)
//	<!-- illustrative: reason -->  not pasted as is, and why
//
// TestShellBlocksAreMarked fails on a block with neither, on an exercised
// block whose test does not exist, and on an illustrative one without a
// reason; each named test fails when it finds no block marked for it.
//
// GoBlocks finds the ```go blocks, which TestGoBlocksCompile compiles
// against the module's packages.
package docblocks

import (
	"bufio"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// CIScript is the name an exercised marker gives for the CI entry point,
// which runs `make demo` and `make test` itself.
const CIScript = ".ci/run"

// Block is one shell block of a page.
type Block struct {
	File string // the page, as named to Parse
	Line int    // 1-based line of the opening fence
	Lang string
	// Text is the block's content, without the fence's indentation (a
	// block inside a list item is indented).
	Text string
	// Exercised names the test that runs the block (or CIScript); empty
	// when the block is not marked so.
	Exercised string
	// Illustrative is the reason given for not exercising the block;
	// Marked reports whether either marker is present.
	Illustrative string
	Marked       bool
}

var (
	shellLangs = map[string]bool{"sh": true, "bash": true, "shell": true, "console": true, "zsh": true}
	fence      = regexp.MustCompile("^(\\s*)(```+|~~~+)\\s*([A-Za-z0-9_-]*)")
	marker     = regexp.MustCompile(`^\s*<!--\s*(exercised|illustrative)\s*:\s*(.*?)\s*-->\s*$`)
)

// Parse returns the shell blocks of the markdown file at path.
func Parse(path string) ([]Block, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return ParseText(path, string(b))
}

// ParseText is Parse of text, naming it file.
func ParseText(file, text string) ([]Block, error) {
	return parseFences(file, text, func(lang string) bool { return shellLangs[strings.ToLower(lang)] })
}

// GoBlocks returns the ```go blocks of the markdown file at path (their
// markers, if any, are ignored: every Go block is compiled).
func GoBlocks(path string) ([]Block, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return parseFences(path, string(b), func(lang string) bool { return lang == "go" })
}

// parseFences returns the fenced blocks of text whose language keep
// accepts, with the marker on the nearest non-blank line before each.
func parseFences(file, text string, keep func(lang string) bool) ([]Block, error) {
	var (
		blocks   []Block
		lastText string // the nearest non-blank line outside a block
		open     *Block
		indent   string
		closer   string
		body     []string
	)
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		m := fence.FindStringSubmatch(line)
		if open != nil || closer != "" {
			if m != nil && strings.HasPrefix(m[2], closer[:1]) && len(m[2]) >= len(closer) && m[3] == "" {
				if open != nil {
					open.Text = strings.Join(body, "\n") + "\n"
					blocks = append(blocks, *open)
				}
				open, closer, body = nil, "", nil
				lastText = line
				continue
			}
			if open != nil {
				body = append(body, strings.TrimPrefix(line, indent))
			}
			continue
		}
		if m != nil {
			closer = m[2]
			if keep(m[3]) {
				open = &Block{File: file, Line: n, Lang: m[3]}
				indent = m[1]
				if mm := marker.FindStringSubmatch(lastText); mm != nil {
					open.Marked = true
					if mm[1] == "exercised" {
						open.Exercised = mm[2]
					} else {
						open.Illustrative = mm[2]
					}
				}
			}
			continue
		}
		if strings.TrimSpace(line) != "" {
			lastText = line
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if closer != "" {
		return nil, fmt.Errorf("%s: a code block is not closed", file)
	}
	return blocks, nil
}

// Pages lists the documentation a user reads, under the repository root:
// README.md, the READMEs of deploy/ and examples/orders/, and every
// markdown file of docs/, sorted.
func Pages(root string) ([]string, error) {
	pages := []string{filepath.Join(root, "README.md"), filepath.Join(root, "deploy", "README.md"), filepath.Join(root, "examples", "orders", "README.md")}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			pages = append(pages, p)
		}
		return nil
	})
	sort.Strings(pages[3:])
	return pages, err
}

// Exercised returns the blocks of the pages under root that are marked as
// exercised by test, page by page, each page's in order.
func Exercised(root, test string) (map[string][]Block, error) {
	pages, err := Pages(root)
	if err != nil {
		return nil, err
	}
	out := map[string][]Block{}
	for _, p := range pages {
		bs, err := Parse(p)
		if err != nil {
			return nil, err
		}
		for _, b := range bs {
			if b.Exercised == test {
				out[p] = append(out[p], b)
			}
		}
	}
	return out, nil
}

// Commands returns the block's commands: its lines with comments and blank
// lines dropped and continuation lines (a trailing backslash) joined. It
// does not understand heredocs or quoting across lines: use it on blocks of
// one-line commands.
func Commands(text string) []string {
	var cmds []string
	cur := ""
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(stripComment(line))
		if line == "" && cur == "" {
			continue
		}
		if strings.HasSuffix(line, "\\") {
			cur += strings.TrimSpace(strings.TrimSuffix(line, "\\")) + " "
			continue
		}
		cur += line
		if cur = strings.TrimSpace(cur); cur != "" {
			cmds = append(cmds, cur)
		}
		cur = ""
	}
	if cur = strings.TrimSpace(cur); cur != "" {
		cmds = append(cmds, cur)
	}
	return cmds
}

// stripComment drops a shell comment: a # at the start of the line or
// after a blank, outside quotes.
func stripComment(line string) string {
	var quote rune
	prev := ' '
	for i, r := range line {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
		case r == '\'' || r == '"':
			quote = r
		case r == '#' && (prev == ' ' || prev == '\t'):
			return line[:i]
		}
		prev = r
	}
	return line
}
