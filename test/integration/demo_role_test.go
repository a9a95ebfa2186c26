package integration

import (
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestDemoRelayRoleStreams runs deploy/demo-relay-role.sql, which
// docker-compose.yml gives the demo database, and then the relay as that
// role with compose's settings (the defaults but the table): a row written
// before the start (the initial snapshot) and one after must arrive. The
// role is renamed for the test, since roles are the cluster's.
func TestDemoRelayRoleStreams(t *testing.T) {
	if pgCluster == nil {
		t.Skip("creates a cluster-wide role: needs the package's throwaway cluster, not WALRELAY_TEST_PG_URL")
	}
	e := newEnv(t)
	sql, err := os.ReadFile("../../deploy/demo-relay-role.sql")
	if err != nil {
		t.Fatal(err)
	}
	role := e.name + "_demo"
	renamed := regexp.MustCompile(`\b(ROLE|AUTHORIZATION|TO) walrelay\b`).ReplaceAllString(string(sql), "$1 "+role)
	if !strings.Contains(renamed, "ROLE "+role) {
		t.Fatalf("deploy/demo-relay-role.sql creates no role walrelay:\n%s", sql)
	}
	e.dropRoleAtEnd(role)
	e.exec(renamed)
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('order', 'before', 'created', '{}', 1)`)

	u, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, "walrelay-demo")
	c := e.consume()
	e.runBinary("run", "--pg-url", u.String(), "--brokers", strings.Join(e.brokers, ","), "--table", "public.outbox",
		"--slot", e.name, "--topic-template", e.topicPrefix()+"{aggregate_type}", "--dead-letter-topic", e.topicPrefix()+"dlq",
		"--metrics-addr", "", "--status-interval", "1s")
	e.waitFor("the slot streaming", 60*time.Second, func() (bool, error) {
		i, err := e.slotInfoErr()
		return err == nil && i.Active, err
	})
	e.exec(`INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, seq) VALUES ('order', 'after', 'created', '{}', 2)`)
	recs := c.waitIDs(2, 60*time.Second)
	keys := map[string]bool{}
	for _, r := range recs {
		keys[string(r.Key)] = true
	}
	if !keys["before"] || !keys["after"] {
		t.Fatalf("read keys %v, want before (the snapshot) and after (the stream)", keys)
	}
}
