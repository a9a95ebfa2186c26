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
	"bytes"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
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
)

// pom is the Maven project naming the registry's archive; embedded so
// that its hash keys the cache.
//
//go:embed pom.xml
var pom []byte

// JavaEnv names a java binary (21 or later) to run the registry with,
// before Java looks for one.
const JavaEnv = "WALRELAY_REGISTRY_JAVA"

// Dir is where the registry's application is unpacked:
// <user cache dir>/walrelay/apicurio-<first 8 bytes of the pom's SHA-256, hex>.
func Dir() (string, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find the cache directory for the schema registry (set XDG_CACHE_HOME): %w", err)
	}
	sum := sha256.Sum256(pom)
	return filepath.Join(dir, "walrelay", "apicurio-"+hex.EncodeToString(sum[:8])), nil
}

// App returns the directory holding quarkus-run.jar, unpacking the
// registry's archive with Maven first when it is not there (downloading
// it into ~/.m2 if need be).
func App() (string, error) {
	dir, err := Dir()
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(filepath.Join(dir, "quarkus-run.jar")); err == nil {
		return dir, nil
	}
	if _, err := exec.LookPath("mvn"); err != nil {
		return "", errors.New("mvn not found: the schema registry's tests need Maven to fetch Apicurio Registry (apt-get install maven), or run make deps-schema-registry")
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), "apicurio-unpack-")
	if err != nil {
		if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
			return "", err
		}
		if tmp, err = os.MkdirTemp(filepath.Dir(dir), "apicurio-unpack-"); err != nil {
			return "", err
		}
	}
	defer os.RemoveAll(tmp)
	pomFile := filepath.Join(tmp, "pom.xml")
	if err := os.WriteFile(pomFile, pom, 0o644); err != nil {
		return "", err
	}
	out := filepath.Join(tmp, "app")
	cmd := exec.Command("mvn", "-q", "-B", "-f", pomFile, "dependency:unpack-dependencies", "-DoutputDirectory="+out)
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("unpack Apicurio Registry with Maven (is Maven Central reachable?): %w\n%s", err, log.String())
	}
	if _, err := os.Stat(filepath.Join(out, "quarkus-run.jar")); err != nil {
		return "", fmt.Errorf("schemaregistry: the Apicurio Registry archive holds no quarkus-run.jar: %w", err)
	}
	if err := os.Rename(out, dir); err != nil && !exists(filepath.Join(dir, "quarkus-run.jar")) {
		return "", err // (another process may have unpacked it meanwhile)
	}
	return dir, nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
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
