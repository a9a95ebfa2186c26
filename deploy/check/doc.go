// Package check validates walrelay's operator assets: the Prometheus
// alerting rules in ../prometheus, the Grafana dashboard in ../grafana, the
// Helm chart in ../helm/walrelay (linted and rendered with helm, every
// object decoded strictly with the Kubernetes API types) and the systemd
// unit in ../systemd. It is a separate module so that the Prometheus and
// Kubernetes dependencies it needs stay out of walrelay's own go.mod. Run
// it with `make test-deploy` from the repository root (which installs helm
// and passes it with the walrelay binary), or `go test ./...` here, which
// skips what needs a missing helm or systemd-analyze.
package check
