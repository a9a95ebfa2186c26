// Package kafkacluster starts a throwaway Apache Kafka cluster (KRaft, one
// or three combined broker+controller nodes on loopback ports) for the
// integration tests that must see what the real broker does: transactions
// and fencing, the transaction coordinator, min.insync.replicas, leader
// elections, compaction, SASL and TLS listeners. It is test infrastructure
// only: walrelay itself is one Go binary and `walrelay dev` runs on kfake.
//
// The broker's jars come from Maven Central through the embedded pom.xml
// (see Classpath); Java 17 or later runs them.
package kafkacluster

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// Options configures Start.
type Options struct {
	// Nodes is the number of combined broker+controller nodes: 1 (the
	// default) or 3. With 3, internal topics get replication factor 3 and
	// min.insync.replicas 2.
	Nodes int
	// Settings are extra server.properties entries, applied over the
	// defaults (e.g. "auto.create.topics.enable": "false").
	Settings map[string]string
	// SCRAM adds a SASL_PLAINTEXT listener accepting SCRAM-SHA-256 and
	// SCRAM-SHA-512 (SASLAddrs); create users with AddSCRAMUser.
	SCRAM bool
	// TLS, when set, adds an SSL listener (TLSAddrs) serving this
	// certificate.
	TLS *TLS
	// Authorizer turns on Kafka's StandardAuthorizer (the KRaft ACL
	// authorizer) with allow.everyone.if.no.acl.found=false: a principal
	// may do only what an ACL grants it. The PLAINTEXT listeners'
	// principal, User:ANONYMOUS (inter-broker and controller traffic,
	// Admin, the tests' own clients), is a super user; the SCRAM users of
	// the SASL listener need ACLs (kadm's CreateACLs, DeleteACLs).
	Authorizer bool
	// OAuth, when set, adds a SASL_PLAINTEXT listener named OAUTH
	// (OAuthAddrs) accepting OAUTHBEARER tokens that Kafka's own OIDC
	// validator (OAuthBearerValidatorCallbackHandler) checks against a
	// JWKS URL.
	OAuth *OAuth
	// HeapMB is each node's maximum Java heap (default 512).
	HeapMB int
	// Dir holds the nodes' data and logs; empty makes a temporary one,
	// removed by Close unless KeepDir.
	Dir     string
	KeepDir bool
	// StartTimeout bounds the wait for every node to answer (default 3m:
	// the JVMs start slowly on a loaded machine).
	StartTimeout time.Duration
}

// OAuth configures the OAUTHBEARER listener.
type OAuth struct {
	// JWKSURL serves the issuer's signing keys
	// (sasl.oauthbearer.jwks.endpoint.url); it is also the allowed URL
	// (org.apache.kafka.sasl.oauthbearer.allowed.urls, which Kafka 4
	// requires).
	JWKSURL string
	// Issuer and Audience are what the tokens' iss and aud must be.
	Issuer, Audience string
	// MaxReauth is the broker's connections.max.reauth.ms (so every SASL
	// listener's, SCRAM's too): a session
	// ends at its token's expiry (or after this), and a client must
	// re-authenticate on the connection before then (KIP-368) or have it
	// closed. 0 leaves sessions unbounded.
	MaxReauth time.Duration
}

// TLS configures the SSL listener.
type TLS struct {
	// Cert is the server's certificate chain and private key; empty, Start
	// issues one for 127.0.0.1 from a throwaway CA (Cluster.CA).
	Cert tls.Certificate
	// ClientCAs, when set (PEM), makes the listener require client
	// certificates issued by them.
	ClientCAs []byte
}

// Cluster is a running Apache Kafka cluster.
type Cluster struct {
	// Dir holds log4j2.properties and one directory per node (its
	// server.properties, data and server.log).
	Dir string
	ID  string // the KRaft cluster id
	// CA is the PEM certificate of the throwaway CA that issued the SSL
	// listener's certificate, when Start issued it.
	CA    []byte
	nodes []*Node
	cp    string
	opts  Options
}

// Node is one broker+controller process.
type Node struct {
	ID             int // node.id, 1-based
	Dir            string
	Port           int // PLAINTEXT listener
	ControllerPort int
	SASLPort       int // SASL_PLAINTEXT listener, 0 without Options.SCRAM
	TLSPort        int // SSL listener, 0 without Options.TLS
	OAuthPort      int // OAUTH (SASL_PLAINTEXT, OAUTHBEARER) listener, 0 without Options.OAuth

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{} // closed when cmd has been waited for
}

// Start formats and starts a cluster and waits until every node answers
// metadata requests. On error nothing is left running.
func Start(ctx context.Context, opts Options) (_ *Cluster, err error) {
	if opts.Nodes == 0 {
		opts.Nodes = 1
	}
	if opts.Nodes < 1 {
		return nil, fmt.Errorf("kafkacluster: %d nodes; use 1 or 3", opts.Nodes)
	}
	if opts.HeapMB == 0 {
		opts.HeapMB = 512
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 3 * time.Minute
	}
	cp, err := Classpath()
	if err != nil {
		return nil, err
	}
	c := &Cluster{Dir: opts.Dir, cp: cp, opts: opts}
	if c.Dir == "" {
		if c.Dir, err = os.MkdirTemp("", "walrelay-kafka-"); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	c.ID = newClusterID()

	perNode := 2
	if opts.SCRAM {
		perNode++
	}
	if opts.TLS != nil {
		perNode++
	}
	if opts.OAuth != nil {
		perNode++
	}
	ports, err := freePorts(perNode * opts.Nodes)
	if err != nil {
		return nil, err
	}
	for i := 0; i < opts.Nodes; i++ {
		p := ports[i*perNode : (i+1)*perNode]
		n := &Node{ID: i + 1, Dir: filepath.Join(c.Dir, fmt.Sprintf("node%d", i+1)), Port: p[0], ControllerPort: p[1]}
		p = p[2:]
		if opts.SCRAM {
			n.SASLPort, p = p[0], p[1:]
		}
		if opts.TLS != nil {
			n.TLSPort, p = p[0], p[1:]
		}
		if opts.OAuth != nil {
			n.OAuthPort = p[0]
		}
		if err := os.MkdirAll(n.Dir, 0o755); err != nil {
			return nil, err
		}
		c.nodes = append(c.nodes, n)
	}
	if opts.TLS != nil && len(opts.TLS.Cert.Certificate) == 0 {
		t := *opts.TLS
		if t.Cert, c.CA, err = issue(); err != nil {
			return nil, err
		}
		c.opts.TLS = &t
	}
	if err := os.WriteFile(c.log4jFile(), []byte(log4jConfig), 0o644); err != nil {
		return nil, err
	}
	for _, n := range c.nodes {
		props, err := c.properties(n)
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(n.propsFile(), []byte(props), 0o600); err != nil {
			return nil, err
		}
	}
	// Format every node at once: each is a JVM start of a few seconds.
	errs := make(chan error, len(c.nodes))
	for _, n := range c.nodes {
		go func(n *Node) { errs <- c.format(ctx, n) }(n)
	}
	for range c.nodes {
		if e := <-errs; e != nil && err == nil {
			err = e
		}
	}
	if err != nil {
		return nil, err
	}
	for _, n := range c.nodes {
		if err := c.launch(n); err != nil {
			return nil, err
		}
	}
	if err := c.waitBrokers(ctx, opts.StartTimeout, c.nodes...); err != nil {
		return nil, err
	}
	return c, nil
}

// Nodes returns the cluster's nodes, in node.id order.
func (c *Cluster) Nodes() []*Node { return c.nodes }

// Node returns the node with node.id id (1-based).
func (c *Cluster) Node(id int) *Node { return c.nodes[id-1] }

// Addrs are the PLAINTEXT listeners' addresses, one per node.
func (c *Cluster) Addrs() []string {
	return c.addrs(func(n *Node) int { return n.Port })
}

// SASLAddrs are the SASL_PLAINTEXT (SCRAM) listeners' addresses.
func (c *Cluster) SASLAddrs() []string {
	return c.addrs(func(n *Node) int { return n.SASLPort })
}

// OAuthAddrs are the OAUTHBEARER listeners' addresses.
func (c *Cluster) OAuthAddrs() []string {
	return c.addrs(func(n *Node) int { return n.OAuthPort })
}

// TLSAddrs are the SSL listeners' addresses.
func (c *Cluster) TLSAddrs() []string {
	return c.addrs(func(n *Node) int { return n.TLSPort })
}

func (c *Cluster) addrs(port func(*Node) int) []string {
	var out []string
	for _, n := range c.nodes {
		out = append(out, net.JoinHostPort("127.0.0.1", strconv.Itoa(port(n))))
	}
	return out
}

// Admin returns an admin client on the PLAINTEXT listeners; the caller
// closes it.
func (c *Cluster) Admin(opts ...kgo.Opt) (*kadm.Client, error) {
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(c.Addrs()...)}, opts...)...)
	if err != nil {
		return nil, err
	}
	return kadm.NewClient(cl), nil
}

// AddSCRAMUser creates (or updates) a SCRAM user through the broker's admin
// API (AlterUserScramCredentials), as kafka-configs.sh does, and waits until
// the SASL listener accepts it.
func (c *Cluster) AddSCRAMUser(ctx context.Context, mechanism kadm.ScramMechanism, user, password string) error {
	adm, err := c.Admin()
	if err != nil {
		return err
	}
	defer adm.Close()
	res, err := adm.AlterUserSCRAMs(ctx, nil, []kadm.UpsertSCRAM{{User: user, Mechanism: mechanism, Iterations: 4096, Password: password}})
	if err != nil {
		return fmt.Errorf("create SCRAM user %s: %w", user, err)
	}
	if err := res.Error(); err != nil {
		return fmt.Errorf("create SCRAM user %s: %w", user, err)
	}
	// Every node applies the credential from the metadata log, each in its
	// own time: wait until each node's SASL listener accepts it.
	auth := scram.Auth{User: user, Pass: password}
	mech := auth.AsSha512Mechanism()
	if mechanism == kadm.ScramSha256 {
		mech = auth.AsSha256Mechanism()
	}
	for _, addr := range c.SASLAddrs() {
		err := waitFor(ctx, 30*time.Second, func() error {
			cl, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.SASL(mech), kgo.RetryTimeout(time.Second))
			if err != nil {
				return err
			}
			defer cl.Close()
			rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			return cl.Ping(rctx)
		})
		if err != nil {
			return fmt.Errorf("SCRAM user %s not accepted by %s: %w", user, addr, err)
		}
	}
	return nil
}

// Stop stops node id gracefully (SIGTERM: controlled shutdown), killing it
// after 60s.
func (c *Cluster) Stop(id int) error {
	n := c.Node(id)
	n.mu.Lock()
	cmd, exited := n.cmd, n.exited
	n.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		return nil
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("kafkacluster: node %d did not stop within 60s of SIGTERM; killed it (see %s)", id, n.logFile())
	}
}

// Kill kills node id at once (SIGKILL, as a crash or kill -9 would) and
// waits until the process is gone.
func (c *Cluster) Kill(id int) {
	n := c.Node(id)
	n.mu.Lock()
	cmd, exited := n.cmd, n.exited
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-exited
}

// Restart starts node id again (after Stop or Kill) on the same ports and
// data, and waits until the cluster lists it as a broker again.
func (c *Cluster) Restart(ctx context.Context, id int) error {
	n := c.Node(id)
	if n.running() {
		return fmt.Errorf("kafkacluster: node %d is running; stop or kill it first", id)
	}
	if err := c.launch(n); err != nil {
		return err
	}
	return c.waitBrokers(ctx, c.opts.StartTimeout, n)
}

// Pid is node id's process id (0 when it is not running), for measuring
// the broker's CPU.
func (c *Cluster) Pid(id int) int {
	n := c.Node(id)
	if !n.running() {
		return 0
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cmd.Process.Pid
}

// Running reports whether node id's process is alive.
func (c *Cluster) Running(id int) bool { return c.Node(id).running() }

// Close kills every node and removes the cluster's directory (unless
// Options.KeepDir or Options.Dir was given).
func (c *Cluster) Close() {
	for _, n := range c.nodes {
		c.Kill(n.ID)
	}
	if !c.opts.KeepDir && c.opts.Dir == "" {
		os.RemoveAll(c.Dir)
	}
}

// LogTail returns the last lines of every node's server.log, for the
// message of a failed test.
func (c *Cluster) LogTail(lines int) string {
	var b strings.Builder
	for _, n := range c.nodes {
		fmt.Fprintf(&b, "== node %d (%s)\n%s\n", n.ID, n.logFile(), tail(n.logFile(), lines))
	}
	return b.String()
}

func (n *Node) propsFile() string { return filepath.Join(n.Dir, "server.properties") }
func (n *Node) logFile() string   { return filepath.Join(n.Dir, "server.log") }

func (n *Node) running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil {
		return false
	}
	select {
	case <-n.exited:
		return false
	default:
		return true
	}
}

func (c *Cluster) log4jFile() string { return filepath.Join(c.Dir, "log4j2.properties") }

// log4jConfig sends each node's log to server.log in its directory:
// Kafka's INFO lines (elections, transactions, fencing) are what explains
// a failed test.
const log4jConfig = `status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.clients.name = org.apache.kafka.clients
logger.clients.level = warn
`

// properties is node n's server.properties.
func (c *Cluster) properties(n *Node) (string, error) {
	var voters []string
	for _, o := range c.nodes {
		voters = append(voters, fmt.Sprintf("%d@127.0.0.1:%d", o.ID, o.ControllerPort))
	}
	rf := len(c.nodes)
	if rf > 3 {
		rf = 3
	}
	minISR := 1
	if rf > 1 {
		minISR = 2
	}
	listeners := []string{fmt.Sprintf("PLAINTEXT://127.0.0.1:%d", n.Port)}
	protocols := []string{"PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"}
	if n.SASLPort != 0 {
		listeners = append(listeners, fmt.Sprintf("SASL_PLAINTEXT://127.0.0.1:%d", n.SASLPort))
		protocols = append(protocols, "SASL_PLAINTEXT:SASL_PLAINTEXT")
	}
	if n.TLSPort != 0 {
		listeners = append(listeners, fmt.Sprintf("SSL://127.0.0.1:%d", n.TLSPort))
		protocols = append(protocols, "SSL:SSL")
	}
	if n.OAuthPort != 0 {
		listeners = append(listeners, fmt.Sprintf("OAUTH://127.0.0.1:%d", n.OAuthPort))
		protocols = append(protocols, "OAUTH:SASL_PLAINTEXT")
	}
	p := map[string]string{
		"process.roles":                    "broker,controller",
		"node.id":                          strconv.Itoa(n.ID),
		"controller.quorum.voters":         strings.Join(voters, ","),
		"listeners":                        strings.Join(listeners, ",") + fmt.Sprintf(",CONTROLLER://127.0.0.1:%d", n.ControllerPort),
		"advertised.listeners":             strings.Join(listeners, ","),
		"listener.security.protocol.map":   strings.Join(protocols, ","),
		"controller.listener.names":        "CONTROLLER",
		"inter.broker.listener.name":       "PLAINTEXT",
		"log.dirs":                         filepath.Join(n.Dir, "data"),
		"num.partitions":                   "3",
		"default.replication.factor":       strconv.Itoa(rf),
		"offsets.topic.replication.factor": strconv.Itoa(rf),
		// Fewer internal partitions than the default 50: created on the
		// first group or transaction, each costs the test time.
		"offsets.topic.num.partitions":                     "5",
		"transaction.state.log.num.partitions":             "5",
		"transaction.state.log.replication.factor":         strconv.Itoa(rf),
		"transaction.state.log.min.isr":                    strconv.Itoa(minISR),
		"share.coordinator.state.topic.replication.factor": strconv.Itoa(rf),
		"share.coordinator.state.topic.min.isr":            strconv.Itoa(minISR),
		"group.initial.rebalance.delay.ms":                 "0",
		"controlled.shutdown.enable":                       "true",
		// A node restarted after kill -9 cannot register until its old
		// session expires (DUPLICATE_BROKER_REGISTRATION): 6s, not 9s.
		// Shorter makes nodes of a loaded machine fence each other.
		"broker.session.timeout.ms":    "6000",
		"broker.heartbeat.interval.ms": "1000",
	}
	if n.SASLPort != 0 {
		p["sasl.enabled.mechanisms"] = "SCRAM-SHA-256,SCRAM-SHA-512"
		for _, m := range []string{"scram-sha-256", "scram-sha-512"} {
			p["listener.name.sasl_plaintext."+m+".sasl.jaas.config"] = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
		}
	}
	if c.opts.Authorizer {
		p["authorizer.class.name"] = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
		p["super.users"] = "User:ANONYMOUS"
		p["allow.everyone.if.no.acl.found"] = "false"
	}
	if o := c.opts.OAuth; o != nil {
		const l = "listener.name.oauth."
		p[l+"sasl.enabled.mechanisms"] = "OAUTHBEARER"
		p[l+"oauthbearer.sasl.jaas.config"] = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;"
		p[l+"oauthbearer.sasl.server.callback.handler.class"] = "org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler"
		p["sasl.oauthbearer.jwks.endpoint.url"] = o.JWKSURL
		p["sasl.oauthbearer.expected.issuer"] = o.Issuer
		p["sasl.oauthbearer.expected.audience"] = o.Audience
		// A token is refused from the second it expires, not 30s later:
		// the tests see refreshes at the token's lifetime.
		p["sasl.oauthbearer.clock.skew.seconds"] = "0"
		if o.MaxReauth > 0 {
			// The broker-wide setting: the listener-prefixed one is not
			// read for this listener (the server log shows 0 then).
			p["connections.max.reauth.ms"] = strconv.FormatInt(o.MaxReauth.Milliseconds(), 10)
		}
	}
	if t := c.opts.TLS; t != nil {
		var chain []byte
		for _, der := range t.Cert.Certificate {
			chain = append(chain, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
		}
		key, err := x509.MarshalPKCS8PrivateKey(t.Cert.PrivateKey)
		if err != nil {
			return "", fmt.Errorf("kafkacluster: the TLS key: %w", err)
		}
		p["ssl.keystore.type"] = "PEM"
		p["ssl.keystore.certificate.chain"] = string(chain)
		p["ssl.keystore.key"] = string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key}))
		if len(t.ClientCAs) > 0 {
			p["ssl.truststore.type"] = "PEM"
			p["ssl.truststore.certificates"] = string(t.ClientCAs)
			p["ssl.client.auth"] = "required"
		}
	}
	for k, v := range c.opts.Settings {
		p[k] = v
	}
	keys := make([]string, 0, len(p))
	for k := range p {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%s\n", k, escapeValue(p[k]))
	}
	return b.String(), nil
}

// escapeValue escapes a java.util.Properties value: backslashes and line
// breaks (PEM blocks are multi-line).
func escapeValue(v string) string {
	return strings.NewReplacer(`\`, `\\`, "\n", `\n`, "\r", `\r`).Replace(v)
}

// format runs kafka-storage.sh format for node n.
func (c *Cluster) format(ctx context.Context, n *Node) error {
	cmd := exec.CommandContext(ctx, "java", "-Xmx256m", "-XX:TieredStopAtLevel=1", "-cp", c.cp,
		"-Dlog4j2.configurationFile="+c.log4jFile(), "-Dkafka.logs.dir="+n.Dir,
		"kafka.tools.StorageTool", "format", "-t", c.ID, "-c", n.propsFile())
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("kafkacluster: format node %d: %w\n%s", n.ID, err, out)
	}
	return nil
}

// launch starts node n's JVM. The process dies with the test binary
// (Pdeathsig), so a crashed test leaves no broker eating the CPU.
func (c *Cluster) launch(n *Node) error {
	out, err := os.OpenFile(filepath.Join(n.Dir, "stdout.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command("java",
		fmt.Sprintf("-Xms%dm", c.opts.HeapMB/2), fmt.Sprintf("-Xmx%dm", c.opts.HeapMB),
		"-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
		"-Dlog4j2.configurationFile="+c.log4jFile(), "-Dkafka.logs.dir="+n.Dir)
	if o := c.opts.OAuth; o != nil {
		cmd.Args = append(cmd.Args, "-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls="+o.JWKSURL)
	}
	cmd.Args = append(cmd.Args, "-cp", c.cp, "kafka.Kafka", n.propsFile())
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		out.Close()
		return fmt.Errorf("kafkacluster: start node %d: %w", n.ID, err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		out.Close()
		close(exited)
	}()
	n.mu.Lock()
	n.cmd, n.exited = cmd, exited
	n.mu.Unlock()
	return nil
}

// waitBrokers waits until each node of want answers a metadata request
// itself and lists itself as a broker: it is registered and unfenced. The
// node itself is asked, not the cluster: after a kill -9 the controller
// keeps the dead incarnation registered (and in every ISR) until its
// session expires, so the cluster's answer would say a restarted node is
// back before it is. It fails early when a node's process exits.
func (c *Cluster) waitBrokers(ctx context.Context, timeout time.Duration, want ...*Node) error {
	return waitFor(ctx, timeout, func() error {
		for _, n := range want {
			if !n.running() {
				return permanent{fmt.Errorf("kafkacluster: node %d exited while starting; its log ends:\n%s", n.ID, tail(n.logFile(), 30))}
			}
		}
		for _, n := range want {
			if err := n.answers(ctx); err != nil {
				return err
			}
		}
		return nil
	})
}

// answers asks node n alone (a client whose only seed it is, new each
// time, so that no other broker answers) for metadata listing n as a
// broker and an active controller.
func (n *Node) answers(ctx context.Context) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(net.JoinHostPort("127.0.0.1", strconv.Itoa(n.Port))),
		kgo.RetryTimeout(time.Second), kgo.DialTimeout(time.Second))
	if err != nil {
		return err
	}
	defer cl.Close()
	rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	m, err := kadm.NewClient(cl).BrokerMetadata(rctx)
	if err != nil {
		return fmt.Errorf("node %d: %w", n.ID, err)
	}
	for _, b := range m.Brokers {
		if b.NodeID == int32(n.ID) {
			if m.Controller < 0 {
				return fmt.Errorf("node %d: no active controller yet", n.ID)
			}
			return nil
		}
	}
	return fmt.Errorf("node %d answers but is not yet an unfenced broker (%d listed)", n.ID, len(m.Brokers))
}

// permanent marks an error that ends waitFor at once.
type permanent struct{ error }

// waitFor polls cond every 100ms until it returns nil, returns a permanent
// error, ctx ends or timeout passes (then it returns cond's last error).
func waitFor(ctx context.Context, timeout time.Duration, cond func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return nil
		}
		var p permanent
		if errors.As(err, &p) {
			return p.error
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kafkacluster: not ready after %s: %w", timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// newClusterID returns a random KRaft cluster id (16 bytes, base64url
// without padding) that, like Kafka's Uuid.randomUuid, never starts with
// '-': the storage tool would read it as an option.
func newClusterID() string {
	for {
		id := make([]byte, 16)
		rand.Read(id)
		if s := base64.RawURLEncoding.EncodeToString(id); s[0] != '-' {
			return s
		}
	}
}

// freePorts returns n distinct loopback ports that were free a moment ago
// (all held open at once, so none is returned twice).
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// tail returns the last n lines of file.
func tail(file string, n int) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
