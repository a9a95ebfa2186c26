package main

// reference_test.go writes docs/reference/ from the code: the commands and
// flags from the kong model the binary parses with, the metrics from the
// registry metrics.New registers on, the exit codes from main.go's
// constants, the dead-letter reasons and headers from package deadletter
// and the restart causes from package relay, each with its doc comment.
// TestReference fails while a committed page differs from what the code
// generates; `make docs` (go test ./cmd/walrelay -run '^TestReference$'
// -update) rewrites them.

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/alecthomas/kong"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/walrelay/walrelay/deadletter"
	"github.com/walrelay/walrelay/heartbeat"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/relay"
	"github.com/walrelay/walrelay/test/refdoc"
)

const refDir = "../../docs/reference/"

func TestReference(t *testing.T) {
	pages := map[string]func(t *testing.T) string{
		"walrelay.md":     commandsPage,
		"metrics.md":      metricsPage,
		"exit-codes.md":   exitCodesPage,
		"dead-letters.md": deadLettersPage,
	}
	for _, name := range refdoc.SortedKeys(pages) {
		t.Run(name, func(t *testing.T) {
			refdoc.Check(t, refDir+name, []byte(pages[name](t)))
		})
	}
}

// model is kong's model of the command line, built as main builds it.
func model(t *testing.T) *kong.Kong {
	t.Helper()
	var c cli
	k, err := kong.New(&c, parserOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func commandsPage(t *testing.T) string {
	k := model(t)
	var b strings.Builder
	b.WriteString("# walrelay: commands and flags\n\n")
	b.WriteString(refdoc.Generated("the command line walrelay parses (kong's model, cmd/walrelay)"))
	fmt.Fprintf(&b, "\n%s\n\n", k.Model.Help)
	b.WriteString("Every flag but `--help` and `--version` can be set by an environment variable instead: `WALRELAY_` and the\n" +
		"flag's name in upper case, `_` for `-` (`--pg-url` is `WALRELAY_PG_URL`); a list takes commas. A flag given\n" +
		"on the command line wins over its variable. Durations are written as Go writes them (`500ms`, `1m30s`,\n" +
		"`2h`). What each exit code means: [exit-codes.md](exit-codes.md).\n\n")
	b.WriteString("| command | what it does |\n| --- | --- |\n")
	cmds := refdoc.Commands(k.Model)
	for _, c := range cmds {
		heading := "walrelay " + c.Path()
		fmt.Fprintf(&b, "| [`%s`](#%s) | %s |\n", heading, refdoc.Anchor(heading), refdoc.Cell(c.Help))
	}
	b.WriteString("\n## Flags of every command\n\n")
	b.WriteString(refdoc.FlagTable(refdoc.Flags(k.Model.Node)))
	for _, c := range cmds {
		fmt.Fprintf(&b, "\n## walrelay %s\n\n%s\n\n", c.Path(), c.Help)
		if c.Detail != "" {
			fmt.Fprintf(&b, "%s\n\n", c.Detail)
		}
		b.WriteString(refdoc.FlagTable(refdoc.Flags(c)))
	}
	return b.String()
}

// labelValues are the labels whose values the code enumerates, each with
// where they are described; freeLabels are the others (a topic, a table,
// PostgreSQL's wal_status), which the metric's help describes. A label in
// neither fails the page, so that a new label is a decision.
var (
	labelValues = map[string]string{
		"walrelay_stream_restarts_total/cause":       "#restart-causes",
		"walrelay_heartbeats_total/kind":             "#heartbeat-kinds",
		"walrelay_events_dead_lettered_total/reason": "dead-letters.md#reasons",
	}
	freeLabels = map[string]bool{
		"walrelay_events_published_total/topic": true,
		"walrelay_unmapped_inserts_total/table": true,
		"walrelay_slot_wal_status/status":       true,
		// The few values of both are in the metric's help.
		"walrelay_kafka_authorization_denied_total/resource":  true,
		"walrelay_kafka_authorization_denied_total/operation": true,
		"walrelay_delivery_held/dependency":                   true, // the dependencies and the reasons are in its help
		"walrelay_delivery_held/reason":                       true,
		"walrelay_trace_spans_dropped_total/reason":           true, // queue_full, export_failed, shutdown: its help says each
		"walrelay_schema_registry_reads_total/result":         true, // ok, invalid, error: the help says each
	}
)

func metricsPage(t *testing.T) string {
	ms, err := refdoc.Metrics(func(reg prometheus.Registerer) any { return metrics.New(reg) })
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	b.WriteString("# walrelay metrics\n\n")
	b.WriteString(refdoc.Generated("the registry metrics.New registers on, and packages relay and heartbeat"))
	b.WriteString("\n`walrelay run` serves these on `--metrics-addr` at `/metrics`, with the Go and process collectors\n" +
		"(`go_*`, `process_*`); a program embedding the relay gets them on the registerer it gives `metrics.New`.\n" +
		"The names are a public interface: added, never renamed. `deploy/grafana/walrelay.json` charts them and\n" +
		"`deploy/prometheus/alerts.yml` alerts on them.\n\n")
	b.WriteString("| metric | type | labels | description |\n| --- | --- | --- | --- |\n")
	var histograms []refdoc.Metric
	for _, m := range ms {
		var labels []string
		for _, l := range m.Labels {
			key := m.Name + "/" + l
			switch {
			case labelValues[key] != "":
				labels = append(labels, fmt.Sprintf("[`%s`](%s)", l, labelValues[key]))
			case freeLabels[key]:
				labels = append(labels, "`"+l+"`")
			default:
				t.Errorf("%s has the label %s, in neither labelValues nor freeLabels: say where its values are described", m.Name, l)
			}
		}
		if len(labels) == 0 {
			labels = []string{"—"}
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s |\n", m.Name, m.Type, strings.Join(labels, ", "), refdoc.Cell(m.Help))
		if m.Type == "histogram" {
			histograms = append(histograms, m)
		}
	}
	if len(histograms) > 0 {
		b.WriteString("\n## Histogram buckets\n\n| histogram | upper bounds (seconds) |\n| --- | --- |\n")
		for _, h := range histograms {
			var bs []string
			for _, v := range h.Buckets {
				bs = append(bs, fmt.Sprintf("%g", v))
			}
			fmt.Fprintf(&b, "| `%s` | %s |\n", h.Name, strings.Join(bs, ", "))
		}
	}

	causes, err := refdoc.Consts("../../relay", "RestartCause", "")
	if err != nil {
		t.Fatal(err)
	}
	b.WriteString("\n## Restart causes\n\nThe `cause` label of `walrelay_stream_restarts_total`: why a replication stream ended and the relay\n" +
		"started another from the last confirmed position.\n\n| cause | meaning |\n| --- | --- |\n")
	byValue := refdoc.ByValue(causes)
	for _, c := range relay.RestartCauses() {
		doc, ok := byValue[string(c)]
		if !ok || doc.Doc == "" {
			t.Errorf("restart cause %q has no documented constant in package relay", c)
		}
		fmt.Fprintf(&b, "| `%s` | %s |\n", c, refdoc.Cell(relayDoc(doc.Doc)))
	}
	if len(causes) != len(relay.RestartCauses()) {
		t.Errorf("package relay declares %d RestartCause constants, relay.RestartCauses lists %d", len(causes), len(relay.RestartCauses()))
	}

	kinds, err := refdoc.Consts("../../heartbeat", "Kind", "")
	if err != nil {
		t.Fatal(err)
	}
	b.WriteString("\n## Heartbeat kinds\n\nThe `kind` label of `walrelay_heartbeats_total`.\n\n| kind | meaning |\n| --- | --- |\n")
	byValue = refdoc.ByValue(kinds)
	for _, k := range heartbeat.Kinds() {
		doc, ok := byValue[string(k)]
		if !ok || doc.Doc == "" {
			t.Errorf("heartbeat kind %q has no documented constant in package heartbeat", k)
		}
		fmt.Fprintf(&b, "| `%s` | %s |\n", k, refdoc.Cell(doc.Doc))
	}
	if len(kinds) != len(heartbeat.Kinds()) {
		t.Errorf("package heartbeat declares %d Kind constants, heartbeat.Kinds lists %d", len(kinds), len(heartbeat.Kinds()))
	}
	return b.String()
}

// relayConfigField is a field of relay.Config as package relay's comments
// name it, without the package.
var relayConfigField = regexp.MustCompile(`\bConfig\.`)

// relayDoc is a comment of package relay in the command line's words: its
// Config.X becomes relay.Config.X, which speakFlags turns into the flag.
func relayDoc(doc string) string {
	return speakFlags(relayConfigField.ReplaceAllString(doc, "relay.Config."))
}

func exitCodesPage(t *testing.T) string {
	codes, err := refdoc.Consts(".", "", "exit")
	if err != nil {
		t.Fatal(err)
	}
	// The constants the binary exits with, by name: a constant added to
	// main.go without a row here, or a row without a constant, fails.
	want := map[string]int{"exitUnhealthy": exitUnhealthy, "exitFailed": exitFailed, "exitFenced": exitFenced,
		"exitStartupTimeout": exitStartupTimeout, "exitUsage": exitUsage}
	if len(codes) != len(want) {
		t.Errorf("main.go declares %d exit* constants, this test knows %d", len(codes), len(want))
	}
	var b strings.Builder
	b.WriteString("# walrelay exit codes\n\n")
	b.WriteString(refdoc.Generated("the exit code constants of cmd/walrelay/main.go and their comments"))
	b.WriteString("\nEvery command exits with one of these. A supervisor may restart `walrelay run` on any of them but 80\n" +
		"(fix the flags) and 3 (fix the transactional id); on 2, read the one line it printed before restarting;\n" +
		"on 4 a restart is what it needs once what it waited for is there.\n\n")
	if len(codes) > 0 {
		fmt.Fprintf(&b, "%s\n\n", exitIntro(codes[0].Group))
	}
	b.WriteString("| code | meaning |\n| --- | --- |\n")
	for _, c := range codes {
		if v, ok := want[c.Name]; !ok || fmt.Sprint(v) != c.Value {
			t.Errorf("main.go's %s = %s, want %v", c.Name, c.Value, v)
		}
		fmt.Fprintf(&b, "| %s | %s |\n", c.Value, refdoc.Cell(c.Doc))
	}
	return b.String()
}

// exitIntro is the exit constants' block comment less its first
// paragraph, which speaks to the programmer.
func exitIntro(group string) string {
	_, rest, _ := strings.Cut(group, "\n")
	return rest
}

func deadLettersPage(t *testing.T) string {
	reasons, err := refdoc.Consts("../../deadletter", "Reason", "")
	if err != nil {
		t.Fatal(err)
	}
	headers, err := refdoc.Consts("../../deadletter", "", "Header")
	if err != nil {
		t.Fatal(err)
	}
	def := relay.DefaultConfig()
	var b strings.Builder
	b.WriteString("# Dead letters: reasons and headers\n\n")
	b.WriteString(refdoc.Generated("package deadletter, the contract dead-letter consumers read"))
	fmt.Fprintf(&b, "\nAn outbox row that cannot become a record goes to the dead-letter topic (`--dead-letter-topic`,\n"+
		"default `%s`) with `--on-invalid dlq`, the default, and the stream goes on; it is counted in\n"+
		"`walrelay_events_dead_lettered_total{reason}`. The record keeps the row's key (its aggregate id), its commit\n"+
		"time, its id and type headers (`--header-id`, `--header-type`) and header columns, and its payload when it fits\n"+
		"the dead-letter topic; the headers below say why and where from.\n\n", def.Router.DeadLetterTopic)
	b.WriteString("## Reasons\n\nThe value of `" + deadletter.HeaderReason + "`, and the `reason` label of the metric.\n\n| reason | meaning |\n| --- | --- |\n")
	byValue := refdoc.ByValue(reasons)
	for _, r := range deadletter.Reasons() {
		doc, ok := byValue[string(r)]
		if !ok || doc.Doc == "" {
			t.Errorf("dead-letter reason %q has no documented constant in package deadletter", r)
		}
		fmt.Fprintf(&b, "| `%s` | %s |\n", r, refdoc.Cell(doc.Doc))
	}
	if len(reasons) != len(deadletter.Reasons()) {
		t.Errorf("package deadletter declares %d Reason constants, deadletter.Reasons lists %d", len(reasons), len(deadletter.Reasons()))
	}
	b.WriteString("\n## Headers\n\n| header | carries |\n| --- | --- |\n")
	for _, h := range headers {
		if h.Doc == "" {
			t.Errorf("deadletter.%s has no doc comment", h.Name)
		}
		fmt.Fprintf(&b, "| `%s` | %s |\n", h.Value, refdoc.Cell(h.Doc))
	}
	return b.String()
}
