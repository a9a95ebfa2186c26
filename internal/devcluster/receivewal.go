package devcluster

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// WALReceiver is a client streaming a server's WAL the way pg_receivewal
// does: a physical replication connection named pg_receivewal, which
// replies with the position it wrote and never with one it replayed (it
// replays nothing). pg_stat_replication lists it beside the standbys.
type WALReceiver struct {
	// Real: the stream is pg_receivewal's own; otherwise this package's
	// client, which sends the replies pg_receivewal sends.
	Real bool
	stop func() error
}

// Close stops the stream.
func (w *WALReceiver) Close() error { return w.stop() }

// ReceiveWAL streams p's WAL like pg_receivewal (without a slot) and
// returns once p's pg_stat_replication shows the stream with a written
// position. It runs pg_receivewal itself when one that accepts p's version
// is installed (in p's binary directory or under DefaultRoot; pg_receivewal
// refuses servers newer than itself), and otherwise a client of its own
// that sends pg_receivewal's replies: write position set, flush and apply
// positions invalid (0).
func (p *Postgres) ReceiveWAL(ctx context.Context) (*WALReceiver, error) {
	version, err := p.ServerVersionNum(ctx)
	if err != nil {
		return nil, err
	}
	var w *WALReceiver
	if bin := receivewalBinary(p.bin, version/10000); bin != "" {
		w, err = p.runReceivewal(bin)
	} else {
		w, err = p.emulateReceivewal(ctx)
	}
	if err != nil {
		return nil, err
	}
	err = WaitFor(60*time.Second, 50*time.Millisecond, func() (bool, error) {
		var n int
		err := p.queryRow(ctx, "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'pg_receivewal' AND state = 'streaming' AND write_lsn IS NOT NULL", &n)
		return n > 0, fmt.Errorf("no pg_receivewal stream with a written position in pg_stat_replication (%v)", err)
	})
	if err != nil {
		w.Close()
		return nil, err
	}
	return w, nil
}

var receivewalVersion = regexp.MustCompile(`\(PostgreSQL\) (\d+)`)

// receivewalBinary is a pg_receivewal of major version major or later:
// the one beside the server's binaries first, then under DefaultRoot.
func receivewalBinary(serverBin string, major int) string {
	candidates := []string{filepath.Join(serverBin, "pg_receivewal")}
	if dirs, err := filepath.Glob(filepath.Join(DefaultRoot, "*", "bin", "pg_receivewal")); err == nil {
		candidates = append(candidates, dirs...)
	}
	for _, c := range candidates {
		if !isExecutable(c) {
			continue
		}
		out, err := exec.Command(c, "--version").Output()
		if err != nil {
			continue
		}
		if m := receivewalVersion.FindSubmatch(out); m != nil {
			if v, _ := strconv.Atoi(string(m[1])); v >= major {
				return c
			}
		}
	}
	return ""
}

// runReceivewal runs pg_receivewal into a directory under p's, as the
// account the server runs as when we are root.
func (p *Postgres) runReceivewal(bin string) (*WALReceiver, error) {
	dir, err := os.MkdirTemp(p.Dir, "receivewal-")
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, err
	}
	args := []string{"-h", "127.0.0.1", "-p", strconv.Itoa(p.Port), "-U", "postgres", "-D", dir, "--no-loop", "--no-password"}
	var cmd *exec.Cmd
	if os.Geteuid() == 0 {
		uid, gid, err := serverAccount()
		if err != nil {
			return nil, err
		}
		if err := os.Chown(dir, uid, gid); err != nil {
			return nil, err
		}
		cmd = exec.Command(bin, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	} else {
		cmd = exec.Command(bin, args...)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	return &WALReceiver{Real: true, stop: func() error {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		return nil
	}}, nil
}

// emulateReceivewal streams p's WAL on a physical replication connection
// named pg_receivewal and replies as pg_receivewal does without a slot.
func (p *Postgres) emulateReceivewal(ctx context.Context) (*WALReceiver, error) {
	cfg, err := pgconn.ParseConfig(p.URL("postgres") + "&replication=true&application_name=pg_receivewal")
	if err != nil {
		return nil, err
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	sys, err := pglogrepl.IdentifySystem(ctx, conn)
	if err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	// From the start of the current segment, as pg_receivewal starts.
	start := sys.XLogPos &^ (16<<20 - 1)
	// Without a slot, as pg_receivewal runs by default (pglogrepl's
	// StartReplication always names one).
	conn.Frontend().SendQuery(&pgproto3.Query{String: fmt.Sprintf("START_REPLICATION PHYSICAL %s TIMELINE %d", start, sys.Timeline)})
	if err := conn.Frontend().Flush(); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	for started := false; !started; {
		msg, err := conn.ReceiveMessage(ctx)
		if err != nil {
			conn.Close(context.Background())
			return nil, err
		}
		switch msg := msg.(type) {
		case *pgproto3.ErrorResponse:
			conn.Close(context.Background())
			return nil, pgconn.ErrorResponseToPgError(msg)
		case *pgproto3.CopyBothResponse:
			started = true
		}
	}
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		written := start
		var last time.Time
		for runCtx.Err() == nil {
			if time.Since(last) >= time.Second {
				if err := sendWriteOnlyStatus(conn, written); err != nil {
					return
				}
				last = time.Now()
			}
			rctx, rcancel := context.WithDeadline(runCtx, last.Add(time.Second))
			msg, err := conn.ReceiveMessage(rctx)
			rcancel()
			if err != nil {
				if pgconn.Timeout(err) || errors.Is(err, context.DeadlineExceeded) {
					continue
				}
				return
			}
			cd, ok := msg.(*pgproto3.CopyData)
			if !ok || len(cd.Data) == 0 {
				continue
			}
			switch cd.Data[0] {
			case pglogrepl.XLogDataByteID:
				if x, err := pglogrepl.ParseXLogData(cd.Data[1:]); err == nil {
					written = x.WALStart + pglogrepl.LSN(len(x.WALData))
				}
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				if k, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:]); err == nil && k.ReplyRequested {
					last = time.Time{}
				}
			}
		}
	}()
	return &WALReceiver{stop: func() error {
		cancel()
		<-done
		return conn.Close(context.Background())
	}}, nil
}

// pgEpoch is PostgreSQL's epoch, of the replies' send time.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// sendWriteOnlyStatus sends the standby status update pg_receivewal sends
// without a slot: the written position, flush and apply invalid. pglogrepl's
// SendStandbyStatusUpdate fills an invalid position with the one before
// it, as a standby would report.
func sendWriteOnlyStatus(conn *pgconn.PgConn, written pglogrepl.LSN) error {
	buf := make([]byte, 0, 34)
	buf = append(buf, 'r')
	buf = binary.BigEndian.AppendUint64(buf, uint64(written))
	buf = binary.BigEndian.AppendUint64(buf, 0) // flush
	buf = binary.BigEndian.AppendUint64(buf, 0) // apply
	buf = binary.BigEndian.AppendUint64(buf, uint64(time.Since(pgEpoch).Microseconds()))
	buf = append(buf, 0)
	conn.Frontend().Send(&pgproto3.CopyData{Data: buf})
	return conn.Frontend().Flush()
}
