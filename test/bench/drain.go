package bench

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walrelay/walrelay/internal/devcluster"
	"github.com/walrelay/walrelay/test/kafkacluster"
)

// broker is the Kafka side of a measurement: an in-process kfake
// (discarding or storing records), a one-node Apache Kafka (apache) or
// external brokers.
type broker struct {
	name   string
	addrs  []string
	kafka  *devcluster.Kafka
	apache *kafkacluster.Cluster
}

// cpu is the broker's CPU time so far: the bench process's own with an
// in-process kfake, the JVM's with Apache Kafka; 0 for external brokers.
func (k *broker) cpu() time.Duration {
	switch {
	case k.apache != nil:
		d, _ := cpuTime(k.apache.Pid(1))
		return d
	case k.kafka != nil:
		return selfCPU()
	}
	return 0
}

func (b *bencher) brokers() ([]*broker, error) {
	if len(b.cfg.KafkaBrokers) > 0 {
		return []*broker{{name: "external", addrs: b.cfg.KafkaBrokers}}, nil
	}
	var out []*broker
	for _, mode := range b.cfg.Brokers {
		if mode != "discard" && mode != "store" && mode != "apache" {
			return nil, fmt.Errorf("broker mode %q: want discard, store or apache", mode)
		}
		out = append(out, &broker{name: mode})
	}
	return out, nil
}

// start starts the broker of one measurement (an in-process kfake or an
// Apache Kafka node).
func (k *broker) start() error {
	switch k.name {
	case "external":
		return nil
	case "apache":
		// The heap the broker's own scripts give it.
		c, err := kafkacluster.Start(context.Background(), kafkacluster.Options{HeapMB: 1024})
		if err != nil {
			return err
		}
		k.apache, k.addrs = c, c.Addrs()
		return nil
	}
	kafka, err := devcluster.StartKafka(devcluster.KafkaOptions{Discard: k.name == "discard"})
	if err != nil {
		return err
	}
	k.kafka, k.addrs = kafka, []string{kafka.Addr()}
	return nil
}

func (k *broker) stop() {
	if k.kafka != nil {
		k.kafka.Close()
		k.kafka = nil
	}
	if k.apache != nil {
		k.apache.Close()
		k.apache = nil
	}
}

func (b *bencher) drainAll(ctx context.Context) ([]Result, error) {
	brokers, err := b.brokers()
	if err != nil {
		return nil, err
	}
	relays := b.relayRuns()
	defer func() { b.cfg.Binary = relays[0].bin }()
	var out []Result
	for _, size := range b.cfg.TxnSizes {
		for _, k := range brokers {
			// Repeats interleave the delivery modes and value formats,
			// so that a slow phase of the machine does not fall on one
			// only; each drain of the build under test is followed by the
			// compared one's (--compare-binary, --compare-arg), each with
			// its own backlog and its own pg_recvlogical beside it.
			byMode := map[string][]Result{}
			fs := b.cfg.ValueFormats
			for rep := range b.cfg.Repeat {
				for _, d := range b.cfg.Deliveries {
					if d == "exactly-once" && k.name == "discard" {
						// The relay reads its checkpoint back from Kafka
						// on start: a broker that stores nothing cannot
						// serve it.
						continue
					}
					// Each repeat starts with another format, so that none
					// always has the same place in the round (without
					// this, the round's first drain was the slowest in all
					// three rounds of one run).
					for j := range fs {
						f := fs[(j+rep)%len(fs)]
						for _, rb := range relays {
							b.cfg.Binary = rb.bin
							r, err := b.drain(ctx, size, k, d, f, rb.args...)
							if err != nil {
								return out, err
							}
							r.Params += rb.label
							byMode[modeKey(d, f)+rb.label] = append(byMode[modeKey(d, f)+rb.label], r)
						}
					}
				}
			}
			for _, rb := range relays {
				out = append(out, b.drainSummary(byMode, size, k, rb.label)...)
			}
		}
	}
	return out, nil
}

// drainSummary lists one relay's drains of one size and broker (byMode's
// keys end in its label), each measurement's runs followed by their
// medians, then the ratios of exactly-once to at-least-once and of each
// value format to the delivery mode alone.
func (b *bencher) drainSummary(byMode map[string][]Result, size int, k *broker, label string) []Result {
	var out []Result
	for _, d := range b.cfg.Deliveries {
		for _, f := range b.cfg.ValueFormats {
			out = append(out, byMode[modeKey(d, f)+label]...)
			if rs := byMode[modeKey(d, f)+label]; len(rs) > 1 {
				out = append(out, medians(rs))
			}
		}
	}
	alo, eos := byMode["at-least-once"+label], byMode["exactly-once"+label]
	if len(alo) > 0 && len(eos) > 0 {
		a, e := medianOf(alo, "relay_events_per_s"), medianOf(eos, "relay_events_per_s")
		out = append(out, Result{
			Scenario: "drain",
			Params:   fmt.Sprintf("events=%d txn=%d payload=%dB broker=%s exactly-once/at-least-once%s", b.cfg.Events, size, b.cfg.PayloadBytes, k.name, label),
			Metrics:  map[string]float64{"eos_events_per_s": e, "alo_events_per_s": a, "eos_ratio": e / a},
			Notes:    fmt.Sprintf("medians of %d runs each", len(eos)),
		})
	}
	for _, d := range b.cfg.Deliveries {
		asis := byMode[modeKey(d, "asis")+label]
		for _, f := range b.cfg.ValueFormats {
			rs := byMode[modeKey(d, f)+label]
			if f == "asis" || len(asis) == 0 || len(rs) == 0 {
				continue
			}
			fr, ar := medianOf(rs, "relay_events_per_s"), medianOf(asis, "relay_events_per_s")
			fc, ac := medianOf(rs, "relay_cpu_us_per_event"), medianOf(asis, "relay_cpu_us_per_event")
			out = append(out, Result{
				Scenario: "drain",
				Params:   fmt.Sprintf("events=%d txn=%d payload=%dB broker=%s delivery=%s value=%s/asis%s", b.cfg.Events, size, b.cfg.PayloadBytes, k.name, d, f, label),
				Metrics: map[string]float64{"value_events_per_s": fr, "asis_events_per_s": ar, "value_rate_ratio": fr / ar,
					"value_cpu_us_per_event": fc, "asis_cpu_us_per_event": ac, "value_cpu_us_added": fc - ac},
				Notes: fmt.Sprintf("medians of %d runs each", len(rs)),
			})
		}
	}
	return out
}

// drain writes a backlog while three slots wait, decodes one inside
// PostgreSQL (pg_logical_slot_peek_binary_changes: the decoding limit, no
// client, no socket), drains one with pg_recvlogical and the other with
// the relay, and compares.
func (b *bencher) drain(ctx context.Context, txnSize int, k *broker, delivery, format string, relayArgs ...string) (Result, error) {
	su, err := b.newSetup(ctx, "peek", "recv", "relay")
	if err != nil {
		return Result{}, err
	}
	defer su.close()
	url, conn := su.url, su.conn
	start, _ := currentLSN(ctx, conn)
	b.logf("drain: writing %d events in transactions of %d rows (%d-byte payloads)", b.cfg.Events, txnSize, b.cfg.PayloadBytes)
	if err := writeBacklog(ctx, conn, b.cfg.Events, txnSize, b.cfg.PayloadBytes); err != nil {
		return Result{}, fmt.Errorf("write backlog: %w", err)
	}
	end, _ := currentLSN(ctx, conn)
	// Make the end position reachable for both readers even if nothing else
	// writes: a last record after it.
	if _, err := conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'bench', 'end')"); err != nil {
		return Result{}, fmt.Errorf("write the end marker: %w", err)
	}
	walBytes := float64(end - start)
	n := float64(b.cfg.Events)

	// The decoding limit: the same slot options, decoded by one backend
	// into a count, nothing sent anywhere.
	decodeTime, decodeCPU, err := peekDecode(ctx, url, "peek")
	if err != nil {
		return Result{}, err
	}

	// pg_recvlogical: PostgreSQL's own client.
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return Result{}, err
	}
	recv := exec.CommandContext(ctx, "pg_recvlogical", "-h", cfg.Host, "-p", fmt.Sprint(cfg.Port), "-U", cfg.User,
		"-d", cfg.Database, "-S", "recv", "--start", "-E", end.String(), "-f", "/dev/null", "-F", "0", "-n",
		"-o", "proto_version=1", "-o", "publication_names=bench")
	recvStart := time.Now()
	if err := recv.Start(); err != nil {
		return Result{}, err
	}
	recvWS, err := walsenderPID(ctx, conn, "recv", 30*time.Second)
	if err != nil {
		_ = recv.Process.Kill()
		return Result{}, err
	}
	recvCPU := sampleCPU(recvWS, 10*time.Millisecond)
	if err := recv.Wait(); err != nil {
		return Result{}, fmt.Errorf("pg_recvlogical: %w", err)
	}
	recvTime := time.Since(recvStart)
	recvWSCPU := recvCPU.Stop()

	// The relay.
	if err := su.startBroker(k); err != nil {
		return Result{}, err
	}
	// The broker's CPU while the relay drains (with an in-process broker,
	// the bench process's own).
	brokerStart := k.cpu()
	relayStart := time.Now()
	values, closeRegistry, err := valueArgs(format)
	if err != nil {
		return Result{}, err
	}
	defer closeRegistry()
	relayWS, err := su.startRelay(ctx, delivery, append(values, relayArgs...)...)
	if err != nil {
		return Result{}, err
	}
	relayWSCPU := sampleCPU(relayWS, 10*time.Millisecond)
	err = su.waitRelayConfirmed(ctx, end)
	relayTime := time.Since(relayStart)
	if err != nil {
		return Result{}, err
	}
	rl := su.relay
	relayCPU, _ := cpuTime(rl.cmd.Process.Pid)
	rss, _ := peakRSS(rl.cmd.Process.Pid)
	brokerCPU := k.cpu() - brokerStart
	wsCPU := relayWSCPU.Stop()

	res := Result{
		Scenario: "drain",
		Params:   fmt.Sprintf("events=%d txn=%d payload=%dB broker=%s delivery=%s%s", b.cfg.Events, txnSize, b.cfg.PayloadBytes, k.name, delivery, valueParam(format)),
		Metrics: map[string]float64{
			"decode_events_per_s":          n / decodeTime.Seconds(),
			"decode_backend_us_per_event":  float64(decodeCPU.Microseconds()) / n,
			"relay_decode_ratio":           decodeTime.Seconds() / relayTime.Seconds(),
			"recv_events_per_s":            n / recvTime.Seconds(),
			"relay_events_per_s":           n / relayTime.Seconds(),
			"ratio":                        recvTime.Seconds() / relayTime.Seconds(),
			"recv_mb_per_s":                walBytes / 1e6 / recvTime.Seconds(),
			"relay_mb_per_s":               walBytes / 1e6 / relayTime.Seconds(),
			"recv_walsender_us_per_event":  float64(recvWSCPU.Microseconds()) / n,
			"relay_walsender_us_per_event": float64(wsCPU.Microseconds()) / n,
			"relay_cpu_us_per_event":       float64(relayCPU.Microseconds()) / n,
			"peak_rss_mb":                  float64(rss) / (1 << 20),
		},
	}
	if k.kafka != nil || k.apache != nil {
		res.Metrics["broker_cpu_us_per_event"] = float64(brokerCPU.Microseconds()) / n
	}
	if k.name != "discard" {
		txns, err := kafkaTxns(ctx, k.addrs, "walrelay.checkpoints")
		if err != nil {
			return Result{}, err
		}
		if txns > 0 {
			res.Metrics["kafka_txns"] = float64(txns)
		}
	}
	b.logf("drain txn=%d broker=%s delivery=%s: decoding %s, pg_recvlogical %s, relay %s (%.2f of the decoding rate, %.2f of pg_recvlogical's)", txnSize, k.name, delivery,
		decodeTime.Round(time.Millisecond), recvTime.Round(time.Millisecond), relayTime.Round(time.Millisecond), res.Metrics["relay_decode_ratio"], res.Metrics["ratio"])
	return res, nil
}

// modeKey names the runs of one delivery mode and value format; asis is
// the delivery mode alone, as before value formats were measured.
func modeKey(delivery, format string) string {
	if format == "" || format == "asis" {
		return delivery
	}
	return delivery + " value=" + format
}

func valueParam(format string) string {
	if format == "" || format == "asis" {
		return ""
	}
	return " value=" + format
}

// peekDecode decodes the backlog of slotName in one backend, with the
// options the relay streams with (pgoutput protocol 1, the bench
// publication), without consuming it: the time and the backend's CPU.
func peekDecode(ctx context.Context, url, slotName string) (time.Duration, time.Duration, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close(context.Background())
	pid := int(conn.PgConn().PID())
	before, err := cpuTime(pid)
	if err != nil {
		return 0, 0, fmt.Errorf("CPU of the decoding backend: %w", err)
	}
	start := time.Now()
	var msgs int64
	err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
		'proto_version', '1', 'publication_names', 'bench')`, slotName).Scan(&msgs)
	elapsed := time.Since(start)
	if err != nil {
		return 0, 0, fmt.Errorf("decode the backlog in PostgreSQL: %w", err)
	}
	after, err := cpuTime(pid)
	if err != nil {
		return 0, 0, fmt.Errorf("CPU of the decoding backend: %w", err)
	}
	return elapsed, after - before, nil
}

// medians is one result of the medians of every metric of rs (runs of one
// measurement).
func medians(rs []Result) Result {
	m := Result{Scenario: rs[0].Scenario, Params: rs[0].Params, Metrics: map[string]float64{}, Notes: fmt.Sprintf("medians of %d runs", len(rs))}
	for k := range rs[0].Metrics {
		m.Metrics[k] = medianOf(rs, k)
	}
	return m
}

// medianOf is the median of metric over rs.
func medianOf(rs []Result, metric string) float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = r.Metrics[metric]
	}
	slices.Sort(v)
	if n := len(v); n%2 == 0 {
		return (v[n/2-1] + v[n/2]) / 2
	}
	return v[len(v)/2]
}
