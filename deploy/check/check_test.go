package check

import (
	"encoding/json"
	"fmt"
	"go/format"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

const (
	alertsFile    = "../prometheus/alerts.yml"
	dashboardFile = "../grafana/walrelay.json"
	metricsFile   = "../../metrics/metrics.go"
)

// metricKind is how a metric may be queried.
type metricKind int

const (
	counter metricKind = iota
	gauge
	histogram
)

// knownMetrics is the authoritative list of walrelay's public metric names.
// Names defined in metrics.go are accepted too (see definedMetrics), so a
// metric added there does not need to be listed here first; a name in
// neither place is a typo or a metric that does not exist.
var knownMetrics = map[string]metricKind{
	"walrelay_events_published_total":       counter,
	"walrelay_events_dead_lettered_total":   counter,
	"walrelay_transactions_total":           counter,
	"walrelay_produce_errors_total":         counter,
	"walrelay_stream_restarts_total":        counter,
	"walrelay_standby_status_updates_total": counter,
	"walrelay_received_bytes_total":         counter,
	"walrelay_heartbeats_total":             counter,
	"walrelay_received_lsn":                 gauge,
	"walrelay_confirmed_lsn":                gauge,
	"walrelay_server_wal_end_lsn":           gauge,
	"walrelay_slot_retained_wal_bytes":      gauge,
	"walrelay_slot_lag_bytes":               gauge,
	"walrelay_slot_safe_wal_size_bytes":     gauge,
	"walrelay_slot_wal_status":              gauge,
	"walrelay_replication_lag_seconds":      gauge,
	"walrelay_commit_to_ack_seconds":        histogram,
	"walrelay_inflight_events":              gauge,
	"walrelay_streaming":                    gauge,
	"walrelay_ready":                        gauge,
}

// requiredAlerts must exist in alerts.yml.
var requiredAlerts = []string{
	"WalrelaySlotLagHigh",
	"WalrelayRetainedWALHigh",
	"WalrelaySlotNearInvalidation",
	"WalrelaySlotLost",
	"WalrelayReplicationLagHigh",
	"WalrelayDeadLetters",
	"WalrelayNotReady",
	"WalrelayDown",
	"WalrelayProduceErrors",
	"WalrelayRestartLoop",
}

var promql = parser.NewParser(parser.Options{})

// metricDef finds each `Name: "walrelay_..."` in metrics.go together with
// the constructor that precedes it (NewCounterVec, NewHistogram, ...).
var (
	metricNameRe = regexp.MustCompile(`Name:\s*"(walrelay_[a-zA-Z0-9_]*)"`)
	constructor  = regexp.MustCompile(`\bNew(Counter|Gauge|Histogram|Summary)(Vec|Func)?\(`)
)

// definedMetrics reads metrics.go as text and returns the walrelay_* names it
// defines with their kind (summaries count as histograms: both have _sum and
// _count series).
func definedMetrics(t *testing.T) map[string]metricKind {
	t.Helper()
	src, err := os.ReadFile(metricsFile)
	if err != nil {
		t.Fatalf("read %s: %v", metricsFile, err)
	}
	text := string(src)
	calls := constructor.FindAllStringSubmatchIndex(text, -1)
	defs := map[string]metricKind{}
	for _, m := range metricNameRe.FindAllStringSubmatchIndex(text, -1) {
		name := text[m[2]:m[3]]
		kind := gauge
		for _, c := range calls {
			if c[0] > m[0] {
				break
			}
			switch text[c[2]:c[3]] {
			case "Counter":
				kind = counter
			case "Histogram", "Summary":
				kind = histogram
			default:
				kind = gauge
			}
		}
		defs[name] = kind
	}
	if len(defs) == 0 {
		t.Fatalf("%s defines no walrelay_* metric: has it moved? The cross-check would be vacuous", metricsFile)
	}
	return defs
}

// catalog resolves the metric names an expression may reference.
type catalog struct {
	known, defined map[string]metricKind
}

func newCatalog(t *testing.T) catalog {
	return catalog{known: knownMetrics, defined: definedMetrics(t)}
}

func (c catalog) kind(name string) (metricKind, bool) {
	if k, ok := c.known[name]; ok {
		return k, true
	}
	k, ok := c.defined[name]
	return k, ok
}

// resolve reports whether name is a walrelay metric, or a series of one
// (name_bucket, _sum, _count of a histogram), and whether it is a counter
// series (something rate() and increase() may be applied to).
func (c catalog) resolve(name string) (ok, isCounter bool) {
	if k, found := c.kind(name); found {
		return true, k == counter
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, cut := strings.CutSuffix(name, suffix)
		if !cut {
			continue
		}
		if k, found := c.kind(base); found && k == histogram {
			return true, true
		}
	}
	return false, false
}

// selectorName is the metric name of a vector selector, also when it is
// given as a {__name__="..."} matcher.
func selectorName(vs *parser.VectorSelector) string {
	if vs.Name != "" {
		return vs.Name
	}
	for _, m := range vs.LabelMatchers {
		if m.Name == model.MetricNameLabel {
			return m.Value
		}
	}
	return ""
}

// checkExpr parses expr and checks every walrelay_* name it references, and
// that rate(), irate() and increase() are applied to counters only.
func (c catalog) checkExpr(expr string) []error {
	e, err := promql.ParseExpr(expr)
	if err != nil {
		return []error{fmt.Errorf("parse %q: %w", expr, err)}
	}
	var errs []error
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		switch n := n.(type) {
		case *parser.VectorSelector:
			name := selectorName(n)
			if !strings.HasPrefix(name, "walrelay_") {
				return nil
			}
			if ok, _ := c.resolve(name); !ok {
				errs = append(errs, fmt.Errorf("%q references %s, which is neither in the metric list nor in %s", expr, name, metricsFile))
			}
		case *parser.Call:
			switch n.Func.Name {
			case "rate", "irate", "increase":
			default:
				return nil
			}
			for _, arg := range n.Args {
				ms, ok := arg.(*parser.MatrixSelector)
				if !ok {
					continue
				}
				vs, ok := ms.VectorSelector.(*parser.VectorSelector)
				if !ok {
					continue
				}
				name := selectorName(vs)
				isCounter := strings.HasSuffix(name, "_total")
				if strings.HasPrefix(name, "walrelay_") {
					_, isCounter = c.resolve(name)
				}
				if !isCounter {
					errs = append(errs, fmt.Errorf("%q applies %s() to %s, which is not a counter", expr, n.Func.Name, name))
				}
			}
		}
		return nil
	})
	return errs
}

func TestMetricsFileCrossCheck(t *testing.T) {
	defs := definedMetrics(t)
	// A metric metrics.go defines with a kind different from the list's is a
	// renamed or retyped metric: dashboards and alerts would query it wrongly.
	for name, kind := range defs {
		if k, ok := knownMetrics[name]; ok && k != kind {
			t.Errorf("%s: kind %d in %s, %d in knownMetrics", name, kind, metricsFile, k)
		}
	}
}

func TestCatalogRejectsUnknownNames(t *testing.T) {
	c := newCatalog(t)
	// A metric only metrics.go defines (not yet in knownMetrics) is accepted.
	c.defined = map[string]metricKind{"walrelay_added_total": counter, "walrelay_added_seconds": histogram}
	for expr, wantErr := range map[string]bool{
		`rate(walrelay_added_total[5m])`:           false,
		`rate(walrelay_added_seconds_bucket[5m])`:  false,
		`walrelay_added_seconds_sum`:               false,
		`walrelay_not_added`:                       true,
		`rate(walrelay_added_seconds[5m])`:         true,
		`walrelay_streaming == 0 or walrelay_nope`: true,
	} {
		if errs := c.checkExpr(expr); (len(errs) > 0) != wantErr {
			t.Errorf("checkExpr(%q) = %v, want error: %v", expr, errs, wantErr)
		}
	}
	c = newCatalog(t)
	for expr, wantErr := range map[string]bool{
		`walrelay_slot_lag_bytes > 1`:                                           false,
		`rate(walrelay_commit_to_ack_seconds_bucket[5m])`:                       false,
		`rate(walrelay_commit_to_ack_seconds_count[5m])`:                        false,
		`walrelay_slot_lag_byte > 1`:                                            true,
		`walrelay_slot_lag_bytes_bucket`:                                        true,
		`{__name__="walrelay_nope"}`:                                            true,
		`rate(walrelay_inflight_events[5m])`:                                    true,
		`rate(process_cpu_seconds_total[5m])`:                                   false,
		`sum(rate(walrelay_events_published_total{topic=~".+"}[5m])) by (topic`: true,
	} {
		if errs := c.checkExpr(expr); (len(errs) > 0) != wantErr {
			t.Errorf("checkExpr(%q) = %v, want error: %v", expr, errs, wantErr)
		}
	}
}

func TestAlertRules(t *testing.T) {
	groups, errs := rulefmt.ParseFile(alertsFile, false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Errorf("rulefmt: %v", err)
	}
	if groups == nil {
		t.Fatal("no rule groups parsed")
	}
	c := newCatalog(t)
	seen := map[string]bool{}
	for _, g := range groups.Groups {
		if len(g.Rules) == 0 {
			t.Errorf("group %q has no rules", g.Name)
		}
		for _, r := range g.Rules {
			name := r.Alert
			if name == "" {
				name = "record " + r.Record
			} else {
				if seen[name] {
					t.Errorf("alert %s defined twice", name)
				}
				seen[name] = true
			}
			if r.Alert != "" {
				switch sev := r.Labels["severity"]; sev {
				case "warning", "critical":
				default:
					t.Errorf("%s: severity label %q, want warning or critical", name, sev)
				}
				for _, a := range []string{"summary", "description"} {
					if strings.TrimSpace(r.Annotations[a]) == "" {
						t.Errorf("%s: missing %s annotation", name, a)
					}
				}
			}
			for _, err := range c.checkExpr(r.Expr) {
				t.Errorf("%s: %v", name, err)
			}
		}
	}
	for _, a := range requiredAlerts {
		if !seen[a] {
			t.Errorf("alert %s is missing from %s", a, alertsFile)
		}
	}
}

// Grafana dashboard model, only the parts checked here.
type dashboard struct {
	UID           string  `json:"uid"`
	Title         string  `json:"title"`
	SchemaVersion int     `json:"schemaVersion"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []variable `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID          int             `json:"id"`
	Type        string          `json:"type"`
	Title       string          `json:"title"`
	Description string          `json:"description"`
	Datasource  json.RawMessage `json:"datasource"`
	Targets     []target        `json:"targets"`
	Panels      []panel         `json:"panels"` // collapsed rows
	FieldConfig struct {
		Defaults struct {
			Unit string `json:"unit"`
		} `json:"defaults"`
	} `json:"fieldConfig"`
}

type target struct {
	RefID string `json:"refId"`
	Expr  string `json:"expr"`
}

type variable struct {
	Name  string          `json:"name"`
	Type  string          `json:"type"`
	Query json.RawMessage `json:"query"`
}

// query returns a variable's query, stored either as a string or as
// {"query": "..."} by newer Grafana versions.
func (v variable) query() string {
	var s string
	if json.Unmarshal(v.Query, &s) == nil {
		return s
	}
	var o struct {
		Query string `json:"query"`
	}
	if json.Unmarshal(v.Query, &o) == nil {
		return o.Query
	}
	return ""
}

// grafanaVar matches $name, ${name}, ${name:format} and [[name]].
var grafanaVar = regexp.MustCompile(`\$\{([A-Za-z0-9_]+)(?::[^}]*)?\}|\$([A-Za-z0-9_]+)|\[\[([A-Za-z0-9_]+)(?::[^\]]*)?\]\]`)

// grafanaBuiltins are Grafana's global variables with parseable stand-ins:
// durations where PromQL takes a duration, numbers where it takes a number.
var grafanaBuiltins = map[string]string{
	"__rate_interval":    "5m",
	"__interval":         "1m",
	"__range":            "6h",
	"__rate_interval_ms": "300000",
	"__interval_ms":      "60000",
	"__range_ms":         "21600000",
	"__range_s":          "21600",
}

// substitute replaces Grafana variables in expr with stand-ins that PromQL
// parses: built-ins by a duration or number, dashboard variables by a
// label value. It returns the names of the dashboard variables it replaced.
func substitute(expr string) (string, []string) {
	var vars []string
	out := grafanaVar.ReplaceAllStringFunc(expr, func(m string) string {
		sub := grafanaVar.FindStringSubmatch(m)
		name := sub[1] + sub[2] + sub[3]
		if s, ok := grafanaBuiltins[name]; ok {
			return s
		}
		vars = append(vars, name)
		return "grafana_var"
	})
	return out, vars
}

func TestSubstitute(t *testing.T) {
	for in, want := range map[string]string{
		`rate(x{instance=~"$instance"}[$__rate_interval])`:    `rate(x{instance=~"grafana_var"}[5m])`,
		`rate(x{instance=~"${instance:regex}"}[$__interval])`: `rate(x{instance=~"grafana_var"}[1m])`,
		`increase(x{job="[[job]]"}[${__range}]) / $__range_s`: `increase(x{job="grafana_var"}[6h]) / 21600`,
	} {
		if got, _ := substitute(in); got != want {
			t.Errorf("substitute(%q) = %q, want %q", in, got, want)
		}
	}
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(raw) {
		t.Fatalf("%s is not valid JSON", dashboardFile)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

func TestDashboard(t *testing.T) {
	d := loadDashboard(t)
	if d.UID != "walrelay" {
		t.Errorf("uid = %q, want \"walrelay\"", d.UID)
	}
	if d.Title != "walrelay" {
		t.Errorf("title = %q, want \"walrelay\"", d.Title)
	}
	if d.SchemaVersion == 0 {
		t.Error("schemaVersion missing")
	}
	if len(d.Panels) == 0 {
		t.Fatal("no panels")
	}

	c := newCatalog(t)
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		switch v.Name {
		case "datasource":
			if v.Type != "datasource" || v.query() != "prometheus" {
				t.Errorf("variable datasource: type %q query %q, want a prometheus datasource variable", v.Type, v.query())
			}
		case "instance":
			if q := v.query(); q != "label_values(walrelay_streaming, instance)" {
				t.Errorf("variable instance: query %q", q)
			}
		}
		// label_values(<selector>, label): check the selector's metric.
		if q := v.query(); strings.HasPrefix(q, "label_values(") {
			inner := strings.TrimSuffix(strings.TrimPrefix(q, "label_values("), ")")
			if i := strings.LastIndex(inner, ","); i >= 0 {
				sel, _ := substitute(strings.TrimSpace(inner[:i]))
				for _, err := range c.checkExpr(sel) {
					t.Errorf("variable %s: %v", v.Name, err)
				}
			}
		}
	}
	for _, want := range []string{"datasource", "instance"} {
		if !vars[want] {
			t.Errorf("template variable $%s missing", want)
		}
	}

	ids := map[int]string{}
	var all []panel
	for _, p := range d.Panels {
		all = append(all, p)
		all = append(all, p.Panels...)
	}
	exprs := 0
	for _, p := range all {
		if p.ID == 0 {
			t.Errorf("panel %q has no id", p.Title)
		} else if other, dup := ids[p.ID]; dup {
			t.Errorf("panels %q and %q share id %d", other, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if strings.TrimSpace(p.Title) == "" {
			t.Errorf("panel %d has no title", p.ID)
		}
		if p.Type == "row" {
			continue
		}
		if strings.TrimSpace(p.Description) == "" {
			t.Errorf("panel %q has no description", p.Title)
		}
		if p.FieldConfig.Defaults.Unit == "" {
			t.Errorf("panel %q has no unit", p.Title)
		}
		if !strings.Contains(string(p.Datasource), "${datasource}") {
			t.Errorf("panel %q: datasource %s, want ${datasource}", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no queries", p.Title)
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			if tg.RefID == "" || refs[tg.RefID] {
				t.Errorf("panel %q: missing or duplicate refId %q", p.Title, tg.RefID)
			}
			refs[tg.RefID] = true
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q: target %s has no expr", p.Title, tg.RefID)
				continue
			}
			exprs++
			expr, used := substitute(tg.Expr)
			for _, v := range used {
				if !vars[v] {
					t.Errorf("panel %q: expr uses $%s, which is not a dashboard variable", p.Title, v)
				}
			}
			for _, err := range c.checkExpr(expr) {
				t.Errorf("panel %q: %v", p.Title, err)
			}
		}
	}
	if exprs == 0 {
		t.Error("dashboard has no queries")
	}
}

// TestGofmt keeps this module's Go files gofmt-clean.
func TestGofmt(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(files)
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out, err := format.Source(src)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if string(out) != string(src) {
			t.Errorf("%s is not gofmt-clean: run gofmt -w %s", f, f)
		}
	}
}
