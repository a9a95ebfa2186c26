package bench

// The inbox scenario measures the consumer half of the chain: the inbox
// package's Consumer, with a handler doing one UPDATE, draining a backlog
// of records on 1, 8 and 32 partitions (--inbox-partitions), in effects
// committed per second, beside
//
//   - the same consumer built from another git ref (--inbox-compare-ref,
//     e.g. main), on the same backlog in the same round;
//   - the floor: the consumer's own database work with no Kafka and no
//     consumer, a loop sending the statements its batches send (the
//     inbox rows in one statement, the attempt counts, the position; one
//     UPDATE per record; the commit) from as many connections as the
//     consumer has workers; and the same loop with a savepoint around
//     each record, what the batch's other design would cost;
//
// and, at each --inbox-rate, the time from a record's produce call to its
// effect's commit (pg_xact_commit_timestamp of the batch's transaction),
// with commits durable (synchronous_commit on) as in production.
//
// The consumer runs as a process of its own (test/bench/inboxconsumer,
// built with the Go toolchain when the scenario starts, from the module
// the bench runs in), so its CPU time is its own. Each run has a database
// of its own; the broker is shared (kfake storing records, or Apache
// Kafka with --broker apache). Throughput runs with the cluster's
// synchronous_commit off (as the other scenarios' backlogs): the floor
// has the same.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walrelay/walrelay/inbox"
	"github.com/walrelay/walrelay/internal/devcluster"
)

// inboxAccounts is how many accounts (keys) the handler's UPDATEs spread
// over.
const inboxAccounts = 1000

// inboxLatencyPartitions is the latency runs' topic's partitions, as the
// relay's topics in the latency scenario (--topic-partitions 3).
const inboxLatencyPartitions = 3

// consumerBuild is a build of the bench's consumer program.
type consumerBuild struct {
	bin, label string
	set        []string // inbox.Config fields, Name=value
}

func (b *bencher) inboxAll(ctx context.Context) ([]Result, error) {
	dir, err := os.MkdirTemp("", "walrelay-bench-inbox-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	builds, err := b.buildConsumers(ctx, dir)
	if err != nil {
		return nil, err
	}
	mode := "store"
	if has(b.cfg.Brokers, "apache") {
		mode = "apache"
	}
	k := b.oneBroker(mode)
	if err := k.start(); err != nil {
		return nil, err
	}
	defer k.stop()
	cfg := inbox.Config{}
	for _, s := range b.cfg.InboxSet {
		if err := setConfigField(&cfg, s); err != nil {
			return nil, err
		}
	}
	cfg = cfg.WithDefaults()

	runs := map[string][]Result{}
	var order []string
	add := func(r Result) {
		if _, ok := runs[r.Params]; !ok {
			order = append(order, r.Params)
		}
		runs[r.Params] = append(runs[r.Params], r)
	}
	for _, parts := range b.cfg.InboxPartitions {
		for range b.cfg.Repeat {
			r, err := b.inboxDrain(ctx, k, parts, builds, cfg)
			if err != nil {
				return collect(runs, order), err
			}
			add(r)
		}
	}
	for _, rate := range b.cfg.InboxRates {
		for range b.cfg.Repeat {
			for _, cb := range builds {
				r, err := b.inboxLatency(ctx, k, rate, cb)
				if err != nil {
					return collect(runs, order), err
				}
				add(r)
			}
		}
	}
	return collect(runs, order), nil
}

// buildConsumers builds the consumer program from the module the bench
// runs in and, with --inbox-compare-ref, from that ref's tree.
func (b *bencher) buildConsumers(ctx context.Context, dir string) ([]consumerBuild, error) {
	out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}").Output()
	root := strings.TrimSpace(string(out))
	if err != nil || root == "" || !fileExists(filepath.Join(root, "test", "bench", "inboxconsumer", "main.go")) {
		return nil, fmt.Errorf("the inbox scenario builds its consumer with the Go toolchain: run walrelay-bench from the walrelay repository (go list -m: %q, %v)", root, err)
	}
	build := func(src, bin string) error {
		cmd := exec.CommandContext(ctx, "go", "build", "-buildvcs=false", "-o", bin, "./test/bench/inboxconsumer")
		cmd.Dir = src
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build the inbox consumer in %s: %v\n%s", src, err, out)
		}
		return nil
	}
	builds := []consumerBuild{{bin: filepath.Join(dir, "inboxconsumer"), set: b.cfg.InboxSet}}
	if err := build(root, builds[0].bin); err != nil {
		return nil, err
	}
	if ref := b.cfg.InboxCompareRef; ref != "" {
		src := filepath.Join(dir, "src")
		if err := os.Mkdir(src, 0o755); err != nil {
			return nil, err
		}
		// The ref's tree, with this tree's consumer program (which sets
		// only the fields its inbox.Config has, by name).
		archive := exec.CommandContext(ctx, "sh", "-c", `git -C "$1" archive --format=tar "$2" | tar -x -C "$3"`, "sh", root, ref, src)
		if out, err := archive.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("--inbox-compare-ref %s: git archive: %v\n%s", ref, err, out)
		}
		prog, err := os.ReadFile(filepath.Join(root, "test", "bench", "inboxconsumer", "main.go"))
		if err == nil {
			err = os.MkdirAll(filepath.Join(src, "test", "bench", "inboxconsumer"), 0o755)
		}
		if err == nil {
			err = os.WriteFile(filepath.Join(src, "test", "bench", "inboxconsumer", "main.go"), prog, 0o644)
		}
		if err != nil {
			return nil, err
		}
		cb := consumerBuild{bin: filepath.Join(dir, "inboxconsumer-compare"), label: " consumer=" + ref}
		if err := build(src, cb.bin); err != nil {
			return nil, err
		}
		builds = append(builds, cb)
	}
	b.logf("inbox: consumer built from %s%s", root, map[bool]string{true: " and " + b.cfg.InboxCompareRef}[b.cfg.InboxCompareRef != ""])
	return builds, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// setConfigField sets the inbox.Config field of "Name=value" as the
// consumer program does, so that the floor mirrors its Workers and
// MaxBatchRecords.
func setConfigField(cfg *inbox.Config, s string) error {
	name, value, ok := strings.Cut(s, "=")
	n, err := strconv.Atoi(value)
	switch {
	case !ok:
		return fmt.Errorf("--inbox-set %q: want Name=value", s)
	case name == "Workers" && err == nil:
		cfg.Workers = n
	case name == "MaxBatchRecords" && err == nil:
		cfg.MaxBatchRecords = n
	case err != nil && (name == "Workers" || name == "MaxBatchRecords"):
		return fmt.Errorf("--inbox-set %s: %w", s, err)
	}
	return nil // other fields: the consumer program checks them
}

// inboxDB creates a database with the inbox tables and the accounts the
// handler updates, and returns its URL.
func (b *bencher) inboxDB(ctx context.Context) (string, error) {
	b.seq++
	url, err := devcluster.CreateDatabase(ctx, b.admin, fmt.Sprintf("inbox_%d_%d", os.Getpid(), b.seq))
	if err != nil {
		return "", err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, inbox.DDL("inbox")+fmt.Sprintf(`
		CREATE TABLE bench_accounts (id text PRIMARY KEY, n bigint NOT NULL);
		INSERT INTO bench_accounts SELECT g::text, 0 FROM generate_series(0, %d) g;`, inboxAccounts-1))
	return url, err
}

// inboxTopic creates a topic of parts partitions and, unless n is 0,
// produces n records to it (keys spread over the accounts, an id header
// each), returned with the partitions and offsets the broker gave them.
func (b *bencher) inboxTopic(ctx context.Context, k *broker, parts, n int) (string, []*kgo.Record, error) {
	b.seq++
	topic := fmt.Sprintf("bench.inbox.%d", b.seq)
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.addrs...), kgo.ProducerLinger(5*time.Millisecond))
	if err != nil {
		return "", nil, err
	}
	defer cl.Close()
	res, err := kadm.NewClient(cl).CreateTopics(ctx, int32(parts), -1, nil, topic)
	if err == nil {
		err = res.Error()
	}
	if err != nil {
		return "", nil, err
	}
	payload := []byte(`{"pad":"` + pad(b.cfg.PayloadBytes) + `"}`)
	recs := make([]*kgo.Record, n)
	for i := range recs {
		recs[i] = &kgo.Record{Topic: topic, Key: []byte(strconv.Itoa(i % inboxAccounts)), Value: payload,
			Headers: []kgo.RecordHeader{{Key: "id", Value: fmt.Appendf(nil, "%d-%08d", b.seq, i)}}}
	}
	for i := 0; i < n; i += 10000 {
		if err := cl.ProduceSync(ctx, recs[i:min(i+10000, n)]...).FirstErr(); err != nil {
			return "", nil, err
		}
	}
	return topic, recs, nil
}

// consumerProc is a running consumer program.
type consumerProc struct {
	cmd *exec.Cmd
	out *strings.Builder
}

func startConsumer(cb consumerBuild, url string, k *broker, topic, group string) (*consumerProc, error) {
	args := []string{"-pg-url", url, "-brokers", strings.Join(k.addrs, ","), "-topic", topic, "-group", group}
	for _, s := range cb.set {
		args = append(args, "-set", s)
	}
	cmd := exec.Command(cb.bin, args...)
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &consumerProc{cmd: cmd, out: out}, nil
}

// stop ends the process (SIGTERM, then SIGKILL after 30s) and returns
// its CPU time.
func (p *consumerProc) stop() time.Duration {
	cpu, _ := cpuTime(p.cmd.Process.Pid)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
	return cpu
}

func (p *consumerProc) exited() error {
	if p.cmd.ProcessState != nil {
		return errors.New("the consumer exited: " + lastLinesOf(p.out.String(), 20))
	}
	return nil
}

func lastLinesOf(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// inboxDrain measures, on a backlog of --inbox-events records on a topic
// of parts partitions, the consumer under test, the compared one and the
// floors, each on a database of its own.
func (b *bencher) inboxDrain(ctx context.Context, k *broker, parts int, builds []consumerBuild, cfg inbox.Config) (Result, error) {
	n := b.cfg.InboxEvents
	topic, recs, err := b.inboxTopic(ctx, k, parts, n)
	if err != nil {
		return Result{}, err
	}
	load := loadAverage()
	res := Result{Scenario: "inbox", Params: fmt.Sprintf("partitions=%d events=%d payload=%dB workers=%d batch=%d broker=%s", parts, n, b.cfg.PayloadBytes, cfg.Workers, cfg.MaxBatchRecords, k.name),
		Metrics: map[string]float64{}}
	for i, cb := range builds {
		url, err := b.inboxDB(ctx)
		if err != nil {
			return Result{}, err
		}
		// A group per build: the consumer starts from Kafka's committed
		// offsets where its database has no position.
		rate, cpu, err := b.drainInbox(ctx, cb, url, k, topic, fmt.Sprintf("%s.%d", topic, i), n)
		if err != nil {
			return Result{}, err
		}
		name := map[bool]string{true: "effects_per_s", false: "compare_effects_per_s"}[i == 0]
		res.Metrics[name] = rate
		res.Metrics[strings.TrimSuffix(name, "effects_per_s")+"cpu_us_per_effect"] = float64(cpu.Microseconds()) / float64(n)
	}
	if v, ok := res.Metrics["compare_effects_per_s"]; ok && v > 0 {
		res.Metrics["speedup"] = res.Metrics["effects_per_s"] / v
	}
	workers := min(parts, cfg.Workers)
	for _, sp := range []bool{false, true} {
		url, err := b.inboxDB(ctx)
		if err != nil {
			return Result{}, err
		}
		rate, err := inboxFloor(ctx, url, recs, workers, cfg.MaxBatchRecords, sp)
		if err != nil {
			return Result{}, err
		}
		res.Metrics[map[bool]string{false: "floor_effects_per_s", true: "floor_savepoint_effects_per_s"}[sp]] = rate
	}
	res.Metrics["floor_ratio"] = res.Metrics["effects_per_s"] / res.Metrics["floor_effects_per_s"]
	res.Metrics["load1"] = (load + loadAverage()) / 2
	b.logf("inbox partitions=%d: %.0f effects/s (compared %.0f), floor %.0f (with savepoints %.0f), load %.1f", parts, res.Metrics["effects_per_s"],
		res.Metrics["compare_effects_per_s"], res.Metrics["floor_effects_per_s"], res.Metrics["floor_savepoint_effects_per_s"], res.Metrics["load1"])
	return res, nil
}

// drainInbox runs the consumer cb until it applied the topic's n records,
// and returns its rate, from its first effect seen to its last, and its
// CPU time.
func (b *bencher) drainInbox(ctx context.Context, cb consumerBuild, url string, k *broker, topic, group string, n int) (float64, time.Duration, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close(context.Background())
	p, err := startConsumer(cb, url, k, topic, group)
	if err != nil {
		return 0, 0, err
	}
	var first time.Time
	var atFirst int64
	deadline := time.Now().Add(30 * time.Minute)
	for {
		var done int64
		if err := conn.QueryRow(ctx, "SELECT sum(n) FROM bench_accounts").Scan(&done); err != nil {
			p.stop()
			return 0, 0, err
		}
		now := time.Now()
		if done > 0 && first.IsZero() {
			first, atFirst = now, done
		}
		if done >= int64(n) {
			cpu := p.stop()
			if done > int64(n) {
				return 0, 0, fmt.Errorf("%d effects of %d records: a record was applied twice", done, n)
			}
			if now.Equal(first) || int64(n) == atFirst {
				return 0, 0, fmt.Errorf("the %d records were applied before a second look: raise --inbox-events", n)
			}
			return float64(int64(n)-atFirst) / now.Sub(first).Seconds(), cpu, nil
		}
		if err := p.exited(); err != nil {
			return 0, 0, err
		}
		if now.After(deadline) {
			p.stop()
			return 0, 0, fmt.Errorf("%d of %d effects after 30 minutes:\n%s", done, n, lastLinesOf(p.out.String(), 20))
		}
		time.Sleep(10 * time.Millisecond) // polling the effects' sum
	}
}

// inboxFloor runs the consumer's database work for recs without Kafka:
// each partition's records in batches of batch records, the partitions
// spread over workers connections, with a savepoint around each record's
// UPDATE when savepoints is set. It returns effects per second.
func inboxFloor(ctx context.Context, url string, recs []*kgo.Record, workers, batch int, savepoints bool) (float64, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return 0, err
	}
	cfg.MaxConns = int32(workers)
	db, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	byPart := map[int32][]*kgo.Record{}
	for _, r := range recs {
		byPart[r.Partition] = append(byPart[r.Partition], r)
	}
	parts := slices.Sorted(func(yield func(int32) bool) {
		for p := range byPart {
			if !yield(p) {
				return
			}
		}
	})
	for _, p := range parts {
		if _, err := db.Exec(ctx, "INSERT INTO inbox_offsets (consumer_group, topic, partition, next_offset) VALUES ('bench', $1, $2, 0)", recs[0].Topic, p); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := w; i < len(parts); i += workers {
				rs := byPart[parts[i]]
				for j := 0; j < len(rs); j += batch {
					if err := floorBatch(ctx, db, rs[j:min(j+batch, len(rs))], savepoints); err != nil {
						errs <- err
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	return float64(len(recs)) / time.Since(start).Seconds(), nil
}

// floorBatch sends the statements of one consumer batch of rs.
func floorBatch(ctx context.Context, db *pgxpool.Pool, rs []*kgo.Record, savepoints bool) error {
	ids := make([]string, len(rs))
	for i, r := range rs {
		ids[i] = string(r.Headers[0].Value)
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		b.Queue("INSERT INTO inbox (consumer, message_id) SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING RETURNING message_id", "bench", slices.Sorted(slices.Values(ids)))
		b.Queue("SELECT message_id, attempts, last_error FROM inbox_attempts WHERE consumer = $1 AND message_id = ANY($2)", "bench", ids)
		b.Queue("UPDATE inbox_offsets SET next_offset = $3, updated_at = now() WHERE consumer_group = 'bench' AND topic = $1 AND partition = $2",
			rs[0].Topic, rs[0].Partition, rs[len(rs)-1].Offset+1)
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		for _, r := range rs {
			q := pgx.Tx(tx)
			if savepoints {
				sp, err := tx.Begin(ctx)
				if err != nil {
					return err
				}
				q = sp
			}
			if _, err := q.Exec(ctx, "UPDATE bench_accounts SET n = n + 1 WHERE id = $1", string(r.Key)); err != nil {
				return err
			}
			if savepoints {
				if err := q.Commit(ctx); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// inboxLatency produces records at rate per second, evenly spaced, for
// --duration after a 2 s warm-up, to a consumer cb that keeps up, and
// measures each record's time from its produce call to its effect's
// commit.
func (b *bencher) inboxLatency(ctx context.Context, k *broker, rate int, cb consumerBuild) (Result, error) {
	url, err := b.inboxDB(ctx)
	if err != nil {
		return Result{}, err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return Result{}, err
	}
	defer conn.Close(context.Background())
	var track string
	if err := conn.QueryRow(ctx, "SHOW track_commit_timestamp").Scan(&track); err != nil || track != "on" {
		return Result{}, fmt.Errorf("the inbox latency needs track_commit_timestamp = on in the server (the bench's own cluster has it; set it on --pg-url's): %q, %v", track, err)
	}
	topic, _, err := b.inboxTopic(ctx, k, inboxLatencyPartitions, 0)
	if err != nil {
		return Result{}, err
	}
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	// Durable commits, as in production.
	p, err := startConsumer(cb, url+sep+"synchronous_commit=on", k, topic, topic)
	if err != nil {
		return Result{}, err
	}
	defer p.stop()
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.addrs...), kgo.ProducerLinger(0))
	if err != nil {
		return Result{}, err
	}
	defer cl.Close()

	// Until the consumer joined: a first record's effect.
	warm := &kgo.Record{Topic: topic, Key: []byte("0"), Value: []byte("{}"), Headers: []kgo.RecordHeader{{Key: "id", Value: []byte("warm")}}}
	if err := cl.ProduceSync(ctx, warm).FirstErr(); err != nil {
		return Result{}, err
	}
	for deadline := time.Now().Add(time.Minute); ; {
		var n int64
		if err := conn.QueryRow(ctx, "SELECT sum(n) FROM bench_accounts").Scan(&n); err != nil {
			return Result{}, err
		}
		if n > 0 {
			break
		}
		if err := p.exited(); err != nil {
			return Result{}, err
		}
		if time.Now().After(deadline) {
			return Result{}, fmt.Errorf("the consumer applied no record in a minute:\n%s", lastLinesOf(p.out.String(), 20))
		}
		time.Sleep(10 * time.Millisecond) // polling for the first effect
	}

	payload := []byte(`{"pad":"` + pad(b.cfg.PayloadBytes) + `"}`)
	measureFrom := time.Now().Add(2 * time.Second)
	total := b.cfg.Duration + time.Until(measureFrom)
	interval := time.Second / time.Duration(rate)
	sent := map[string]time.Time{}
	var mu sync.Mutex
	var produceErr error
	next, stop := time.Now(), time.Now().Add(total)
	for i := 0; time.Now().Before(stop); i++ {
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		}
		next = next.Add(interval)
		id := fmt.Sprintf("r%08d", i)
		at := time.Now()
		if at.After(measureFrom) {
			sent[id] = at
		}
		cl.Produce(ctx, &kgo.Record{Topic: topic, Key: []byte(strconv.Itoa(i % inboxAccounts)), Value: payload,
			Headers: []kgo.RecordHeader{{Key: "id", Value: []byte(id)}}}, func(_ *kgo.Record, err error) {
			if err != nil {
				mu.Lock()
				produceErr = err
				mu.Unlock()
			}
		})
	}
	if err := cl.Flush(ctx); err != nil {
		return Result{}, err
	}
	mu.Lock()
	err = produceErr
	mu.Unlock()
	if err != nil {
		return Result{}, err
	}
	// The last records' effects.
	want := int64(len(sent))
	var lat []time.Duration
	for deadline := time.Now().Add(time.Minute); ; {
		lat = lat[:0]
		rows, err := conn.Query(ctx, "SELECT message_id, pg_xact_commit_timestamp(xmin) FROM inbox WHERE message_id LIKE 'r%'")
		if err != nil {
			return Result{}, err
		}
		for rows.Next() {
			var id string
			var at time.Time
			if err := rows.Scan(&id, &at); err != nil {
				return Result{}, err
			}
			if s, ok := sent[id]; ok {
				lat = append(lat, at.Sub(s))
			}
		}
		if err := rows.Err(); err != nil {
			return Result{}, err
		}
		if int64(len(lat)) >= want {
			break
		}
		if time.Now().After(deadline) {
			return Result{}, fmt.Errorf("%d of %d records' effects a minute after the last was produced", len(lat), want)
		}
		time.Sleep(50 * time.Millisecond) // polling for the last effects
	}
	slices.Sort(lat)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	res := Result{
		Scenario: "inbox-latency",
		Params:   fmt.Sprintf("rate=%d/s duration=%s partitions=%d payload=%dB broker=%s synchronous_commit=on%s", rate, b.cfg.Duration, inboxLatencyPartitions, b.cfg.PayloadBytes, k.name, cb.label),
		Metrics: map[string]float64{
			"p50_ms":        ms(lat[len(lat)/2]),
			"p99_ms":        ms(lat[len(lat)*99/100]),
			"max_ms":        ms(lat[len(lat)-1]),
			"achieved_rate": float64(len(lat)) / b.cfg.Duration.Seconds(),
			"events":        float64(len(lat)),
			"load1":         loadAverage(),
		},
	}
	b.logf("inbox latency rate=%d%s: p50 %.1fms p99 %.1fms max %.1fms over %d records", rate, cb.label, res.Metrics["p50_ms"], res.Metrics["p99_ms"], res.Metrics["max_ms"], len(lat))
	return res, nil
}
