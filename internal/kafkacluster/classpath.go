package kafkacluster

import (
	"bytes"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// pom is the Maven project naming the broker's jars (Apache Kafka and a
// log4j binding). Embedded so that the classpath can be resolved from any
// working directory, and so that its hash keys the cache.
//
//go:embed pom.xml
var pom []byte

// ClasspathFile is where the broker's resolved classpath is cached: under
// the user's cache directory, keyed by the first 8 bytes of pom.xml's
// SHA-256 (`make deps-kafka` computes the same name with sha256sum), so a
// changed pom resolves again and an unchanged one never does.
func ClasspathFile() (string, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find the cache directory for the Kafka classpath (set XDG_CACHE_HOME): %w", err)
	}
	sum := sha256.Sum256(pom)
	return filepath.Join(dir, "walrelay", "kafka-"+hex.EncodeToString(sum[:8])+".classpath"), nil
}

// Classpath returns the broker's Java classpath: the cached one when every
// jar it names still exists, else one Maven resolves now (downloading into
// the local repository, ~/.m2, if need be) and caches. Its error names what
// to install when java or mvn is missing.
func Classpath() (string, error) {
	file, err := ClasspathFile()
	if err != nil {
		return "", err
	}
	if cp, err := os.ReadFile(file); err == nil && complete(string(cp)) {
		return strings.TrimSpace(string(cp)), nil
	}
	for _, tool := range []string{"java", "mvn"} {
		if _, err := exec.LookPath(tool); err != nil {
			return "", fmt.Errorf("%s not found: the Apache Kafka broker needs OpenJDK 17 or later and Maven (apt-get install openjdk-17-jre-headless maven), or run the tests on kfake (unset WALRELAY_TEST_KAFKA)", tool)
		}
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return "", err
	}
	dir, err := os.MkdirTemp("", "walrelay-kafka-pom-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	pomFile := filepath.Join(dir, "pom.xml")
	if err := os.WriteFile(pomFile, pom, 0o644); err != nil {
		return "", err
	}
	tmp := file + ".tmp"
	cmd := exec.Command("mvn", "-q", "-B", "-f", pomFile, "dependency:build-classpath", "-Dmdep.outputFile="+tmp)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("resolve the Kafka broker's jars with Maven (is Maven Central reachable?): %w\n%s", err, out.String())
	}
	if err := os.Rename(tmp, file); err != nil {
		return "", err
	}
	cp, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	if !complete(string(cp)) {
		return "", errors.New("Maven resolved a classpath naming missing jars: remove " + file + " and retry")
	}
	return strings.TrimSpace(string(cp)), nil
}

// complete reports whether cp names jars that all exist (the local Maven
// repository may have been cleaned since it was cached).
func complete(cp string) bool {
	cp = strings.TrimSpace(cp)
	if cp == "" {
		return false
	}
	for _, jar := range filepath.SplitList(cp) {
		if _, err := os.Stat(jar); err != nil {
			return false
		}
	}
	return true
}
