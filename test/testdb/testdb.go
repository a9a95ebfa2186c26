// Package testdb gives a test a database of its own on a throwaway
// PostgreSQL cluster (internal/devcluster): the integration tests' and the
// relay's tests of what it asks the server.
package testdb

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walrelay/walrelay/internal/devcluster"
)

var (
	seq     atomic.Int64
	nonWord = regexp.MustCompile(`[^a-z0-9_]+`)
)

// Create creates a database on the server of adminURL for t and returns
// its name and URL. The name is prefix, a number unique in the test binary
// and t's name in lower case cut to maxName characters; it names the
// test's slot too, so it is a valid slot name. When the test ends the
// database's replication slots are dropped, so that the cluster keeps no
// WAL for them nor names them to later tests: a walsender still holding
// one (a relay stopped a moment ago) is ended first.
func Create(t testing.TB, ctx context.Context, adminURL, prefix string, maxName int) (name, url string) {
	t.Helper()
	name = nonWord.ReplaceAllString(strings.ToLower(t.Name()), "_")
	if len(name) > maxName {
		name = name[:maxName]
	}
	name = fmt.Sprintf("%s%d_%s", prefix, seq.Add(1), name)
	url, err := devcluster.CreateDatabase(ctx, adminURL, name)
	if err != nil {
		t.Fatalf("create database: %v", err)
	}
	t.Cleanup(func() { dropSlots(url, name) })
	return name, url
}

// dropSlots drops the replication slots of database db.
func dropSlots(url, db string) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active", db)
	_ = devcluster.WaitFor(10*time.Second, 20*time.Millisecond, func() (bool, error) {
		var active int
		err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE database = $1 AND active", db).Scan(&active)
		return active == 0, err
	})
	_, _ = conn.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active", db)
}
