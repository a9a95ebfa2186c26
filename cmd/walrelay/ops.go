package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/walrelay/walrelay/doctor"
	"github.com/walrelay/walrelay/holds"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// statusCmd is `walrelay status`: the slot at a glance, for people, cron
// and probes.
type statusCmd struct {
	PGURL         string `name:"pg-url" required:"" help:"Source database URL."`
	Slot          string `default:"${slot}" help:"Logical replication slot."`
	JSON          bool   `name:"json" help:"Print JSON instead of text."`
	MaxLagBytes   int64  `default:"1073741824" help:"Exit 1 when the slot's confirmed lag (current LSN − confirmed_flush_lsn) exceeds this; 0 disables."`
	RequireActive bool   `help:"Exit 1 when no relay is streaming from the slot (without it, an idle slot is a warning)."`
	RecordSchema  string `default:"${record_schema}" help:"Schema of walrelay's record of what each slot streams from."`
	PrimaryFlag   `embed:""`
	StandbyURL    []string `name:"standby-url" placeholder:"URL" help:"URL of a standby of the primary (repeat the flag, or separate with commas; every node may be listed, a server that accepts writes is skipped): walrelay reads the slot's copy there, which the primary cannot see, and says the failover is protected only when every standby's copy is synchronized and current. Give it as WALRELAY_STANDBY_URL, passwords in a passfile or PGPASSWORD: arguments are visible to every user in ps."`
	PGAuthFlags   `embed:""`
	Explain       bool `help:"Name what holds the slot's restart_lsn and catalog_xmin back, most to blame first (the relay stopped, not streaming, waiting for Kafka or behind; open and prepared transactions; a quiet outbox without heartbeats), then what holds the cluster's WAL or xmin (other slots, standbys), each with its fix."`
	// The time the slot has left.
	RateWindow    time.Duration `default:"1s" help:"When max_slot_wal_keep_size limits the slot, watch the server's WAL position this long to measure its WAL rate and the time left before invalidation; 0 skips it."`
	PlannedOutage time.Duration `default:"${planned_outage}" help:"Warn when, at the measured WAL rate, max_slot_wal_keep_size would invalidate the slot sooner than this without a relay confirming, or idle_replication_slot_timeout is shorter; 0 disables."`
	// What the relay itself reports.
	RelayURL string `name:"relay-url" placeholder:"URL" help:"The running relay's metrics listener (http://127.0.0.1:9187): its /status names what holds delivery (Kafka, its authorization, the token source, the schema registry, PostgreSQL, the standby's replay, the publication watch), each hold a problem (exit 1); unreadable, a warning. Default: http://$WALRELAY_METRICS_ADDR when that variable (run's --metrics-addr) is set, else none."`
}

// Validate refuses malformed flags before anything is connected.
func (c *statusCmd) Validate() error {
	for _, u := range c.StandbyURL {
		if err := slot.CheckURL(u); err != nil {
			return fmt.Errorf("--standby-url: %w", err)
		}
	}
	if err := validatePrimaryURL(c.PrimaryURL); err != nil {
		return err
	}
	return validateSource(c.PGURL, c.Slot, nil)
}

func (c *statusCmd) Run(ctx context.Context, lf *LogFlags) error {
	log, err := lf.logger()
	if err != nil {
		return err
	}
	if err := c.PGAuthFlags.install(ctx, log); err != nil {
		return err
	}
	// status logs only what a password source says: for people the TLS
	// warning goes to stderr, keeping stdout to the slot's figures; --json
	// output, read by probes and scripts that often merge the streams,
	// stays JSON alone.
	if w := slot.TLSWarning(c.PGURL); w != "" && !c.JSON {
		fmt.Fprintln(os.Stderr, "walrelay: WARNING: "+w)
	}
	conn, err := slot.Connect(ctx, c.PGURL)
	if err != nil {
		return &exitError{code: exitFailed, err: err}
	}
	defer conn.Close(context.Background())
	opts := doctor.StatusOptions{
		Slot: c.Slot, MaxLagBytes: c.MaxLagBytes, RequireActive: c.RequireActive, StandbyURLs: c.StandbyURL,
		Explain: c.Explain, RateWindow: c.RateWindow, PlannedOutage: c.PlannedOutage,
		DecodedOnStandby: c.PrimaryURL != "",
	}
	rconn, closeRecord, err := c.PrimaryFlag.writeConn(ctx, conn)
	if err == nil && c.PrimaryURL != "" {
		err = takesWrites(ctx, rconn)
		if err != nil {
			closeRecord()
		}
	}
	if err != nil {
		if c.PrimaryURL == "" {
			return &exitError{code: exitFailed, err: err}
		}
		// The slot and its stream need no primary: status reports on
		// them, with the record's copy replayed on the standby, and names
		// the primary unreachable as a problem.
		opts.PrimaryUnreachable = err.Error()
		rconn, closeRecord = conn, func() {}
	}
	defer closeRecord()
	rec, recorded, err := source.ReadRecord(ctx, rconn, c.RecordSchema, c.Slot)
	if err != nil {
		return &exitError{code: exitFailed, err: err}
	}
	if recorded {
		r := rec.Recorded(c.RecordSchema)
		opts.Record = &r
	}
	if u := c.relayURL(); u != "" {
		opts.RelayURL = u
		if rs, err := readRelayStatus(ctx, u); err != nil {
			opts.RelayUnreadable = err.Error()
		} else {
			opts.Relay = rs
		}
	}
	st, err := doctor.ReadStatus(ctx, conn, opts)
	if err != nil {
		return &exitError{code: exitFailed, err: err}
	}
	return c.report(st)
}

// relayURL is --relay-url, or the listener run's WALRELAY_METRICS_ADDR
// names (an address without a host is this machine's); "" for none.
func (c *statusCmd) relayURL() string {
	if c.RelayURL != "" {
		return strings.TrimSuffix(c.RelayURL, "/")
	}
	addr := os.Getenv("WALRELAY_METRICS_ADDR")
	if addr == "" {
		return ""
	}
	if strings.HasPrefix(addr, ":") {
		addr = "127.0.0.1" + addr
	}
	return "http://" + addr
}

// relayStatusTimeout bounds the read of a relay's /status: a relay that
// does not answer in it is reported unreadable, not waited for.
const relayStatusTimeout = 5 * time.Second

// readRelayStatus reads what the relay at base reports of itself.
func readRelayStatus(ctx context.Context, base string) (*holds.Status, error) {
	ctx, cancel := context.WithTimeout(ctx, relayStatusTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/status", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("it answered %s", resp.Status)
	}
	var st holds.Status
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&st); err != nil {
		return nil, fmt.Errorf("its answer is not a relay's status: %w", err)
	}
	return &st, nil
}

// report prints st and exits 1 when it has problems.
func (c *statusCmd) report(st doctor.Status) error {
	// The doctor names configuration fields; status speaks flags.
	st.Failover = speakFlags(st.Failover)
	for _, list := range [][]string{st.Problems, st.Warnings} {
		for i := range list {
			list[i] = speakFlags(list[i])
		}
	}
	for i := range st.Explain {
		c := &st.Explain[i]
		c.Holds, c.Text, c.Fix = speakFlags(c.Holds), speakFlags(c.Text), speakFlags(c.Fix)
	}
	if c.JSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(st); err != nil {
			return err
		}
	} else {
		printStatus(os.Stdout, st)
	}
	if !st.Healthy {
		return &exitError{code: exitUnhealthy, err: errors.New(strings.Join(st.Problems, "; "))}
	}
	return nil
}

func printStatus(w io.Writer, st doctor.Status) {
	health := "ok"
	if len(st.Warnings) > 0 {
		health = "ok, but WARNING: " + strings.Join(st.Warnings, "; ")
	}
	if !st.Healthy {
		health = "UNHEALTHY: " + strings.Join(st.Problems, "; ")
	}
	if cr := st.Creating; cr != nil {
		creating := fmt.Sprintf("yes: walsender pid %d, waiting %s", cr.WalsenderPID, doctor.DurationText(time.Duration(cr.WaitedSeconds*float64(time.Second))))
		if cr.CreatingSlot != "" && cr.CreatingSlot != st.Slot {
			creating += fmt.Sprintf(" (first the initial snapshot's temporary slot %q)", cr.CreatingSlot)
		}
		rows := [][2]string{{"slot", st.Slot + " (not created yet)"}, {"creating", creating}, {"waiting_for", cr.WaitingFor}}
		if cr.Fix != "" {
			rows = append(rows, [2]string{"fix", cr.Fix})
		}
		for _, row := range append(rows, [2]string{"health", health}) {
			fmt.Fprintf(w, "%-20s %s\n", row[0], row[1])
		}
		printExplain(w, st)
		return
	}
	active := "NO: no relay is streaming from this slot"
	if st.Active {
		active = "yes"
		if st.ActivePID != nil {
			active = fmt.Sprintf("yes (pid %d)", *st.ActivePID)
		}
	}
	safe := "unlimited"
	switch {
	case st.WALStatus == "lost":
		safe = "none (the slot is lost)"
	case st.SafeWALSize != nil:
		safe = bytesText(*st.SafeWALSize)
	}
	restart := st.RestartLSN
	if restart == "0/0" {
		restart = "none (its WAL was removed)"
	}
	retained := bytesText(st.RetainedWALBytes)
	if st.InvalidationReason != "" {
		retained = "none (PostgreSQL keeps no WAL for an invalidated slot)"
	}
	inactive := "no: streamed now"
	switch {
	case st.InactiveSince != nil:
		inactive = st.InactiveSince.UTC().Format(time.RFC3339)
	case !st.Active && st.RecordUpdatedAt != nil:
		inactive = fmt.Sprintf("unknown (PostgreSQL 17+ reports it); walrelay last moved its record of the slot at %s", st.RecordUpdatedAt.UTC().Format(time.RFC3339))
	case !st.Active:
		inactive = "unknown (PostgreSQL 17+ reports it)"
	}
	invalidated := "no"
	if st.InvalidationReason != "" {
		invalidated = st.InvalidationSource
	}
	rows := [][2]string{
		{"slot", st.Slot}, {"plugin", st.Plugin}, {"database", st.Database}, {"active", active},
		{"restart_lsn", restart}, {"confirmed_flush_lsn", st.ConfirmedFlushLSN}, {"current_lsn", st.CurrentLSN},
		{"retained_wal", retained}, {"confirmed_lag", bytesText(st.ConfirmedLagBytes)},
		{"wal_status", st.WALStatus}, {"safe_wal_size", safe},
	}
	if st.WALRate != nil {
		rows = append(rows, [2]string{"wal_rate", bytesText(int64(*st.WALRate)) + "/s"})
	}
	if st.TimeToInvalidation != nil {
		rows = append(rows, [2]string{"time_left", fmt.Sprintf("about %s at this WAL rate before max_slot_wal_keep_size invalidates the slot, if it stops moving", doctor.DurationText(time.Duration(*st.TimeToInvalidation*float64(time.Second))))})
	}
	if r := st.StandbyReplay; r != nil {
		rows = append(rows, [2]string{"standby_replay", r.Text()})
	}
	if r := st.Relay; r != nil {
		rows = append(rows, [2]string{"relay", relayText(*r)})
	}
	rows = append(rows, [2]string{"inactive_since", inactive}, [2]string{"invalidated", invalidated},
		[2]string{"failover", st.Failover}, [2]string{"health", health})
	for _, row := range rows {
		fmt.Fprintf(w, "%-20s %s\n", row[0], row[1])
	}
	printExplain(w, st)
}

// relayText is what the relay reports of itself, on one line.
func relayText(r holds.Status) string {
	if r.Ready {
		return "ready, streaming"
	}
	if len(r.Holds) == 0 {
		return "NOT READY: " + r.NotReady
	}
	var parts []string
	for _, h := range r.Holds {
		parts = append(parts, fmt.Sprintf("%s (%s since %s)", h.Dependency, h.Reason, h.Since.UTC().Format(time.RFC3339)))
	}
	return "NOT READY: delivery held by " + strings.Join(parts, ", ")
}

// printExplain prints what --explain found.
func printExplain(w io.Writer, st doctor.Status) {
	if st.Explain == nil {
		return
	}
	if len(st.Explain) == 0 {
		fmt.Fprintf(w, "%-20s %s\n", "explain", "nothing holds the slot back: what it retains is the WAL since PostgreSQL's last running-transactions record, which moves restart_lsn every 15 s")
		return
	}
	fmt.Fprintf(w, "%-20s %s\n", "explain", "what holds the slot, most to blame first:")
	for i, c := range st.Explain {
		fmt.Fprintf(w, "  %d. %s (holds %s): %s\n     fix: %s\n", i+1, c.Kind, c.Holds, c.Text, c.Fix)
	}
}

// bytesText prints a byte count for people, with the exact figure.
func bytesText(n int64) string { return doctor.BytesText(n) }

// setupCmd is `walrelay setup`: print the outbox DDL, check the database,
// create the publication and slot.
type setupCmd struct {
	PGURL       string   `name:"pg-url" required:"" help:"Source database URL."`
	Publication string   `default:"${publication}" help:"Publication to create."`
	Slot        string   `default:"${slot}" help:"Logical replication slot to create (pgoutput)."`
	Table       []string `default:"${table}" help:"Outbox table, schema.table; repeatable."`
	CreateTable bool     `help:"Create missing outbox tables with the printed DDL."`
	ColumnFlags `embed:""`
	PGAuthFlags `embed:""`
	PrimaryFlag `embed:""`

	// What setup may accept of an existing publication, as for run.
	AlterPublication bool   `help:"Add missing outbox tables to an existing publication walrelay did not create (it may be shared)."`
	AllowRowFilter   bool   `help:"Accept a publication row filter (WHERE) on an outbox table; rows it filters out are never published."`
	FailoverSlot     bool   `default:"${failover_slot}" negatable:"" help:"PostgreSQL 17+: make the slot a failover slot, which standbys with sync_replication_slots = on keep a copy of."`
	RecordSchema     string `default:"${record_schema}" help:"Schema of walrelay's record of what each slot streams from."`
	AcceptGap        bool   `help:"Go on after something walrelay streamed from was replaced or removed (the slot lost in a failover, the publication dropped or altered, an outbox table recreated or removed from it): log the gap, keep it in the record, create again what is missing. Events committed in the gap are not published; walrelay snapshot publishes the rows still in the outbox."`
}

// Validate refuses malformed flags before anything is connected.
func (c *setupCmd) Validate() error {
	if err := validateSource(c.PGURL, c.Slot, &c.Publication); err != nil {
		return err
	}
	if err := validatePrimaryURL(c.PrimaryURL); err != nil {
		return err
	}
	if _, err := parseTables(c.Table); err != nil {
		return err
	}
	_, err := c.mapping()
	return err
}

func (c *setupCmd) Run(ctx context.Context, lf *LogFlags) error {
	log, err := lf.logger()
	if err != nil {
		return err
	}
	if err := c.PGAuthFlags.install(ctx, log); err != nil {
		return err
	}
	warnPGTLS(log, c.PGURL)
	tabs, err := parseTables(c.Table)
	if err != nil {
		return usageError(err)
	}
	m, err := c.mapping()
	if err != nil {
		return usageError(err)
	}
	for _, t := range c.Table {
		fmt.Printf("-- outbox table walrelay expects (write pattern: insert and delete in the business transaction)\n%s\n\n", outboxDDL(t))
	}
	if c.CreateTable {
		conn, err := slot.Connect(ctx, c.PrimaryFlag.writeURL(c.PGURL))
		if err != nil {
			return &exitError{code: exitFailed, err: err}
		}
		defer conn.Close(context.Background())
		for _, t := range c.Table {
			created, err := ensureOutboxTable(ctx, conn, t)
			if err != nil {
				return &exitError{code: exitFailed, err: err}
			}
			if created {
				fmt.Printf("created table %s\n", qualify(t))
			}
		}
	}
	rec, err := source.Prepare(ctx, source.SetupConfig{
		URL: c.PGURL, PrimaryURL: c.PrimaryURL, Slot: c.Slot, Publication: c.Publication, Tables: tabs, Columns: m.Columns(),
		CreatePublication: true, CreateSlot: true, AlterPublication: c.AlterPublication, AllowRowFilter: c.AllowRowFilter,
		Failover: c.FailoverSlot, RecordSchema: c.RecordSchema, AcceptGap: c.AcceptGap,
	}, log)
	if err != nil {
		return &exitError{code: exitFailed, err: err}
	}
	if g := rec.Accepted; g != nil {
		fmt.Printf("accepted a gap, kept in %s.slots: %s; events committed after %s are not published through the slot: publish the rows still in the outbox tables with walrelay snapshot --pg-url … --brokers … --table %s\n",
			c.RecordSchema, g.What, g.Since, strings.Join(c.Table, " --table "))
	}
	conn, err := slot.Connect(ctx, c.PrimaryFlag.writeURL(c.PGURL))
	if err != nil {
		return &exitError{code: exitFailed, err: err}
	}
	defer conn.Close(context.Background())
	pub, err := source.ReadPublication(ctx, conn, c.Publication, tabs)
	if err != nil {
		return &exitError{code: exitFailed, err: err}
	}
	var published []string
	for _, line := range publicationSummary(pub) {
		fmt.Println(line)
	}
	for _, t := range pub.Tables {
		s := t.Table.String()
		if t.Partitioned {
			s += " (partitioned, via root)"
		}
		published = append(published, s)
	}
	fmt.Printf("ready: publication %q publishes inserts of %s; slot %q (pgoutput) exists\n", c.Publication, strings.Join(published, ", "), c.Slot)
	return nil
}

// publicationSummary says what the publication publishes, one line for it
// and one per outbox table: what `setup` checked, in words.
func publicationSummary(p source.Publication) []string {
	owner := "not created by walrelay: walrelay adds tables to it only with --alter-publication"
	if p.Owned {
		owner = "created by walrelay"
	}
	if p.AllTables {
		owner += "; FOR ALL TABLES: every table's inserts stream to walrelay"
	}
	lines := []string{fmt.Sprintf("publication %q: %s; publish_via_partition_root = %t", p.Name, owner, p.ViaRoot)}
	for _, t := range p.Tables {
		kind := "table"
		if t.Partitioned {
			kind = fmt.Sprintf("partitioned table (partitions now: %d), published via root as %s, partitions attached later included", t.Partitions, t.Table)
		}
		filter := "none"
		if t.RowFilter != "" {
			filter = "WHERE " + t.RowFilter + " (rows it filters out are never published)"
		}
		cols := "all"
		if t.Columns != nil {
			cols = strings.Join(t.Columns, ", ")
		}
		lines = append(lines, fmt.Sprintf("  %s: %s; row filter: %s; columns: %s", t.Table, kind, filter, cols))
	}
	return lines
}

// dropCmd is `walrelay drop`: remove the slot (and the publication).
type dropCmd struct {
	PGURL           string `name:"pg-url" required:"" help:"Source database URL."`
	Slot            string `default:"${slot}" help:"Logical replication slot to drop."`
	Publication     string `default:"${publication}" help:"Publication the slot streams: its pending rows are counted, and it is dropped with --drop-publication."`
	DropPublication bool   `help:"Also drop the publication."`
	Force           bool   `help:"Drop the slot even when it holds committed outbox rows not yet published (they are lost to the relay), or when they cannot be counted."`
	RecordSchema    string `default:"${record_schema}" help:"Schema of walrelay's record of what each slot streams from: the slot's record is removed with it, so the next start is a first start."`
	PGAuthFlags     `embed:""`
	PrimaryFlag     `embed:""`
}

// Validate refuses malformed flags before anything is connected.
func (c *dropCmd) Validate() error {
	if err := validatePrimaryURL(c.PrimaryURL); err != nil {
		return err
	}
	return validateSource(c.PGURL, c.Slot, &c.Publication)
}

// maxPeekChanges bounds how much of the slot drop decodes to count pending
// rows; past it drop says "at least".
const maxPeekChanges = 1_000_000

func (c *dropCmd) Run(ctx context.Context, lf *LogFlags) error {
	log, err := lf.logger()
	if err != nil {
		return err
	}
	if err := c.PGAuthFlags.install(ctx, log); err != nil {
		return err
	}
	warnPGTLS(log, c.PGURL)
	conn, err := slot.Connect(ctx, c.PGURL)
	if err != nil {
		return &exitError{code: exitFailed, err: err}
	}
	defer conn.Close(context.Background())
	info, err := slot.ReadInfo(ctx, conn, c.Slot)
	switch {
	case errors.Is(err, slot.ErrNoSlot):
		fmt.Printf("slot %q does not exist\n", c.Slot)
	case err != nil:
		return &exitError{code: exitFailed, err: err}
	case info.Active:
		return &exitError{code: exitFailed, err: fmt.Errorf("slot %q is in use by pid %s: stop the relay streaming from it first", c.Slot, pidText(info.ActivePID))}
	default:
		if err := c.dropSlot(ctx, conn, info, log); err != nil {
			return err
		}
	}
	if c.DropPublication {
		wconn, closeW, err := c.PrimaryFlag.writeConn(ctx, conn)
		if err != nil {
			return &exitError{code: exitFailed, err: err}
		}
		defer closeW()
		if _, err := wconn.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{c.Publication}.Sanitize()); err != nil {
			return &exitError{code: exitFailed, err: fmt.Errorf("drop publication %q: %w", c.Publication, err)}
		}
		fmt.Printf("dropped publication %q\n", c.Publication)
	}
	return nil
}

// dropSlot drops the slot after counting what it discards: the committed
// rows of the publication it has not confirmed, and the WAL past its
// confirmed position. Without --force it refuses when rows are pending or
// cannot be counted.
func (c *dropCmd) dropSlot(ctx context.Context, conn *pgx.Conn, info slot.Info, log *zap.Logger) error {
	if info.Invalidated() {
		return c.dropInvalidated(ctx, conn, info, log)
	}
	rows, complete, perr := pendingRows(ctx, conn, c.Slot, c.Publication)
	discards := fmt.Sprintf("%s of WAL past its confirmed position %s", bytesText(info.LagBytes), info.ConfirmedLSN)
	switch {
	case perr != nil:
		discards = fmt.Sprintf("an unknown number of outbox rows (cannot count them: %v) and %s", perr, discards)
	case complete:
		discards = fmt.Sprintf("%d outbox rows not yet published and %s", rows, discards)
	default:
		discards = fmt.Sprintf("at least %d outbox rows not yet published and %s", rows, discards)
	}
	if (perr != nil || rows > 0) && !c.Force {
		return &exitError{code: exitFailed, err: fmt.Errorf("slot %q still holds %s; dropping it loses them for the relay: run the relay until `walrelay status` shows no lag, or pass --force to drop anyway", c.Slot, discards)}
	}
	_, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", c.Slot)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "55006":
		return &exitError{code: exitFailed, err: fmt.Errorf("slot %q is in use (%s): stop the relay streaming from it first", c.Slot, pgErr.Message)}
	case errors.As(err, &pgErr) && pgErr.Code == "42704":
		fmt.Printf("slot %q does not exist\n", c.Slot)
		return nil
	case err != nil:
		return &exitError{code: exitFailed, err: fmt.Errorf("drop slot %q: %w", c.Slot, err)}
	}
	if err := c.dropRecord(ctx, conn); err != nil {
		return &exitError{code: exitFailed, err: fmt.Errorf("dropped slot %q, but cannot remove walrelay's record of it (the next start refuses as if the slot had been lost): %w", c.Slot, err)}
	}
	fmt.Printf("dropped slot %q, discarding %s: PostgreSQL no longer keeps WAL for it; events written from now on are not captured until a new slot exists\n", c.Slot, discards)
	log.Info("dropped replication slot", zap.String("slot", c.Slot), zap.Int64("pending_rows", rows), zap.Bool("pending_rows_counted", perr == nil),
		zap.Int64("confirmed_lag_bytes", info.LagBytes))
	return nil
}

// dropInvalidated drops a slot PostgreSQL invalidated. Nothing can count
// what it did not deliver, since its WAL is gone, and no relay can run on
// it to deliver it, so drop neither counts nor asks for --force: it says
// what may be missing and the way on.
func (c *dropCmd) dropInvalidated(ctx context.Context, conn *pgx.Conn, info slot.Info, log *zap.Logger) error {
	gap := doctor.ReadInvalidatedError(ctx, conn, info, 0)
	if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", c.Slot); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42704" {
			fmt.Printf("slot %q does not exist\n", c.Slot)
			return nil
		}
		return &exitError{code: exitFailed, err: fmt.Errorf("drop slot %q: %w", c.Slot, err)}
	}
	if err := c.dropRecord(ctx, conn); err != nil {
		return &exitError{code: exitFailed, err: fmt.Errorf("dropped slot %q, but cannot remove walrelay's record of it (the next start refuses as if the slot had been lost): %w", c.Slot, err)}
	}
	fmt.Printf("dropped slot %q without counting its pending rows: %s, and PostgreSQL kept no WAL for it, so what it had not delivered can be neither counted nor read; events committed after %s may be missing from Kafka. Next: walrelay run creates a new slot and, with --snapshot initial (the default), first publishes the rows still in the outbox tables (or: walrelay setup, then walrelay snapshot)\n",
		c.Slot, gap.What, gap.Since)
	log.Warn("dropped an invalidated replication slot", zap.String("slot", c.Slot), zap.String("what", gap.What), zap.Stringer("missing_after_lsn", gap.Since))
	return nil
}

// pendingRows counts the inserts the slot would still send for publication:
// committed after its confirmed position, in tables of the publication. It
// decodes the slot's WAL without consuming it
// (pg_logical_slot_peek_binary_changes with pgoutput's own options); complete
// is false when it stopped at maxPeekChanges.
func pendingRows(ctx context.Context, conn *pgx.Conn, slotName, publication string) (rows int64, complete bool, err error) {
	var changes int64
	// pgoutput's first byte of each message is its type; 'I' is an insert.
	err = conn.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE get_byte(data, 0) = 73), count(*)
		FROM pg_logical_slot_peek_binary_changes($1, NULL, $2, 'proto_version', '1', 'publication_names', $3)`,
		slotName, maxPeekChanges, pgx.Identifier{publication}.Sanitize()).Scan(&rows, &changes)
	if err != nil {
		return 0, false, err
	}
	return rows, changes < maxPeekChanges, nil
}

func pidText(pid *int32) string {
	if pid == nil {
		return "unknown"
	}
	return fmt.Sprint(*pid)
}

// dropRecord removes walrelay's record of the slot, on the primary when
// the slot is on a standby (--primary-url).
func (c *dropCmd) dropRecord(ctx context.Context, conn *pgx.Conn) error {
	wconn, closeW, err := c.PrimaryFlag.writeConn(ctx, conn)
	if err != nil {
		return err
	}
	defer closeW()
	return source.DropRecord(ctx, wconn, c.RecordSchema, c.Slot)
}

// PrimaryFlag is --primary-url for the commands that act on a slot: with
// --pg-url naming a hot standby, its primary, where walrelay's record and
// the publication are written.
type PrimaryFlag struct {
	PrimaryURL string `name:"primary-url" placeholder:"URL" help:"With --pg-url naming a hot standby walrelay decodes on (PostgreSQL 16+): its primary, where walrelay's record and the publication are written (and read, without waiting for replay). Give it as WALRELAY_PRIMARY_URL."`
}

// writeURL is the primary's URL, or pgURL without one.
func (f PrimaryFlag) writeURL(pgURL string) string {
	if f.PrimaryURL != "" {
		return f.PrimaryURL
	}
	return pgURL
}

// takesWrites says why conn's server, named by --primary-url, takes no
// writes (it is a hot standby); nil when it does.
func takesWrites(ctx context.Context, conn *pgx.Conn) error {
	var inRecovery bool
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
		return fmt.Errorf("--primary-url: %w", err)
	}
	if inRecovery {
		return errors.New("--primary-url names a hot standby: it takes no writes")
	}
	return nil
}

// writeConn is a connection to the primary, or conn without one; close
// closes what it opened.
func (f PrimaryFlag) writeConn(ctx context.Context, conn *pgx.Conn) (*pgx.Conn, func(), error) {
	if f.PrimaryURL == "" {
		return conn, func() {}, nil
	}
	w, err := slot.Connect(ctx, f.PrimaryURL)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to the primary (--primary-url): %w", err)
	}
	return w, func() { w.Close(context.Background()) }, nil
}
