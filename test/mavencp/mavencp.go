// Package mavencp fetches what an embedded Maven project (a pom.xml naming
// artifacts on Maven Central) names and caches it, for the test and
// benchmark infrastructure that runs Java programs: the classpath of jars
// (Classpath: Apache Kafka's broker in test/kafkacluster, Kafka Connect
// with Debezium in test/debezium), or a distribution archive unpacked
// (Unpack: Apicurio Registry in test/schemaregistry, Keycloak in
// test/keycloak). walrelay itself never needs Java.
//
// The cache lives under the user's cache directory and is named after the
// pom's hash, so a changed pom resolves again and an unchanged one never
// does; the Makefile's deps-* targets compute the same names with
// sha256sum.
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
	// Name prefixes the cache file or directory ("kafka", "apicurio").
	Name string
	// What names the jars or the archive in errors ("the Kafka broker's
	// jars", "Keycloak").
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

// Dir is where the project's archive is unpacked:
// <user cache dir>/walrelay/<Name>-<first 8 bytes of the pom's SHA-256, hex>.
func (p Project) Dir() (string, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("find the cache directory for %s (set XDG_CACHE_HOME): %w", p.What, err)
	}
	sum := sha256.Sum256(p.Pom)
	return filepath.Join(dir, "walrelay", p.Name+"-"+hex.EncodeToString(sum[:8])), nil
}

// Unpack returns found(Dir()), unpacking the archives the pom names into
// Dir first (Maven's dependency:unpack-dependencies, downloading into
// ~/.m2 if need be) when found does not find what it looks for there.
// found names the path wanted inside an unpacked directory, or says what
// is missing. The archive is unpacked beside Dir and renamed into place,
// so a process that finds Dir finds it whole.
func (p Project) Unpack(found func(dir string) (string, error)) (string, error) {
	dir, err := p.Dir()
	if err != nil {
		return "", err
	}
	if path, err := found(dir); err == nil {
		return path, nil
	}
	if _, err := exec.LookPath("mvn"); err != nil {
		return "", fmt.Errorf("mvn not found: the tests need Maven to fetch %s (apt-get install maven)", p.What)
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), p.Name+"-unpack-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	pomFile := filepath.Join(tmp, "pom.xml")
	if err := os.WriteFile(pomFile, p.Pom, 0o644); err != nil {
		return "", err
	}
	out := filepath.Join(tmp, "app")
	cmd := exec.Command("mvn", "-q", "-B", "-f", pomFile, "dependency:unpack-dependencies", "-DoutputDirectory="+out)
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("unpack %s with Maven (is Maven Central reachable?): %w\n%s", p.What, err, log.String())
	}
	if _, err := found(out); err != nil {
		return "", fmt.Errorf("the archive of %s unpacked: %w", p.What, err)
	}
	if err := os.Rename(out, dir); err != nil {
		if _, err2 := found(dir); err2 != nil { // (another process may have unpacked it meanwhile)
			return "", err
		}
	}
	return found(dir)
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
