package relay

// guard_pg_test.go: the guard against the package's real PostgreSQL
// (pg_test.go): where a stream starts, the refusals it writes into
// walrelay's record, the publication watch, whose walsender holds the
// slot, how the publication covers a table.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/walrelay/walrelay/confirm"
	"github.com/walrelay/walrelay/decoder"
	"github.com/walrelay/walrelay/metrics"
	"github.com/walrelay/walrelay/router"
	"github.com/walrelay/walrelay/slot"
	"github.com/walrelay/walrelay/source"
)

// preparedRelay is a relay of e's database after its start's setup: the
// publication, the slot (no initial snapshot) and walrelay's record exist,
// and the guard took the record. It returns the slot's confirmed position.
func preparedRelay(t *testing.T, e *pgEnv) (*Relay, *observer.ObservedLogs, *metrics.Metrics, decoder.LSN) {
	t.Helper()
	cfg := e.pgConfig()
	cfg.InitialSnapshot = false
	r, logs, m := observedRelay(t, cfg)
	rec, err := source.Prepare(e.ctx, r.setupConfig(), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	r.guard.prepared(e.ctx, rec)
	logs.TakeAll()
	return r, logs, m, e.slotConfirmed()
}

// ackedUpTo makes the relay's progress say Kafka acknowledged up to lsn,
// as a session would (confirmed up to confirmed).
func ackedUpTo(r *Relay, start, lsn, confirmed decoder.LSN) {
	c := confirm.New(confirm.Config{Start: start, Every: time.Second, Clearance: r.guard.clearance, Progress: r.progress})
	c.Commit(c.Begin(time.Now()), lsn)
	c.Acknowledged()
	if confirmed != 0 {
		c.Sent(time.Now(), confirmed)
	}
}

// TestStartPositionResumesAfterWhatThisProcessAcked: a new stream starts
// after what Kafka acknowledged in this process, though a broken stream
// may not have confirmed it, but no further than the publication watch
// vouched for.
func TestStartPositionResumesAfterWhatThisProcessAcked(t *testing.T) {
	e := newPGEnv(t)
	r, _, _, s := preparedRelay(t, e)
	ackedUpTo(r, s, s+0x1000, 0)
	r.guard.clearance.Vouch(s + 0x800)
	at, err := r.guard.startPosition(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if at != s+0x800 {
		t.Errorf("starts at %s with the slot at %s, acked %s, vouched for %s: want %s", at, s, s+0x1000, s+0x800, s+0x800)
	}
	r.guard.clearance.Vouch(s + 0x2000)
	if at, _ := r.guard.startPosition(e.ctx); at != s+0x1000 {
		t.Errorf("starts at %s, all of it vouched for: want what was acked, %s", at, s+0x1000)
	}
}

// TestStartPositionAfterAFailoverResumesFromTheSlot: on a new timeline
// (a failover) what this process acked and what was vouched for belong to
// the old primary's history: the stream starts at the slot's position,
// with a warning that the WAL between is sent again.
func TestStartPositionAfterAFailoverResumesFromTheSlot(t *testing.T) {
	e := newPGEnv(t)
	r, logs, _, s := preparedRelay(t, e)
	conn := e.conn()
	tl, err := currentTimeline(e.ctx, conn)
	conn.Close(context.Background())
	if err != nil || tl < 1 {
		t.Fatalf("timeline %d, %v", tl, err)
	}
	r.guard.streamed(tl+1, s) // the last stream was on another timeline
	ackedUpTo(r, s, s+0x1000, 0)
	r.guard.clearance.Vouch(s + 0x1000)
	at, err := r.guard.startPosition(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if at != s {
		t.Errorf("after a failover the stream starts at %s, want the slot's %s", at, s)
	}
	if r.guard.clearance.Upto() != 0 {
		t.Errorf("what the watch vouched for on the old timeline (%s) is still trusted", r.guard.clearance.Upto())
	}
	if logs.FilterMessageSnippet("behind what this process had acknowledged on the old timeline").FilterLevelExact(zapcore.WarnLevel).Len() != 1 {
		t.Errorf("no warning that the WAL since the slot's position is sent again: %v", logs.All())
	}
}

// TestStartPositionWarnsOnceWhenTheSlotIsBehindTheRecord: a new process
// whose slot is behind what walrelay's record says it confirmed (a
// failover that lost the slot's latest position) warns, once, that those
// events are sent again; it starts at the slot.
func TestStartPositionWarnsOnceWhenTheSlotIsBehindTheRecord(t *testing.T) {
	e := newPGEnv(t)
	r, logs, _, s := preparedRelay(t, e)
	conn := e.conn()
	if _, err := source.RecordConfirmed(e.ctx, conn, source.DefaultRecordSchema, e.name, s+0x1000); err != nil {
		t.Fatal(err)
	}
	conn.Close(context.Background())
	r.guard.prepared(e.ctx, e.record())
	for range 2 {
		at, err := r.guard.startPosition(e.ctx)
		if err != nil || at != s {
			t.Fatalf("started at %s (%v), want the slot's %s", at, err, s)
		}
	}
	if n := logs.FilterMessageSnippet("behind what walrelay recorded as confirmed").Len(); n != 1 {
		t.Errorf("warned %d times that the slot is behind the record, want once a process: %v", n, logs.All())
	}
}

// TestStartPositionRefusesASlotDroppedUnderIt: a slot missing before the
// relay ever streamed is an error to fix (it was not created); once the
// relay streamed from it, a missing slot was dropped under it, and
// recreating it would skip events: the relay refuses, writes the refusal
// into its record at the last confirmed position, and counts it.
func TestStartPositionRefusesASlotDroppedUnderIt(t *testing.T) {
	e := newPGEnv(t)
	r, _, m, s := preparedRelay(t, e)
	e.exec("SELECT pg_drop_replication_slot($1)", e.name)
	_, err := r.guard.startPosition(e.ctx)
	if !isFatal(err) || isGap(err) || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("no slot before the first stream: %v, want a fatal error saying it does not exist", err)
	}
	if rec := e.record(); rec.Stopped != "" {
		t.Fatalf("refusal %q written before the relay streamed", rec.Stopped)
	}

	r.guard.streamed(1, s)
	ackedUpTo(r, s, s, s)
	_, err = r.guard.startPosition(e.ctx)
	var gap *slot.GapError
	if !errors.As(err, &gap) || !strings.Contains(gap.What, "was dropped while walrelay streamed from it") || gap.Since != s {
		t.Fatalf("slot dropped after streaming: %v, want a refusal since %s", err, s)
	}
	if rec := e.record(); rec.Stopped != gap.What || rec.StoppedAt != s {
		t.Errorf("record stopped %q at %s, want %q at %s", rec.Stopped, rec.StoppedAt, gap.What, s)
	}
	if n := testutil.ToFloat64(m.GapRefusals); n != 1 {
		t.Errorf("walrelay_gap_refusals_total = %v, want 1", n)
	}
}

// TestRefusalIsWrittenDownOnceAndRefusesTheNextStart: the first refusal
// goes into walrelay's record, so that a restart refuses too even after
// the change was undone; a second one found on the way out changes
// nothing.
func TestRefusalIsWrittenDownOnceAndRefusesTheNextStart(t *testing.T) {
	e := newPGEnv(t)
	r, _, m, s := preparedRelay(t, e)
	r.guard.refuse(e.ctx, nil, &slot.GapError{What: "the first change", Since: s})
	r.guard.refuse(e.ctx, nil, &slot.GapError{What: "the second change", Since: s + 100})
	if rec := e.record(); rec.Stopped != "the first change" || rec.StoppedAt != s {
		t.Fatalf("record stopped %q at %s, want the first refusal at %s", rec.Stopped, rec.StoppedAt, s)
	}
	if n := testutil.ToFloat64(m.GapRefusals); n != 1 {
		t.Errorf("walrelay_gap_refusals_total = %v, want 1", n)
	}
	_, err := source.Prepare(e.ctx, r.setupConfig(), zap.NewNop())
	if !isGap(err) || !strings.Contains(err.Error(), "the first change") {
		t.Fatalf("the next start: %v, want it refused with the recorded reason", err)
	}
}

// TestSessionGapRefusesADroppedPublication: a stream that met the
// publication missing (dropped while the relay streamed from it) becomes
// a refusal naming it, written into the record.
func TestSessionGapRefusesADroppedPublication(t *testing.T) {
	e := newPGEnv(t)
	r, _, _, s := preparedRelay(t, e)
	ackedUpTo(r, s, s, s)
	err := r.guard.sessionGap(e.ctx, fmt.Errorf("receive: %w", &slot.PublicationGoneError{Publication: r.cfg.Publication, Message: "publication does not exist"}))
	var gap *slot.GapError
	if !errors.As(err, &gap) || !strings.Contains(gap.What, `publication "`+r.cfg.Publication+`" was dropped`) || gap.Since != s {
		t.Fatalf("sessionGap = %v, want a refusal naming the publication since %s", err, s)
	}
	if rec := e.record(); rec.Stopped != gap.What {
		t.Errorf("record stopped %q, want %q", rec.Stopped, gap.What)
	}
}

// TestPublicationWatchVouchesThenRefusesATableTakenOut: the watch vouches
// for the positions a session asks about while the publication publishes
// the outbox; once an outbox table is taken out of the publication it
// stops the relay with a refusal written into the record, and vouches for
// nothing past the change.
func TestPublicationWatchVouchesThenRefusesATableTakenOut(t *testing.T) {
	e := newPGEnv(t)
	r, _, _, _ := preparedRelay(t, e)
	ctx, cancel := context.WithCancel(e.ctx)
	defer cancel()
	stopped := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.guard.watchPublication(ctx, func(err error) { stopped <- err })
	}()
	first := e.insert("00000000-0000-0000-0000-0000000000a1")
	r.guard.clearance.Want(first)
	e.waitFor("the watch to vouch for the insert", func() bool { return r.guard.clearance.Upto() >= first })

	e.exec("ALTER PUBLICATION " + r.cfg.Publication + " DROP TABLE outbox")
	after := e.insert("00000000-0000-0000-0000-0000000000a2")
	r.guard.clearance.Want(after)
	var err error
	select {
	case err = <-stopped:
	case <-time.After(pgPatience):
		t.Fatal("the watch did not stop the relay")
	}
	<-done
	if !isGap(err) || !strings.Contains(err.Error(), "outbox") {
		t.Fatalf("stopped with %v, want a refusal naming the outbox table", err)
	}
	if up := r.guard.clearance.Upto(); up >= after {
		t.Errorf("vouched for %s, past the change", up)
	}
	if rec := e.record(); rec.Stopped == "" {
		t.Error("the refusal is not in walrelay's record")
	}
}

// TestVouchFinalLetsACleanStopConfirmEverything: a stopping session has
// the publication checked once more, so that a clean stop confirms all
// Kafka acknowledged; a change found then is refused, and logged.
func TestVouchFinalLetsACleanStopConfirmEverything(t *testing.T) {
	e := newPGEnv(t)
	r, logs, _, _ := preparedRelay(t, e)
	pos := e.insert("00000000-0000-0000-0000-0000000000b1")
	r.guard.vouchFinal(e.ctx, pos)
	if up := r.guard.clearance.Upto(); up < pos {
		t.Fatalf("vouched for %s after the last check, want at least %s", up, pos)
	}
	e.exec("ALTER PUBLICATION " + r.cfg.Publication + " DROP TABLE outbox")
	pos = e.insert("00000000-0000-0000-0000-0000000000b2")
	r.guard.vouchFinal(e.ctx, pos)
	if up := r.guard.clearance.Upto(); up >= pos {
		t.Errorf("vouched for %s, past the change", up)
	}
	if rec := e.record(); rec.Stopped == "" || !r.guard.refused.Load() {
		t.Errorf("record stopped %q, refused %v: want the change refused", rec.Stopped, r.guard.refused.Load())
	}
	if logs.FilterMessageSnippet("stopping: ").FilterLevelExact(zapcore.ErrorLevel).Len() != 1 {
		t.Errorf("no error line saying why the relay stops: %v", logs.All())
	}
}

// TestWatchFailedKeepsTheSessionWhenTheServerStillAnswers: a watch
// connection ended by the server (pg_terminate_backend, an idle timeout)
// while the server still accepts connections is no shutdown: the watch
// reconnects, and the stream goes on.
func TestWatchFailedKeepsTheSessionWhenTheServerStillAnswers(t *testing.T) {
	e := newPGEnv(t)
	r, logs, _ := observedRelay(t, e.pgConfig())
	s, st := currentSession(r)
	r.guard.watchFailed(e.ctx, &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}, "the check failed")
	if err := endedWith(t, s, st); err != nil {
		t.Fatalf("the session ended with %v", err)
	}
	if logs.FilterMessageSnippet("its connection was ended by the server").FilterLevelExact(zapcore.WarnLevel).Len() != 1 {
		t.Errorf("no warning that the watch reconnects: %v", logs.All())
	}
}

// TestHoldsSlotKnowsTheRelaysOwnWalsender: a fenced relay asks
// pg_replication_slots whether its own walsender still streams the slot:
// then the transactional id is used elsewhere and it stops; another
// walsender means another relay took the slot, and it restarts as a
// standby.
func TestHoldsSlotKnowsTheRelaysOwnWalsender(t *testing.T) {
	e := newPGEnv(t)
	r, _, _, s := preparedRelay(t, e)
	if _, err := r.guard.holdsSlot(e.ctx, 0); err == nil {
		t.Error("holdsSlot answered for an unknown backend PID")
	}
	stream, err := slot.Start(e.ctx, e.url, s, slot.StreamOptions{Slot: e.name, Publication: r.cfg.Publication})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close(context.Background())
	own := stream.PID()
	if holds, err := r.guard.holdsSlot(e.ctx, own); err != nil || !holds {
		t.Fatalf("holdsSlot(own walsender %d) = %v, %v; want true", own, holds, err)
	}
	if holds, err := r.guard.holdsSlot(e.ctx, own+1); err != nil || holds {
		t.Fatalf("holdsSlot(another backend) = %v, %v; want false", holds, err)
	}
	fenced := fmt.Errorf("commit: %w", router.ErrFenced)
	if err := r.guard.afterFence(fenced, own); !isFatal(err) {
		t.Errorf("fenced while holding the slot: %v, want fatal", err)
	}
	if err := r.guard.afterFence(fenced, own+1); isFatal(err) || !errors.Is(err, router.ErrFenced) {
		t.Errorf("fenced after losing the slot: %v, want a restart", err)
	}
}

// TestReadCoverageAsksThePublication: how the publication covers a table
// the relay does not map is read from the catalog: one it lists by name
// is Listed (the relay stops rather than skip it), one outside it is
// NotCovered.
func TestReadCoverageAsksThePublication(t *testing.T) {
	e := newPGEnv(t)
	r, _, _, _ := preparedRelay(t, e)
	e.exec("CREATE TABLE listed (id int); CREATE TABLE outside (id int); ALTER PUBLICATION " + r.cfg.Publication + " ADD TABLE listed")
	for table, want := range map[string]source.Coverage{"listed": source.Listed, "outside": source.NotCovered} {
		conn := e.conn()
		var oid uint32
		err := conn.QueryRow(e.ctx, "SELECT $1::regclass::oid", table).Scan(&oid)
		conn.Close(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if got, err := r.guard.readCoverage(e.ctx, oid); err != nil || got != want {
			t.Errorf("coverage of %s: %v, %v; want %v", table, got, err, want)
		}
	}
}
