// Package check validates walrelay's operator assets: the Prometheus
// alerting rules in ../prometheus and the Grafana dashboard in ../grafana.
// It is a separate module so that the Prometheus dependency it needs stays
// out of walrelay's own go.mod. Run it with `go test ./...` in this
// directory.
package check
