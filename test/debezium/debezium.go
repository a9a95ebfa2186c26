// Package debezium runs Debezium's PostgreSQL connector with its Outbox
// Event Router on Kafka Connect standalone, the setup walrelay replaces, so
// that tests and the peer benchmark compare the two on the same
// PostgreSQL, broker and rows. It is test and benchmark infrastructure
// only: walrelay never needs Java.
//
// The jars come from Maven Central through the embedded pom.xml (see
// Classpath), a classpath of their own: Connect and Debezium pin their own
// Kafka client, apart from the broker's (test/kafkacluster).
package debezium

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/test/mavencp"
)

// pom names Kafka Connect, Debezium's PostgreSQL connector and a log4j
// binding; its hash keys the cached classpath.
//
//go:embed pom.xml
var pom []byte

// project is Connect's Maven project; `make deps-debezium` resolves the
// same cache file.
var project = mavencp.Project{Name: "debezium", What: "Debezium's and Kafka Connect's jars", Pom: pom}

// avroPom names Apicurio's AvroConverter (Options.AvroRegistryURL).
//
//go:embed avro.pom.xml
var avroPom []byte

// avroProject is the converter's Maven project; `make deps-debezium-avro`
// resolves the same cache file.
var avroProject = mavencp.Project{Name: "debezium-avro", What: "Apicurio's AvroConverter jars", Pom: avroPom}

// ClasspathFile is where Connect's resolved classpath is cached (see
// mavencp.Project.File).
func ClasspathFile() (string, error) { return project.File() }

// Available reports why Debezium cannot run here (java or mvn missing), or
// nil: the tests that need it skip on the reason.
func Available() error {
	if err := mavencp.Tools(); err != nil {
		return fmt.Errorf("the Debezium peer (Kafka Connect) needs java and mvn: %w", err)
	}
	return nil
}

// Classpath returns Connect's Java classpath: the cached one when every jar
// it names still exists, else one Maven resolves now (into ~/.m2) and
// caches.
func Classpath() (string, error) {
	cp, err := project.Classpath()
	if err != nil && mavencp.Tools() != nil {
		return "", fmt.Errorf("the Debezium peer (Kafka Connect) needs java and mvn: %w", err)
	}
	return cp, err
}

// Options configures Start.
type Options struct {
	// Brokers are the Kafka bootstrap servers.
	Brokers []string
	// PGURL is the source database; Debezium gets its host, port, user,
	// password and database (it always connects over TCP with a password).
	PGURL string
	// Slot and Publication are Debezium's; the publication must exist
	// (publication.autocreate.mode=disabled), the slot is created when
	// missing.
	Slot, Publication string
	// Tables are the outbox tables, schema.table.
	Tables []string
	// TopicReplacement is the EventRouter's route.topic.replacement; empty
	// keeps its default, outbox.event.${routedByValue}.
	TopicReplacement string
	// Worker and Connector are extra worker.properties and
	// connector.properties entries, over the defaults (tuning).
	Worker, Connector map[string]string
	// AvroRegistryURL, when set, is the base of an Apicurio Registry's v2
	// API (http://host:port/apis/registry/v2): values go through
	// Apicurio's AvroConverter, registering their schemas there under
	// <topic>-value in Confluent's framing (a 4-byte content id), and the
	// EventRouter expands JSON payloads into structs
	// (table.expand.json.payload), as Debezium's outbox documentation has
	// it for Avro.
	AvroRegistryURL string
	// HeapMB is the JVM's maximum heap (default 512).
	HeapMB int
	// Dir holds the properties files, the offsets file and connect.log;
	// empty makes a temporary one, removed by Close.
	Dir string
}

// Connect is a running Kafka Connect standalone worker with the connector.
type Connect struct {
	// Dir holds worker.properties, connector.properties, offsets and
	// connect.log.
	Dir     string
	opts    Options
	cp      string
	tempDir bool

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
}

// Start writes the worker and connector configuration and starts Connect.
// It returns once the JVM runs; the caller waits for what it needs (the
// slot active in pg_replication_slots, a record on a topic).
func Start(ctx context.Context, opts Options) (_ *Connect, err error) {
	if opts.HeapMB == 0 {
		opts.HeapMB = 512
	}
	cp, err := Classpath()
	if err != nil {
		return nil, err
	}
	if opts.AvroRegistryURL != "" {
		avro, err := avroProject.Classpath()
		if err != nil {
			return nil, err
		}
		cp += string(os.PathListSeparator) + avro
	}
	c := &Connect{Dir: opts.Dir, opts: opts, cp: cp}
	if c.Dir == "" {
		if c.Dir, err = os.MkdirTemp("", "walrelay-debezium-"); err != nil {
			return nil, err
		}
		c.tempDir = true
	} else if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	worker, connector, err := c.properties()
	if err != nil {
		return nil, err
	}
	for name, props := range map[string]map[string]string{"worker.properties": worker, "connector.properties": connector} {
		if err := os.WriteFile(filepath.Join(c.Dir, name), []byte(render(props)), 0o600); err != nil {
			return nil, err
		}
	}
	if err := os.WriteFile(filepath.Join(c.Dir, "log4j2.properties"), []byte(log4jConfig), 0o644); err != nil {
		return nil, err
	}
	return c, c.Restart()
}

// properties are the worker's and the connector's settings: Debezium's
// and the EventRouter's defaults but for what this setup needs.
func (c *Connect) properties() (worker, connector map[string]string, err error) {
	pg, err := pgconn.ParseConfig(c.opts.PGURL)
	if err != nil {
		return nil, nil, fmt.Errorf("debezium: parse the PostgreSQL URL: %w", err)
	}
	if strings.HasPrefix(pg.Host, "/") {
		// Debezium's JDBC driver connects over TCP only.
		pg.Host = "127.0.0.1"
	}
	rest, err := devcluster.FreePort()
	if err != nil {
		return nil, nil, err
	}
	worker = map[string]string{
		"bootstrap.servers": strings.Join(c.opts.Brokers, ","),
		// The key (aggregateid) and the string payloads as their text;
		// bytea payloads as their bytes: the converter Debezium's outbox
		// documentation names for binary payloads, delegating the rest.
		"key.converter":   "org.apache.kafka.connect.storage.StringConverter",
		"value.converter": "io.debezium.converters.BinaryDataConverter",
		"value.converter.delegate.converter.type": "org.apache.kafka.connect.storage.StringConverter",
		"offset.storage.file.filename":            filepath.Join(c.Dir, "offsets"),
		"plugin.discovery":                        "service_load",
		// The REST API on a port of its own: several workers share the
		// machine.
		"listeners": "http://127.0.0.1:" + strconv.Itoa(rest),
	}
	password := pg.Password
	if password == "" {
		// Debezium always sends one; trust authentication ignores it.
		password = "unused"
	}
	connector = map[string]string{
		"name":                        "walrelay-peer-" + c.opts.Slot,
		"connector.class":             "io.debezium.connector.postgresql.PostgresConnector",
		"tasks.max":                   "1",
		"plugin.name":                 "pgoutput",
		"database.hostname":           pg.Host,
		"database.port":               strconv.Itoa(int(pg.Port)),
		"database.user":               pg.User,
		"database.password":           password,
		"database.dbname":             pg.Database,
		"slot.name":                   c.opts.Slot,
		"publication.name":            c.opts.Publication,
		"publication.autocreate.mode": "disabled",
		"snapshot.mode":               "no_data",
		"table.include.list":          strings.Join(c.opts.Tables, ","),
		"topic.prefix":                c.opts.Slot,
		"transforms":                  "outbox",
		"transforms.outbox.type":      "io.debezium.transforms.outbox.EventRouter",
	}
	if c.opts.TopicReplacement != "" {
		connector["transforms.outbox.route.topic.replacement"] = c.opts.TopicReplacement
	}
	if u := c.opts.AvroRegistryURL; u != "" {
		connector["transforms.outbox.table.expand.json.payload"] = "true"
		for k, v := range map[string]string{
			"value.converter":                                 "io.apicurio.registry.utils.converter.AvroConverter",
			"value.converter.apicurio.registry.url":           u,
			"value.converter.apicurio.registry.auto-register": "true",
			// Confluent's framing: the id in the value (not in headers),
			// 4 bytes, and the content id, which is what the registry's
			// Confluent-compatible API calls a schema's id.
			"value.converter.apicurio.registry.as-confluent":    "true",
			"value.converter.apicurio.registry.headers.enabled": "false",
			"value.converter.apicurio.registry.use-id":          "contentId",
		} {
			worker[k] = v
		}
		delete(worker, "value.converter.delegate.converter.type")
	}
	for k, v := range c.opts.Worker {
		worker[k] = v
	}
	for k, v := range c.opts.Connector {
		connector[k] = v
	}
	return worker, connector, nil
}

// SetConnector changes or adds connector.properties entries, as an
// operator edits the connector's configuration; they take effect at the
// next Restart, with the same offsets file.
func (c *Connect) SetConnector(props map[string]string) error {
	if c.opts.Connector == nil {
		c.opts.Connector = map[string]string{}
	}
	for k, v := range props {
		c.opts.Connector[k] = v
	}
	_, connector, err := c.properties()
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(c.Dir, "connector.properties"), []byte(render(connector)), 0o600)
}

// Restart starts Connect (again, after Stop or Kill) with the same
// configuration and offsets file.
func (c *Connect) Restart() error {
	if c.Running() {
		return errors.New("debezium: Connect is running; stop or kill it first")
	}
	logf, err := os.OpenFile(c.LogFile(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command("java",
		"-Xmx"+strconv.Itoa(c.opts.HeapMB)+"m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
		"-Dlog4j2.configurationFile="+filepath.Join(c.Dir, "log4j2.properties"),
		"-cp", c.cp,
		"org.apache.kafka.connect.cli.ConnectStandalone",
		filepath.Join(c.Dir, "worker.properties"), filepath.Join(c.Dir, "connector.properties"))
	cmd.Dir = c.Dir
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group, so that a test's interrupt does not reach it
	// before Close.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("debezium: start java: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(exited)
	}()
	c.mu.Lock()
	c.cmd, c.exited = cmd, exited
	c.mu.Unlock()
	return nil
}

// Running reports whether the JVM is alive.
func (c *Connect) Running() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd == nil {
		return false
	}
	select {
	case <-c.exited:
		return false
	default:
		return true
	}
}

// Pid is the JVM's process id (0 when it is not running).
func (c *Connect) Pid() int {
	if !c.Running() {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cmd.Process.Pid
}

// Stop stops Connect as an operator would (SIGTERM: the worker stops the
// task, commits its offsets and exits), killing it after timeout.
func (c *Connect) Stop(timeout time.Duration) error {
	c.mu.Lock()
	cmd, exited := c.cmd, c.exited
	c.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		return nil
	case <-time.After(timeout):
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("debezium: Connect did not stop within %s of SIGTERM; killed it (see %s)", timeout, c.LogFile())
	}
}

// Kill kills Connect at once (SIGKILL, as kill -9 would) and waits until
// the process is gone.
func (c *Connect) Kill() {
	c.mu.Lock()
	cmd, exited := c.cmd, c.exited
	c.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-exited
}

// Close kills Connect and removes its directory when Start made it.
func (c *Connect) Close() {
	c.Kill()
	if c.tempDir {
		os.RemoveAll(c.Dir)
	}
}

// LogFile is Connect's log (its stdout and stderr).
func (c *Connect) LogFile() string { return filepath.Join(c.Dir, "connect.log") }

// LogTail returns the last lines of Connect's log, for a failed test's
// message.
func (c *Connect) LogTail(lines int) string {
	b, err := os.ReadFile(c.LogFile())
	if err != nil {
		return err.Error()
	}
	ls := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(ls) > lines {
		ls = ls[len(ls)-lines:]
	}
	return strings.Join(ls, "\n")
}

// render writes properties sorted by key, one per line.
func render(props map[string]string) string {
	keys := make([]string, 0, len(props))
	for k := range props {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%s\n", k, strings.ReplaceAll(props[k], `\`, `\\`))
	}
	return b.String()
}

// log4jConfig: Connect's and Debezium's INFO lines (slot, offsets flushed,
// the EventRouter's warnings) explain a failed test.
const log4jConfig = `status = warn
appender.console.type = Console
appender.console.name = console
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.console.ref = console
logger.clients.name = org.apache.kafka.clients
logger.clients.level = warn
`
