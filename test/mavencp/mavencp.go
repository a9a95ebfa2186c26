// Package mavencp resolves the Java classpath of an embedded Maven project
// (a pom.xml naming jars on Maven Central) and caches it, for the test and
// benchmark infrastructure that runs Java programs: Apache Kafka's broker
// (test/kafkacluster) and Kafka Connect with Debezium
// (test/debezium). walrelay itself never needs Java.
//
// The cache file lives under the user's cache directory and is named after
// the pom's hash, so a changed pom resolves again and an unchanged one never
// does; the Makefile's deps-* targets compute the same name with sha256sum.
package mavencp

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Project is one embedded Maven project.
type Project struct {
	// Name prefixes the cache file ("kafka", "debezium").
	Name string
	// What names the jars in errors ("the Kafka broker's jars").
	What string
	// Pom is the pom.xml's content.
	Pom []byte
}

// File is where the project's resolved classpath is cached:
// <user cache dir>/walrelay/<Name>-<first 8 bytes of the pom's SHA-256, hex>.classpath.
func (p Project) File() (string, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find the cache directory for the %s classpath (set XDG_CACHE_HOME): %w", p.Name, err)
	}
	sum := sha256.Sum256(p.Pom)
	return filepath.Join(dir, "walrelay", p.Name+"-"+hex.EncodeToString(sum[:8])+".classpath"), nil
}

// Tools reports which of java and mvn is missing, or nil.
func Tools() error {
	for _, tool := range []string{"java", "mvn"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s not found: install OpenJDK 17 or later and Maven (apt-get install openjdk-17-jre-headless maven)", tool)
		}
	}
	return nil
}

// Classpath returns the project's classpath: the cached one when every jar
// it names still exists (the local repository, ~/.m2, may have been cleaned
// since), else one Maven resolves now (downloading into ~/.m2 if need be)
// and caches.
func (p Project) Classpath() (string, error) {
	file, err := p.File()
	if err != nil {
		return "", err
	}
	if cp, err := os.ReadFile(file); err == nil && complete(string(cp)) {
		return strings.TrimSpace(string(cp)), nil
	}
	if err := Tools(); err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return "", err
	}
	dir, err := os.MkdirTemp("", "walrelay-"+p.Name+"-pom-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	pomFile := filepath.Join(dir, "pom.xml")
	if err := os.WriteFile(pomFile, p.Pom, 0o644); err != nil {
		return "", err
	}
	tmp := file + ".tmp"
	cmd := exec.Command("mvn", "-q", "-B", "-f", pomFile, "dependency:build-classpath", "-Dmdep.outputFile="+tmp)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("resolve %s with Maven (is Maven Central reachable?): %w\n%s", p.What, err, out.String())
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

// complete reports whether cp names jars that all exist.
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
