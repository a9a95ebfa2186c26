// Package schemaregistry starts a throwaway Apicurio Registry 3 (in-memory
// storage, loopback, free ports) for the integration tests of the value
// formats (package schema): a real registry speaking Confluent's REST API
// under /apis/ccompat/v7, the one franz-go's pkg/sr and Debezium's Avro
// converter talk to. It is test infrastructure only.
//
// The registry is Apicurio's Quarkus application as Maven Central carries
// it built (apicurio-registry-app's "all" archive, see pom.xml), unpacked
// once into the user's cache directory under a name keyed by the pom's
// hash (make deps-schema-registry does the same). It needs Java 21 or
// later: Java finds one.
package schemaregistry

import (
	"bufio"
	"context"
	_ "embed"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/walrelay/walrelay/test/mavencp"
)

// pom is the Maven project naming the registry's archive; embedded so
// that its hash keys the cache.
//
//go:embed pom.xml
var pom []byte

// JavaEnv names a java binary (21 or later) to run the registry with,
// before Java looks for one.
const JavaEnv = "WALRELAY_REGISTRY_JAVA"

// project is the registry's archive on Maven Central, unpacked into
// <user cache dir>/walrelay/apicurio-<first 8 bytes of the pom's SHA-256,
// hex> (make deps-schema-registry computes the same name).
var project = mavencp.Project{Name: "apicurio", What: "Apicurio Registry", Pom: pom}

// App returns the directory holding quarkus-run.jar, unpacking the
// registry's archive with Maven first when it is not there (downloading
// it into ~/.m2 if need be).
func App() (string, error) {
	return project.Unpack(func(dir string) (string, error) {
		if _, err := os.Stat(filepath.Join(dir, "quarkus-run.jar")); err != nil {
			return "", fmt.Errorf("no quarkus-run.jar: %w", err)
		}
		return dir, nil
	})
}

// Java returns a java binary of version 21 or later: $WALRELAY_REGISTRY_JAVA,
// else $JAVA_HOME's, else the one on PATH, else the newest JDK under
// /usr/lib/jvm (Debian's layout, where a second JDK sits beside the
// default one).
func Java() (string, error) {
	if j := os.Getenv(JavaEnv); j != "" {
		return j, nil
	}
	var candidates []string
	if h := os.Getenv("JAVA_HOME"); h != "" {
		candidates = append(candidates, filepath.Join(h, "bin", "java"))
	}
	if j, err := exec.LookPath("java"); err == nil {
		candidates = append(candidates, j)
	}
	homes, _ := filepath.Glob("/usr/lib/jvm/*/bin/java")
	candidates = append(candidates, homes...)
	best, bestVersion := "", 0
	for _, j := range candidates {
		if v := javaVersion(j); v >= 21 && (best == "" || v > bestVersion) {
			best, bestVersion = j, v
		}
	}
	if best == "" {
		return "", fmt.Errorf("no Java 21 or later found (Apicurio Registry 3 needs one): install one, or name its java in %s", JavaEnv)
	}
	return best, nil
}

var releaseVersion = regexp.MustCompile(`(?m)^JAVA_VERSION="(\d+)`)

// javaVersion is the feature version of the JDK java belongs to, read from
// the release file of its home (the binary's directory's parent, links
// resolved), or 0.
func javaVersion(java string) int {
	real, err := filepath.EvalSymlinks(java)
	if err != nil {
		return 0
	}
	b, err := os.ReadFile(filepath.Join(filepath.Dir(filepath.Dir(real)), "release"))
	if err != nil {
		return 0
	}
	m := releaseVersion.FindSubmatch(b)
	if m == nil {
		return 0
	}
	v, _ := strconv.Atoi(string(m[1]))
	return v
}

// Registry is a running Apicurio Registry.
type Registry struct {
	// URL is the base URL of its Confluent-compatible API
	// (http://127.0.0.1:<port>/apis/ccompat/v7).
	URL string
	// Log is the file the registry writes its output to.
	Log string

	cmd     *exec.Cmd
	exited  chan struct{}
	once    sync.Once
	tempDir string // the log's directory, when Start made it
}

// listening is the line Quarkus prints once the HTTP server is up.
var listening = regexp.MustCompile(`Listening on: (http://127\.0\.0\.1:\d+)`)

// Start starts a registry and waits until its API answers, or ctx ends. Its
// output goes to a file in logDir (a temporary directory when empty). The
// JVM dies with the test process (Pdeathsig).
func Start(ctx context.Context, logDir string) (*Registry, error) {
	app, err := App()
	if err != nil {
		return nil, err
	}
	java, err := Java()
	if err != nil {
		return nil, err
	}
	var tempDir string
	if logDir == "" {
		if logDir, err = os.MkdirTemp("", "walrelay-registry-"); err != nil {
			return nil, err
		}
		tempDir = logDir
	}
	r := &Registry{Log: filepath.Join(logDir, "apicurio.log"), exited: make(chan struct{}), tempDir: tempDir}
	out, err := os.Create(r.Log)
	if err != nil {
		return nil, err
	}
	pr, pw := io.Pipe()
	r.cmd = exec.Command(java,
		// A test registry: a small heap, the client compiler only and the
		// serial collector start it in about half the time on two cores.
		"-Xmx512m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError",
		// Loopback and free ports only, for the API and for Quarkus's
		// management interface alike; storage is Apicurio's default, H2 in
		// memory.
		"-Dquarkus.http.host=127.0.0.1", "-Dquarkus.http.port=0",
		"-Dquarkus.management.host=127.0.0.1", "-Dquarkus.management.port=0",
		"-Dquarkus.log.console.json=false",
		"-jar", filepath.Join(app, "quarkus-run.jar"))
	r.cmd.Dir = logDir
	r.cmd.Stdout = io.MultiWriter(out, pw)
	r.cmd.Stderr = out
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		out.Close()
		return nil, fmt.Errorf("start Apicurio Registry with %s: %w", java, err)
	}
	go func() {
		_ = r.cmd.Wait()
		pw.Close()
		out.Close()
		close(r.exited)
	}()
	base := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		found := false
		for sc.Scan() {
			if m := listening.FindStringSubmatch(sc.Text()); m != nil && !found {
				found = true
				base <- m[1]
			}
		}
		_, _ = io.Copy(io.Discard, pr) // keep the JVM's output flowing
	}()
	select {
	case b := <-base:
		r.URL = b + "/apis/ccompat/v7"
	case <-r.exited:
		return nil, fmt.Errorf("schemaregistry: Apicurio Registry exited before listening: %s", tail(r.Log))
	case <-ctx.Done():
		r.Close()
		return nil, fmt.Errorf("schemaregistry: Apicurio Registry not listening: %w (log: %s)", ctx.Err(), tail(r.Log))
	}
	for {
		resp, err := http.Get(r.URL + "/subjects")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return r, nil
			}
		}
		select {
		case <-r.exited:
			return nil, fmt.Errorf("schemaregistry: Apicurio Registry exited: %s", tail(r.Log))
		case <-ctx.Done():
			r.Close()
			return nil, fmt.Errorf("schemaregistry: Apicurio Registry's API not answering: %w (log: %s)", ctx.Err(), tail(r.Log))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Stop kills the registry and waits for it to exit; its log stays.
func (r *Registry) Stop() {
	r.once.Do(func() {
		_ = r.cmd.Process.Kill()
		<-r.exited
	})
}

// Close stops the registry and removes its log's directory when Start
// made it.
func (r *Registry) Close() {
	r.Stop()
	if r.tempDir != "" {
		os.RemoveAll(r.tempDir)
	}
}

// tail is the end of the log file, for an error.
func tail(file string) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return file + ":\n" + strings.Join(lines, "\n")
}
