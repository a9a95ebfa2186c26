package kafkacluster

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/test/testkit"
)

// needApache skips unless the tests were asked to run on Apache Kafka.
func needApache(t *testing.T) {
	t.Helper()
	testkit.NeedApache(t, os.Getenv("WALRELAY_TEST_KAFKA") == "apache")
}

func TestEscapeValue(t *testing.T) {
	got := escapeValue("-----BEGIN X-----\nab\\c\n-----END X-----\n")
	want := `-----BEGIN X-----\nab\\c\n-----END X-----\n`
	if got != want {
		t.Errorf("escapeValue = %q, want %q", got, want)
	}
}

// TestClusterIDNotAnOption: one id in 64 would start with '-' and make
// the storage tool fail with "expected one argument".
func TestClusterIDNotAnOption(t *testing.T) {
	for i := 0; i < 5000; i++ {
		if id := newClusterID(); len(id) != 22 || id[0] == '-' {
			t.Fatalf("cluster id %q", id)
		}
	}
}

// TestClasspathNamesTheBroker checks the cached classpath holds the broker,
// the Scala library and the log4j binding (without it the broker logs
// nothing).
func TestClasspathNamesTheBroker(t *testing.T) {
	needApache(t)
	cp, err := Classpath()
	if err != nil {
		t.Fatal(err)
	}
	for _, jar := range []string{"kafka_2.13-", "scala-library-", "log4j-slf4j-impl-", "log4j-core-"} {
		if !strings.Contains(cp, "/"+jar) {
			t.Errorf("classpath lacks %s*.jar: %s", jar, cp)
		}
	}
}

// TestKillRestart starts one node, writes a record, kills the node with
// SIGKILL, restarts it and reads the record back; the node logs to its
// server.log.
func TestKillRestart(t *testing.T) {
	needApache(t)
	ctx := context.Background()
	start := time.Now()
	c, err := Start(ctx, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	t.Logf("1-node cluster answered after %s", time.Since(start).Round(time.Millisecond))
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.Addrs()...), kgo.AllowAutoTopicCreation())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "t", Value: []byte("v")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	c.Kill(1)
	if c.Running(1) {
		t.Fatal("node 1 still running after Kill")
	}
	start = time.Now()
	if err := c.Restart(ctx, 1); err != nil {
		t.Fatal(err)
	}
	t.Logf("node restarted after kill -9 in %s", time.Since(start).Round(time.Millisecond))
	rd, err := kgo.NewClient(kgo.SeedBrokers(c.Addrs()...), kgo.ConsumeTopics("t"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	fs := rd.PollFetches(rctx)
	if err := fs.Err0(); err != nil {
		t.Fatal(err)
	}
	if recs := fs.Records(); len(recs) != 1 || string(recs[0].Value) != "v" {
		t.Fatalf("read %d records after restart, want the one written", len(recs))
	}
	log, err := os.ReadFile(c.Node(1).logFile())
	if err != nil || !strings.Contains(string(log), "Kafka Server started") && !strings.Contains(string(log), "started") {
		t.Errorf("server.log has no startup line (err %v): the log4j binding is missing?", err)
	}
}

// TestThreeNodes starts three nodes, stops one gracefully and restarts it.
func TestThreeNodes(t *testing.T) {
	needApache(t)
	ctx := context.Background()
	start := time.Now()
	c, err := Start(ctx, Options{Nodes: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	t.Logf("3-node cluster answered after %s", time.Since(start).Round(time.Millisecond))
	if err := c.Stop(2); err != nil {
		t.Fatal(err)
	}
	if err := c.Restart(ctx, 2); err != nil {
		t.Fatal(err)
	}
}
