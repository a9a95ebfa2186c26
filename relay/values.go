package relay

import (
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/schema"
)

// withValues gives cfg's router the record values cfg.Values describes:
// one schema.Values for the process, whose cache of schemas outlives the
// routers a relay replaces after a Kafka failure. Nothing when every value
// goes as is, or when the embedder set Router.Values itself.
func withValues(cfg *Config, log *zap.Logger, m *metrics.Metrics) error {
	if cfg.Router.Values != nil || !cfg.Values.Active() {
		return nil
	}
	v, err := schema.New(cfg.Values, log.Named("schema"), m)
	if err != nil {
		return err
	}
	cfg.Router.Values = v
	return nil
}
