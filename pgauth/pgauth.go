// Package pgauth gives PostgreSQL connections credentials that expire:
// the output of a command run at each connection (Command: Vault, a cloud
// CLI, a sidecar's helper) and Amazon RDS/Aurora IAM authentication tokens
// (RDSIAM). Each is a slot.PasswordSource: walrelay asks it at every
// connection it opens, so a token valid 15 minutes never needs a restart.
//
// A password never appears in an error or a log line of this package; a
// source that fails is logged at WARN once, naming itself, until it gives
// a password again.
package pgauth

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"

	"go.uber.org/zap"
)

// Command runs a program at each connection and uses what it prints on
// standard output (without the line break at its end) as the password. It
// runs without a shell, with walrelay's environment plus PGHOST, PGPORT
// and PGUSER of the connection; its standard error is not logged (it
// might echo a secret): run it by hand to see why it fails.
type Command struct {
	// Argv is the program and its arguments.
	Argv []string
	// Timeout bounds each run (default 30s).
	Timeout time.Duration
	// Log receives the WARN of a failing command.
	Log *zap.Logger

	warnOnce
}

// maxOutput bounds what is read of the command's output: a password or a
// token is a few kilobytes at most.
const maxOutput = 64 << 10

// Password runs the command.
func (c *Command) Password(ctx context.Context, host string, port uint16, user string) (string, error) {
	if len(c.Argv) == 0 {
		return "", errors.New("pgauth.Command.Argv is empty")
	}
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.Argv[0], c.Argv[1:]...)
	cmd.Env = append(os.Environ(), "PGHOST="+host, "PGPORT="+strconv.Itoa(int(port)), "PGUSER="+user)
	var out limitedBuffer
	cmd.Stdout = &out
	cmd.WaitDelay = time.Second
	run := c.begin()
	err := cmd.Run()
	switch {
	case ctx.Err() == context.DeadlineExceeded:
		err = fmt.Errorf("%s did not finish within %s", c.Argv[0], timeout)
	case err != nil:
		// ExitError prints "exit status N"; a start failure names the
		// program. Neither holds the output.
		err = fmt.Errorf("%s: %w", c.Argv[0], err)
	case out.over:
		err = fmt.Errorf("%s printed more than %d bytes: not a password", c.Argv[0], maxOutput)
	}
	pw := strings.TrimRight(out.String(), "\r\n")
	if err == nil && pw == "" {
		err = fmt.Errorf("%s printed nothing", c.Argv[0])
	}
	if err != nil {
		if ctx.Err() == nil || ctx.Err() == context.DeadlineExceeded {
			c.failed(run, c.Log, c, err)
		}
		return "", err
	}
	c.succeeded(run, c.Log, c)
	return pw, nil
}

// String names the source.
func (c *Command) String() string { return "pgauth.Command.Argv" }

// limitedBuffer keeps the first maxOutput bytes written to it.
type limitedBuffer struct {
	bytes.Buffer
	over bool
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := maxOutput - b.Len(); len(p) > room {
		b.over = true
		if room > 0 {
			b.Buffer.Write(p[:room])
		}
		return len(p), nil
	}
	return b.Buffer.Write(p)
}

// warnOnce logs a source's failure at WARN once per failing streak, and
// its recovery at INFO. Connections ask the source concurrently (the
// stream, the publication watch, the heartbeat), so an answer can arrive
// after a newer one: the run begun last decides whether the source is
// failing. A slow success begun before a failure would otherwise end the
// streak it predates, and the next failure would WARN again.
type warnOnce struct {
	mu      sync.Mutex
	runs    uint64 // runs begun
	decided uint64 // the newest run whose outcome counted
	failing bool
}

// begin numbers a run of the source; its outcome is reported with it.
func (w *warnOnce) begin() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.runs++
	return w.runs
}

// newest reports whether run is newer than every run already decided,
// recording it as decided; w.mu is held.
func (w *warnOnce) newest(run uint64) bool {
	if run <= w.decided {
		return false
	}
	w.decided = run
	return true
}

func (w *warnOnce) failed(run uint64, log *zap.Logger, src fmt.Stringer, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.newest(run) {
		return
	}
	if w.failing || log == nil {
		w.failing = true
		return
	}
	w.failing = true
	log.Warn("no PostgreSQL password from its source: connections wait for it, retried with backoff", zap.String("source", src.String()), zap.Error(err))
}

func (w *warnOnce) succeeded(run uint64, log *zap.Logger, src fmt.Stringer) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.newest(run) {
		return
	}
	if w.failing && log != nil {
		log.Info("PostgreSQL password available again", zap.String("source", src.String()))
	}
	w.failing = false
}

// SplitArgs splits a command line into words as a POSIX shell would,
// without its expansions: blanks separate words, single quotes keep
// everything, double quotes keep all but \" and \\, a backslash escapes
// the next character outside quotes.
func SplitArgs(s string) ([]string, error) {
	var (
		args    []string
		cur     strings.Builder
		inWord  bool
		quote   rune
		escaped bool
	)
	for _, r := range s {
		switch {
		case escaped:
			cur.WriteRune(r)
			escaped = false
		case quote == '\'':
			if r == '\'' {
				quote = 0
			} else {
				cur.WriteRune(r)
			}
		case quote == '"':
			switch r {
			case '"':
				quote = 0
			case '\\':
				escaped = true
			default:
				cur.WriteRune(r)
			}
		case r == '\\':
			escaped, inWord = true, true
		case r == '\'' || r == '"':
			quote, inWord = r, true
		case unicode.IsSpace(r):
			if inWord {
				args = append(args, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quote != 0 || escaped {
		return nil, errors.New("an unterminated quote or a trailing backslash")
	}
	if inWord {
		args = append(args, cur.String())
	}
	return args, nil
}
