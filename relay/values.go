package relay

import (
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/schema"
)

// withValues gives cfg's router the record values cfg.Values describes:
// one schema.Values for the process, whose cache of schemas outlives the
// routers a relay replaces after a Kafka failure. It reports into the
// relay's board (cfg.Holds, which New sets first) while a subject's
// schema cannot be had and events wait for it. Nothing when every value goes as
// is, or when the embedder set Router.Values itself.
func withValues(cfg *Config, log *zap.Logger, m *metrics.Metrics) error {
	if cfg.Router.Values != nil || !cfg.Values.Active() {
		return nil
	}
	var opts []schema.Option
	if cfg.Holds != nil { // (none for PublishSnapshot: its failed reads are WARNs)
		opts = append(opts, schema.ReportHolds(cfg.Holds.Condition(holds.SchemaRegistry)))
	}
	v, err := schema.New(cfg.Values, log.Named("schema"), m, opts...)
	if err != nil {
		return err
	}
	cfg.Router.Values = v
	return nil
}
