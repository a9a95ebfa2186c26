package kafkacluster

import (
	_ "embed"
	"fmt"

	"github.com/walrelay/walrelay/test/mavencp"
)

// pom is the Maven project naming the broker's jars (Apache Kafka and a
// log4j binding). Embedded so that the classpath can be resolved from any
// working directory, and so that its hash keys the cache.
//
//go:embed pom.xml
var pom []byte

// project is the broker's Maven project; `make deps-kafka` resolves the
// same cache file.
var project = mavencp.Project{Name: "kafka", What: "the Kafka broker's jars", Pom: pom}

// ClasspathFile is where the broker's resolved classpath is cached (see
// mavencp.Project.File).
func ClasspathFile() (string, error) { return project.File() }

// Classpath returns the broker's Java classpath, resolving and caching it
// when needed. Its error names what to install when java or mvn is missing.
func Classpath() (string, error) {
	cp, err := project.Classpath()
	if err != nil && mavencp.Tools() != nil {
		return "", fmt.Errorf("the Apache Kafka broker needs java and mvn, or run the tests on kfake (unset WALRELAY_TEST_KAFKA): %w", err)
	}
	return cp, err
}
