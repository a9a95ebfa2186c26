package pgauth

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/credentials"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func TestSplitArgs(t *testing.T) {
	for in, want := range map[string][]string{
		`vault read -field=password db/creds/relay`: {"vault", "read", "-field=password", "db/creds/relay"},
		`sh -c 'cat /run/secrets/pg | tr -d x'`:     {"sh", "-c", "cat /run/secrets/pg | tr -d x"},
		`a "b c" d\ e ""`:                           {"a", "b c", "d e", ""},
	} {
		got, err := SplitArgs(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("SplitArgs(%s) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := SplitArgs(`a 'b`); err == nil {
		t.Error("unterminated quote accepted")
	}
}

// TestCommand: the command's output is the password, with the
// connection's PGHOST/PGPORT/PGUSER in its environment; a failing command
// is an error naming the source that holds no output, logged once per
// failing streak.
func TestCommand(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "pw")
	state := filepath.Join(dir, "fail")
	body := "#!/bin/sh\nif [ -e " + state + " ]; then echo 'leaked-S3CRET' >&2; echo 'leaked-S3CRET'; exit 3; fi\necho \"pw-$PGUSER@$PGHOST:$PGPORT\"\n"
	if err := os.WriteFile(script, []byte(body), 0o700); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	c := &Command{Argv: []string{script}, Log: zap.New(core)}
	pw, err := c.Password(context.Background(), "db.example", 5432, "relay")
	if err != nil || pw != "pw-relay@db.example:5432" {
		t.Fatalf("password %q, %v", pw, err)
	}
	if err := os.WriteFile(state, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		_, err = c.Password(context.Background(), "db.example", 5432, "relay")
		if err == nil || !strings.Contains(err.Error(), "exit status 3") || strings.Contains(err.Error(), "S3CRET") {
			t.Errorf("failing command: %v, want its exit status and nothing of its output", err)
		}
	}
	warns := logs.FilterLevelExact(zapcore.WarnLevel).All()
	if len(warns) != 1 || warns[0].ContextMap()["source"] != "pgauth.Command.Argv" {
		t.Errorf("WARN lines %v, want one naming the source", warns)
	}
	os.Remove(state)
	if _, err := c.Password(context.Background(), "db.example", 5432, "relay"); err != nil {
		t.Fatal(err)
	}
	if logs.FilterMessage("PostgreSQL password available again").Len() != 1 {
		t.Error("recovery not logged")
	}
	for _, e := range logs.All() {
		for k, v := range e.ContextMap() {
			if s, ok := v.(string); ok && strings.Contains(s, "S3CRET") {
				t.Errorf("log field %s holds the output", k)
			}
		}
	}
}

// TestCommandSlowSuccessKeepsTheStreak: a run that began before the
// source started failing and succeeds after a newer run failed does not
// end the failing streak (the newest run decides), so the failures after
// it do not WARN a second time. The relay asks the source from several
// connections at once (the stream, the publication watch, the heartbeat).
func TestCommandSlowSuccessKeepsTheStreak(t *testing.T) {
	dir := t.TempDir()
	script, fail, started, release := filepath.Join(dir, "pw"), filepath.Join(dir, "fail"), filepath.Join(dir, "started"), filepath.Join(dir, "release")
	// The first run (no fail file yet) says it started and waits for the
	// release; runs after the fail file exists fail at once.
	body := "#!/bin/sh\n[ -e " + fail + " ] && exit 1\ntouch " + started + "\nwhile [ ! -e " + release + " ]; do sleep 0.01; done\necho pw\n"
	if err := os.WriteFile(script, []byte(body), 0o700); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	c := &Command{Argv: []string{script}, Log: zap.New(core)}
	slow := make(chan error, 1)
	go func() {
		_, err := c.Password(context.Background(), "db", 5432, "relay")
		slow <- err
	}()
	waitFile(t, started)
	if err := os.WriteFile(fail, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Password(context.Background(), "db", 5432, "relay"); err == nil {
		t.Fatal("the failing run succeeded")
	}
	if err := os.WriteFile(release, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := <-slow; err != nil {
		t.Fatalf("the slow run: %v", err)
	}
	if _, err := c.Password(context.Background(), "db", 5432, "relay"); err == nil {
		t.Fatal("the failing run succeeded")
	}
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 1 {
		t.Errorf("%d WARN lines for one failing streak, want 1", n)
	}
	if logs.FilterMessage("PostgreSQL password available again").Len() != 0 {
		t.Error("recovery logged for a run older than the failure")
	}
}

// waitFile waits until path exists.
func waitFile(t *testing.T, path string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never appeared", path)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestCommandHangs: a command that never answers fails at its Timeout
// (with the kill's WaitDelay), naming the timeout, and WARNs once for
// the streak of hung runs.
func TestCommandHangs(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "pw")
	if err := os.WriteFile(script, []byte("#!/bin/sh\nexec sleep 600\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	c := &Command{Argv: []string{script}, Timeout: 100 * time.Millisecond, Log: zap.New(core)}
	for range 2 {
		done := make(chan error, 1)
		go func() {
			_, err := c.Password(context.Background(), "db", 5432, "relay")
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), "did not finish within 100ms") {
				t.Errorf("hung command: %v, want an error naming its timeout", err)
			}
		case <-time.After(time.Minute): // a deadlock guard, not a timing assertion
			t.Fatal("Password did not return for a hung command")
		}
	}
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 1 {
		t.Errorf("%d WARN lines for two hung runs, want 1", n)
	}
}

// TestRDSIAMToken: a token is a presigned rds-db:connect URL for the host,
// port and user, signed for the region in the host name, with the access
// key id but never the secret key.
func TestRDSIAMToken(t *testing.T) {
	const secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
	r := &RDSIAM{Credentials: credentials.NewStaticCredentialsProvider("AKIDEXAMPLE", secret, "")}
	tok, err := r.Password(context.Background(), "mydb.abc123.eu-west-3.rds.amazonaws.com", 5432, "relay")
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse("https://" + tok)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	if u.Host != "mydb.abc123.eu-west-3.rds.amazonaws.com:5432" || q.Get("Action") != "connect" || q.Get("DBUser") != "relay" ||
		!strings.Contains(q.Get("X-Amz-Credential"), "AKIDEXAMPLE/") || !strings.Contains(q.Get("X-Amz-Credential"), "/eu-west-3/rds-db/") || q.Get("X-Amz-Signature") == "" {
		t.Errorf("token %s is not a presigned rds-db connect for the host and user", u.Redacted())
	}
	if strings.Contains(tok, secret) {
		t.Error("the token holds the secret key")
	}
	if _, err := r.Password(context.Background(), "10.0.0.5", 5432, "relay"); err == nil || !strings.Contains(err.Error(), "pgauth.RDSIAM.Region") {
		t.Errorf("no region anywhere: %v, want an error naming the region setting", err)
	}
}
