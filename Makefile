# walrelay — common tasks. `make test` is what CI runs (through .ci/run).

GO      ?= go
PKGS    := ./...
BIN     := bin/walrelay
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)

.PHONY: all build test lint unit integration bench-micro fuzz demo clean deps deps-postgres deps-postgres-server

all: build

build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/walrelay

# Everything CI checks: formatting, vet, every test with the race detector
# (unit, fuzz seed corpus, integration against a throwaway PostgreSQL and
# an in-process Kafka-protocol broker), one pass of each benchmark, and the
# Grafana dashboard and Prometheus rules (deploy/check, its own module).
# deps first installs what the tests need beyond Go.
test: deps lint
	$(GO) test -race -count=1 -timeout 20m $(PKGS)
	$(GO) test -run '^$$' -bench . -benchtime 1x $(PKGS)
	cd deploy/check && $(GO) vet ./... && $(GO) test -count=1 ./...

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '^deploy/check/') deploy/check); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

unit:
	$(GO) test -race -count=1 ./decoder ./router ./checkpoint ./slot ./relay ./heartbeat ./metrics

integration:
	$(GO) test -race -count=1 -timeout 20m ./test/integration

bench-micro:
	$(GO) test -run '^$$' -bench . -benchmem ./decoder ./router ./checkpoint

# Fuzz the pgoutput decoder; new crashers land in decoder/testdata/fuzz.
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzDecode -fuzztime $${FUZZTIME:-2m} ./decoder

demo: deps-postgres-server build
	./$(BIN) dev --demo 10

# What the tests need beyond Go, installed when missing (apt-get, as root or
# with passwordless sudo; otherwise one line says what to run). One target
# per tool: add a new one (Maven dependencies of the real-broker tests, a
# CLI a test calls) to DEPS, and to .ci/run nothing.
DEPS := deps-postgres

deps: $(DEPS)

# PostgreSQL server (initdb, pg_ctl) and pg_recvlogical, the benchmark
# smoke test's baseline.
deps-postgres:
	@bash scripts/ensure-postgres --client --retry "make $(MAKECMDGOALS)"

# The server alone: all `walrelay dev` needs.
deps-postgres-server:
	@bash scripts/ensure-postgres --retry "make $(MAKECMDGOALS)"

clean:
	rm -rf bin
