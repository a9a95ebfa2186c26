package relay

import (
	"go/ast"
	"go/parser"
	"go/token"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
)

// TestConfigFieldsNameTheirDefault keeps the rule the Config doc states:
// each field's documentation names its default.
func TestConfigFieldsNameTheirDefault(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "config.go", nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	var fields *ast.FieldList
	ast.Inspect(f, func(n ast.Node) bool {
		if ts, ok := n.(*ast.TypeSpec); ok && ts.Name.Name == "Config" {
			fields = ts.Type.(*ast.StructType).Fields
		}
		return fields == nil
	})
	if fields == nil || len(fields.List) < 20 {
		t.Fatalf("found no Config struct with its fields in config.go")
	}
	// A doc comment may cover the fields declared right after it without
	// one of their own (Linger and Compression, the Txn* fields).
	doc := ""
	for _, fl := range fields.List {
		if fl.Doc != nil {
			doc = fl.Doc.Text()
		}
		for _, name := range fl.Names {
			if !strings.Contains(strings.ToLower(doc), "default") {
				t.Errorf("the doc of Config.%s does not name its default", name.Name)
			}
		}
	}
}

// TestZeroMeansZero: a zero in Config is the value it says, not a stand-in
// for a default. A literal Config (not started from DefaultConfig) is
// refused, naming the field and its default, rather than run with other
// values than the daemon's.
func TestZeroMeansZero(t *testing.T) {
	literal := Config{
		Slot: "walrelay", Publication: "walrelay_outbox",
		Tables:  []decoder.Table{{Schema: "public", Name: "outbox"}},
		Mapping: decoder.DefaultMapping(),
	}
	_, err := New(literal, zap.NewNop(), metrics.NewUnregistered())
	if err == nil || !strings.Contains(err.Error(), "relay.Config.StatusInterval") || !strings.Contains(err.Error(), "10s") {
		t.Fatalf("New(a Config literal) = %v; want a refusal naming relay.Config.StatusInterval and its default 10s", err)
	}

	for _, tc := range []struct {
		name   string
		change func(*Config)
		err    string
	}{
		{"no shutdown timeout", func(c *Config) { c.ShutdownTimeout = 0 }, "relay.Config.ShutdownTimeout"},
		{"no receive timeout", func(c *Config) { c.ReceiveTimeout = 0 }, "relay.Config.ReceiveTimeout"},
		{"no slot poll interval", func(c *Config) { c.SlotPollInterval = 0 }, "relay.Config.SlotPollInterval"},
		{"backoff max under min", func(c *Config) { c.BackoffMin, c.BackoffMax = time.Second, time.Millisecond }, "relay.Config.BackoffMax"},
		{"negative confirm delay", func(c *Config) { c.ConfirmDelay = -time.Second }, "relay.Config.ConfirmDelay"},
		{"negative linger", func(c *Config) { c.Linger = -time.Second }, "relay.Config.Linger"},
		{"no record schema", func(c *Config) { c.RecordSchema = "" }, "relay.Config.RecordSchema"},
		{"exactly-once without an event bound", func(c *Config) { c.ExactlyOnce, c.TxnMaxEvents = true, 0 }, "relay.Config.TxnMaxEvents"},
		{"exactly-once without a commit interval", func(c *Config) { c.ExactlyOnce, c.TxnMaxInterval = true, 0 }, "relay.Config.TxnMaxInterval"},
		{"at once", func(c *Config) { c.ConfirmDelay, c.Linger, c.TxnMinInterval = 0, 0, 0 }, ""},
		{"nothing optional", func(c *Config) {
			c.HeartbeatInterval, c.ReadyMaxLag, c.StartupTimeout, c.Read.MaxMessageBytes, c.Read.Coalesce = 0, 0, 0, 0, 0
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			tc.change(&cfg)
			_, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("New: %v", err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("New = %v; want an error naming %s", err, tc.err)
			}
		})
	}
}

// TestReadyMaxLagZeroDisables: 0 disables the lag check, as on the command
// line (--ready-max-lag 0); the default fails readiness past 60s.
func TestReadyMaxLagZeroDisables(t *testing.T) {
	for _, tc := range []struct {
		max   time.Duration
		ready bool
	}{{DefaultConfig().ReadyMaxLag, false}, {0, true}, {-1, true}, {2 * time.Hour, true}} {
		cfg := DefaultConfig()
		cfg.ReadyMaxLag = tc.max
		r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
		if err != nil {
			t.Fatal(err)
		}
		r.live.streaming.Store(true)
		r.live.lag.Store(int64(time.Hour))
		if err := r.Ready(); (err == nil) != tc.ready {
			t.Errorf("ReadyMaxLag %s, lag 1h: Ready() = %v, want ready %v", tc.max, err, tc.ready)
		}
	}
}

// TestKafkaDefaultsComeFirst: New gives the producer the client id, Linger
// and Compression, and an option of KafkaOptions still wins over them.
func TestKafkaDefaultsComeFirst(t *testing.T) {
	client := func(cfg Config) *kgo.Client {
		t.Helper()
		r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
		if err != nil {
			t.Fatal(err)
		}
		cl, err := kgo.NewClient(r.cfg.KafkaOptions...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		return cl
	}
	cl := client(DefaultConfig())
	if got := cl.OptValue(kgo.ProducerLinger); got != 5*time.Millisecond {
		t.Errorf("linger %v, want DefaultConfig's 5ms", got)
	}
	if got := cl.OptValue(kgo.ClientID); got != "walrelay" {
		t.Errorf("client id %v, want walrelay", got)
	}
	if got, ok := cl.OptValue(kgo.ProducerBatchCompression).([]kgo.CompressionCodec); !ok || len(got) != 1 || got[0] != kgo.NoCompression() {
		t.Errorf("compression %v, want none", cl.OptValue(kgo.ProducerBatchCompression))
	}
	cfg := DefaultConfig()
	cfg.Linger, cfg.Compression = 0, kgo.ZstdCompression()
	cfg.KafkaOptions = []kgo.Opt{kgo.ClientID("mine")}
	cl = client(cfg)
	if cl.OptValue(kgo.ProducerLinger) != time.Duration(0) || cl.OptValue(kgo.ClientID) != "mine" {
		t.Errorf("linger %v, client id %v; want 0 and mine", cl.OptValue(kgo.ProducerLinger), cl.OptValue(kgo.ClientID))
	}
	if got := cl.OptValue(kgo.ProducerBatchCompression).([]kgo.CompressionCodec); got[0] != kgo.ZstdCompression() {
		t.Errorf("compression %v, want zstd", got)
	}
}

// TestEveryNumericZero sets each numeric field of DefaultConfig (its
// router's, read options' and value formats' included) to zero in turn and checks the
// documented outcome: New refuses it with one line naming the field, or
// takes it as zero, never as a default it does not say.
func TestEveryNumericZero(t *testing.T) {
	refused := map[string]bool{
		"StatusInterval": true, "ShutdownTimeout": true, "BackoffMin": true, "BackoffMax": true,
		"SlotPollInterval": true, "ReceiveTimeout": true, "Read.BufferBytes": true,
		"Router.MaxTopics": true, "Router.TopicPartitions": true, "Router.TopicReplicationFactor": true,
		"Router.MaxInflightEvents": true, "Router.MaxInflightBytes": true, "Router.MaxRecordBytes": true,
		"Values.Refresh": true, "Values.Timeout": true, "Values.RetryPause": true,
		// Exactly-once's own (DefaultConfig is at-least-once: checked below).
	}
	eosRefused := map[string]bool{"TxnMaxEvents": true, "TxnMaxInterval": true, "Router.TransactionTimeout": true}
	seen := 0
	var walk func(prefix string, v reflect.Value, path []int)
	walk = func(prefix string, v reflect.Value, path []int) {
		for i := range v.NumField() {
			f := v.Type().Field(i)
			name := prefix + f.Name
			switch f.Type.Kind() {
			case reflect.Struct:
				if f.Name == "Read" || f.Name == "Router" || f.Name == "Values" {
					walk(name+".", v.Field(i), append(append([]int(nil), path...), i))
				}
				continue
			case reflect.Int, reflect.Int16, reflect.Int32, reflect.Int64:
			default:
				continue
			}
			seen++
			for _, eos := range []bool{false, true} {
				cfg := DefaultConfig()
				cfg.ExactlyOnce = eos
				fv := reflect.ValueOf(&cfg).Elem()
				for _, j := range path {
					fv = fv.Field(j)
				}
				fv.Field(i).SetZero()
				r, err := New(cfg, zap.NewNop(), metrics.NewUnregistered())
				want := refused[name] || eos && eosRefused[name]
				field := "relay.Config." + name
				if strings.HasPrefix(name, "Router.") {
					field = "router.Config." + f.Name
				}
				if strings.HasPrefix(name, "Values.") {
					field = "schema.Config." + f.Name
				}
				switch {
				case want && (err == nil || !strings.Contains(err.Error(), field) || !strings.Contains(err.Error(), "default")):
					t.Errorf("%s zero (exactly-once %v): New = %v, want a refusal naming %s and its default", name, eos, err, field)
				case !want && err != nil:
					t.Errorf("%s zero (exactly-once %v): New = %v, want it taken as zero", name, eos, err)
				case !want:
					got := reflect.ValueOf(r.cfg)
					for _, j := range path {
						got = got.Field(j)
					}
					if !got.Field(i).IsZero() {
						t.Errorf("%s zero (exactly-once %v): the relay runs with %v", name, eos, got.Field(i))
					}
				}
			}
		}
	}
	walk("", reflect.ValueOf(DefaultConfig()), nil)
	if seen < 25 {
		t.Fatalf("only %d numeric fields found", seen)
	}
}
