package slot

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/walrelay/walrelay/decoder"
)

// StreamOptions are the pgoutput options of a stream.
type StreamOptions struct {
	Slot        string
	Publication string
	// Binary asks pgoutput for binary values where a type supports it
	// (PostgreSQL 14+): less work for the walsender.
	Binary bool
	// Read tunes how the socket is read.
	Read ReadOptions
	// TopicTemplate, when set, tags the connection's application_name
	// (when the connection string sets none) so that another relay can see
	// which topics this one streams to (TopicsAppName).
	TopicTemplate string
}

// MessageKind tells a data message from a keepalive.
type MessageKind uint8

const (
	// XLogData carries one pgoutput message in Data.
	XLogData MessageKind = iota + 1
	// Keepalive carries the server's WAL end and whether it wants a reply.
	Keepalive
)

// Message is one message of the replication stream. Data is valid only
// until the next Receive: it points into the connection's read buffer.
type Message struct {
	Kind           MessageKind
	WALStart       decoder.LSN // XLogData: position of the message's WAL record
	ServerWALEnd   decoder.LSN // the server's WAL end when it sent the message
	ServerTime     time.Time
	ReplyRequested bool   // Keepalive: reply now or be disconnected
	Data           []byte // XLogData: the pgoutput message
}

// ErrTimeout is returned by Receive when its deadline passes before a
// message arrives. The stream stays usable.
var ErrTimeout = errors.New("slot: no message before the deadline")

// ErrInterrupted is returned by Receive after Interrupt, also by a Receive
// that starts after an Interrupt nobody has seen yet.
var ErrInterrupted = errors.New("slot: receive interrupted")

// Stream is a logical replication stream from one slot. It is owned by one
// goroutine: Receive and SendStatus must not be called concurrently.
type Stream struct {
	conn        *pgconn.PgConn
	fe          *pgproto3.Frontend
	net         net.Conn
	deadline    time.Time
	interrupted atomic.Bool
	path        *readPath
	raw         syscall.RawConn // the socket, for Drained; nil if none
	publication string
	// System is what IDENTIFY_SYSTEM reported when the stream opened.
	System pglogrepl.IdentifySystemResult
	// SenderTimeout is the walsender's wal_sender_timeout for this
	// connection (a role or database may set its own): it ends a stream
	// whose client sends nothing for that long. 0 when off or unknown.
	SenderTimeout time.Duration
	// AckTimeout is how long what the relay writes may go unacknowledged
	// before the kernel ends the connection (TCP_USER_TIMEOUT, Linux):
	// SenderTimeout on a TCP connection, 0 when not set.
	//
	// A relay waiting for Kafka does not read the stream. Once its socket
	// holds all it can of the walsender's small messages, Linux drops
	// what more arrives and shuts the receive window, shrinking it under
	// segments the server had already sent; the server's acknowledgements
	// then carry a sequence number past that window, and the relay's
	// kernel discards them unread. Its first status update after that
	// stays unacknowledged, is resent with a growing backoff, and holds
	// every later one in the send queue: the walsender stops hearing the
	// relay and ends the connection after wal_sender_timeout, while the
	// relay's writes still succeed. Only reading the stream would undo
	// it, and the relay cannot read on without holding all the server
	// sends meanwhile. With the timeout the kernel ends the connection
	// when the server does, and the next status update fails naming
	// wal_sender_timeout (*SenderTimeoutError), instead of a connection
	// reset found once Kafka is back.
	AckTimeout time.Duration
}

// SenderTimeoutError is a replication connection that ended because
// nothing the relay wrote to it was acknowledged for the server's
// wal_sender_timeout (Stream.AckTimeout): the walsender, not hearing the
// relay's status updates for that long, ends the connection itself.
type SenderTimeoutError struct {
	// Timeout is the connection's wal_sender_timeout.
	Timeout time.Duration
	Err     error
}

func (e *SenderTimeoutError) Error() string {
	return fmt.Sprintf("the server acknowledged nothing sent to it for its wal_sender_timeout (%s), after which PostgreSQL ends the walsender (\"terminating walsender process due to replication timeout\"): the network stopped delivering, or the relay waited for Kafka without reading the stream until its receive buffer filled, which stops its status updates; to ride out longer Kafka outages on one connection, raise wal_sender_timeout for walrelay's role: %v", e.Timeout, e.Err)
}

func (e *SenderTimeoutError) Unwrap() error { return e.Err }

// ackTimedOut is err as a *SenderTimeoutError when the kernel ended the
// connection for its AckTimeout, else nil.
func (s *Stream) ackTimedOut(err error) error {
	if s.AckTimeout <= 0 || !errors.Is(err, syscall.ETIMEDOUT) {
		return nil
	}
	return &SenderTimeoutError{Timeout: s.SenderTimeout, Err: err}
}

// Start opens a replication connection to url and starts streaming slot
// from start (0 means the slot's confirmed position). PostgreSQL resumes
// at the later of start and the slot's confirmed_flush_lsn.
func Start(ctx context.Context, url string, start decoder.LSN, opts StreamOptions) (*Stream, error) {
	cfg, err := ReplicationConfig(url)
	if err != nil {
		return nil, err
	}
	path := applyReadOptions(cfg, opts.Read)
	tagApplicationName(cfg, opts.TopicTemplate)
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("replication connection: %w", connectError(err, url))
	}
	s := &Stream{conn: conn, fe: conn.Frontend(), net: conn.Conn(), path: path, publication: opts.Publication}
	s.raw = rawSocket(s.net)
	if s.System, err = pglogrepl.IdentifySystem(ctx, conn); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("IDENTIFY_SYSTEM: %w", err)
	}
	s.SenderTimeout = senderTimeout(ctx, conn)
	if _, isTCP := s.net.LocalAddr().(*net.TCPAddr); isTCP && s.raw != nil && s.SenderTimeout > 0 &&
		setAckTimeout(s.raw, s.SenderTimeout) == nil {
		s.AckTimeout = s.SenderTimeout
	}
	args := []string{
		"proto_version '1'",
		// Logical decoding messages carry walrelay's heartbeats: markers
		// of the confirmed position (PostgreSQL 14+, all walrelay runs on).
		"messages 'true'",
		"publication_names " + quoteLiteral(quoteIdent(opts.Publication)),
	}
	if opts.Binary {
		args = append(args, "binary 'true'")
	}

	err = pglogrepl.StartReplication(ctx, conn, opts.Slot, start, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: args,
	})
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("START_REPLICATION SLOT %s at %s: %w", opts.Slot, start, err)
	}
	return s, nil
}

// topicsTagPrefix starts the application_name of walrelay's streaming
// connection when the connection string sets none: "walrelay
// topics=<tag>", the tag naming the topic template. Another relay starting
// on the same publication reads it in pg_stat_activity (TopicsAppName).
const topicsTagPrefix = "walrelay topics="

// TopicsAppName is the application_name of a stream to topicTemplate, as
// Start names it when the connection string names none.
func TopicsAppName(topicTemplate string) string { return topicsTagPrefix + topicsTag(topicTemplate) }

// topicsTag is the tag of a topic template: the first 8 bytes of its
// SHA-256 in hex. It only tells templates apart, and fits
// application_name (63 bytes of printable ASCII) whatever the template.
func topicsTag(template string) string {
	sum := sha256.Sum256([]byte(template))
	return hex.EncodeToString(sum[:8])
}

// tagApplicationName puts the topic template's tag in the application_name
// of a replication connection when walrelay chose the name (the connection
// string and PGAPPNAME set none): an operator's name is left alone.
func tagApplicationName(cfg *pgconn.Config, topicTemplate string) {
	if topicTemplate != "" && cfg.RuntimeParams["application_name"] == "walrelay" {
		cfg.RuntimeParams["application_name"] = TopicsAppName(topicTemplate)
	}
}

// senderTimeout reads the connection's wal_sender_timeout (in ms; a
// replication connection of the database kind runs SQL before streaming).
// A failure reads as 0: the relay then keeps its own status interval.
func senderTimeout(ctx context.Context, conn *pgconn.PgConn) time.Duration {
	res, err := conn.Exec(ctx, "SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout'").ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 {
		return 0
	}
	ms, err := strconv.ParseInt(string(res[0].Rows[0][0]), 10, 64)
	if err != nil || ms <= 0 {
		return 0
	}
	return time.Duration(ms) * time.Millisecond
}

// Drained reports, without waiting, that nothing of the stream is left to
// read: no byte in the process's buffers and none queued on the socket.
// False when the socket cannot tell (not a TCP or Unix socket). With TLS,
// a partial record the TLS layer holds reads as drained: the rest of it
// is still on its way.
func (s *Stream) Drained() bool {
	if s.fe.ReadBufferLen() > 0 || s.path.buffered() > 0 {
		return false
	}
	return socketEmpty(s.raw)
}

// PID is the backend process ID of the replication connection: the
// walsender, named by pg_replication_slots.active_pid while it streams the
// slot.
func (s *Stream) PID() uint32 { return s.conn.PID() }

// IdentifySystem runs IDENTIFY_SYSTEM on a replication connection of its
// own: the cluster's system identifier, timeline and WAL flush position,
// for callers that have no stream open.
func IdentifySystem(ctx context.Context, url string) (pglogrepl.IdentifySystemResult, error) {
	conn, err := ReplicationConn(ctx, url)
	if err != nil {
		return pglogrepl.IdentifySystemResult{}, err
	}
	defer conn.Close(context.Background())
	res, err := pglogrepl.IdentifySystem(ctx, conn)
	if err != nil {
		return res, fmt.Errorf("IDENTIFY_SYSTEM: %w", err)
	}
	return res, nil
}

// ReplicationConfig derives the replication connection's configuration from
// a normal connection URL or DSN (defaultSSLMode when it sets no sslmode).
// A string that does not parse is a *SetupError that does not quote it.
func ReplicationConfig(url string) (*pgconn.Config, error) {
	cfg, err := parseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["replication"] = "database"
	if _, ok := cfg.RuntimeParams["application_name"]; !ok {
		cfg.RuntimeParams["application_name"] = "walrelay"
	}
	// pgoutput renders values with the session's settings; the decoder
	// expects bytea in hex whatever the server's default is, and text in
	// UTF-8 whatever the database's encoding is.
	cfg.RuntimeParams["bytea_output"] = "hex"
	cfg.RuntimeParams["client_encoding"] = clientEncoding
	cfg.AfterConnect = applySettings
	usePasswordSource(cfg)
	return cfg, nil
}

// ReplicationConn opens a replication connection (replication=database)
// for one command or two: slot commands, IDENTIFY_SYSTEM, TIMELINE_HISTORY.
func ReplicationConn(ctx context.Context, url string) (*pgconn.PgConn, error) {
	cfg, err := ReplicationConfig(url)
	if err != nil {
		return nil, err
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("replication connection: %w", connectError(err, url))
	}
	return conn, nil
}

// Receive returns the next message, or ErrTimeout once deadline passes.
// Other errors mean the stream is broken; Close it.
func (s *Stream) Receive(deadline time.Time) (Message, error) {
	if !deadline.Equal(s.deadline) {
		if err := s.net.SetReadDeadline(deadline); err != nil {
			return Message{}, fmt.Errorf("set read deadline: %w", err)
		}
		s.deadline = deadline
	}
	// An Interrupt that landed before the deadline above was armed had its
	// own deadline overwritten: look at its flag now. Interrupt sets the
	// flag before the deadline, so one that comes after this check still
	// cuts the read short.
	if s.interrupted.Swap(false) {
		s.deadline = time.Time{}
		return Message{}, ErrInterrupted
	}
	for {
		msg, err := s.fe.Receive()
		if err != nil {
			if te := s.ackTimedOut(err); te != nil {
				return Message{}, te
			}
			// ETIMEDOUT says Timeout() too, but it is the kernel giving
			// up on the connection, not the deadline passing.
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() && !errors.Is(err, syscall.ETIMEDOUT) {
				if s.interrupted.Swap(false) {
					s.deadline = time.Time{} // re-arm the caller's deadline next time
					return Message{}, ErrInterrupted
				}
				return Message{}, ErrTimeout
			}
			return Message{}, fmt.Errorf("replication stream: %w", err)
		}
		switch m := msg.(type) {
		case *pgproto3.CopyData:
			return parseCopyData(m.Data)
		case *pgproto3.ErrorResponse:
			if s.publicationGone(m.Code, m.Message) {
				return Message{}, &PublicationGoneError{Publication: s.publication, Message: m.Message}
			}
			return Message{}, fmt.Errorf("replication stream: %w", pgconn.ErrorResponseToPgError(m))
		case *pgproto3.CopyDone, *pgproto3.CommandComplete:
			// A walsender shutting down (server stop or restart) ends the
			// copy, sometimes with just CommandComplete.
			return Message{}, errors.New("replication stream: the server ended the stream (shutting down?)")
		case *pgproto3.NoticeResponse:
			if s.publicationGone(m.Code, m.Message) {
				return Message{}, &PublicationGoneError{Publication: s.publication, Message: m.Message}
			}
			continue
		case *pgproto3.ParameterStatus:
			continue
		default:
			return Message{}, fmt.Errorf("replication stream: unexpected %T", msg)
		}
	}
}

// PublicationGoneError is the walsender saying that the publication did
// not exist at a point of the WAL it decoded (dropped, or dropped and
// created again after that point): PostgreSQL 15-17 end the stream with
// an error at every start, 18 warns once and skips the changes it cannot
// publish. Either way events committed there are not sent.
type PublicationGoneError struct {
	Publication string
	// Message is the server's, as it worded it.
	Message string
}

func (e *PublicationGoneError) Error() string {
	return fmt.Sprintf("replication stream: publication %q did not exist at a point of the WAL the server decoded (%s)", e.Publication, e.Message)
}

// publicationGone recognises the walsender's report of a missing
// publication: an error (42704, PostgreSQL 15-17) or a warning (55000,
// "skipped loading publication", 18) naming the stream's publication. The
// name is matched, not the wording: servers translate their messages.
func (s *Stream) publicationGone(code, msg string) bool {
	return (code == "42704" || code == "55000") && strings.Contains(msg, `"`+s.publication+`"`)
}

func parseCopyData(b []byte) (Message, error) {
	if len(b) == 0 {
		return Message{}, errors.New("replication stream: empty CopyData")
	}
	switch b[0] {
	case pglogrepl.XLogDataByteID:
		if len(b) < 25 {
			return Message{}, fmt.Errorf("replication stream: XLogData of %d bytes", len(b))
		}
		return Message{
			Kind:         XLogData,
			WALStart:     decoder.LSN(binary.BigEndian.Uint64(b[1:])),
			ServerWALEnd: decoder.LSN(binary.BigEndian.Uint64(b[9:])),
			ServerTime:   decoder.PGTime(binary.BigEndian.Uint64(b[17:])),
			Data:         b[25:],
		}, nil
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		if len(b) != 18 {
			return Message{}, fmt.Errorf("replication stream: keepalive of %d bytes", len(b))
		}
		return Message{
			Kind:           Keepalive,
			ServerWALEnd:   decoder.LSN(binary.BigEndian.Uint64(b[1:])),
			ServerTime:     decoder.PGTime(binary.BigEndian.Uint64(b[9:])),
			ReplyRequested: b[17] != 0,
		}, nil
	default:
		return Message{}, fmt.Errorf("replication stream: unknown CopyData type %q", b[0])
	}
}

// Interrupt makes a Receive blocked in another goroutine return
// ErrInterrupted (or ErrTimeout) promptly. It is safe for concurrent use.
func (s *Stream) Interrupt() {
	s.interrupted.Store(true)
	_ = s.net.SetReadDeadline(time.Now()) // fails only on a closed conn, which Receive reports
}

// SendStatus reports confirmed as written, flushed and applied. PostgreSQL
// may then recycle WAL before it and will not resend transactions that end
// at or before it: confirmed must be acknowledged by Kafka. All three
// positions are set explicitly (pglogrepl would fill zero flush and apply
// positions with the write position).
//
// Reporting the received position as written would look better in
// pg_stat_replication, but the walsender only sends the keepalives that let
// an idle slot advance while the reported write position is behind it.
func (s *Stream) SendStatus(confirmed decoder.LSN, replyRequested bool) error {
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: confirmed,
		WALFlushPosition: confirmed,
		WALApplyPosition: confirmed,
		ClientTime:       time.Now(),
		ReplyRequested:   replyRequested,
	})
	if err != nil {
		if te := s.ackTimedOut(err); te != nil {
			return te
		}
		return fmt.Errorf("send standby status update: %w", err)
	}
	return nil
}

// Close closes the replication connection. A final SendStatus before it is
// processed by the server: it reads the socket in order.
func (s *Stream) Close(ctx context.Context) error {
	return s.conn.Close(ctx)
}

// quoteIdent quotes a PostgreSQL identifier.
func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// quoteLiteral quotes a PostgreSQL string literal.
func quoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }

// TimelineSwitch is the WAL position at which timeline from ended in the
// history of timeline to (TIMELINE_HISTORY): where a promoted standby's
// WAL forked from its old primary's. Timeline from must be an ancestor of
// to.
func TimelineSwitch(ctx context.Context, url string, from, to int32) (decoder.LSN, error) {
	conn, err := ReplicationConn(ctx, url)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	h, err := pglogrepl.TimelineHistory(ctx, conn, to)
	if err != nil {
		return 0, fmt.Errorf("TIMELINE_HISTORY %d: %w", to, err)
	}
	return parseSwitch(string(h.Content), from, to)
}

// parseSwitch finds in a timeline history file (lines of parent timeline,
// switch point, reason) the point where timeline from ended.
func parseSwitch(history string, from, to int32) (decoder.LSN, error) {
	for _, line := range strings.Split(history, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || strings.HasPrefix(f[0], "#") {
			continue
		}
		tli, err := strconv.ParseInt(f[0], 10, 32)
		if err != nil || int32(tli) != from {
			continue
		}
		return ParseLSN(f[1])
	}
	return 0, fmt.Errorf("timeline %d is not in the history of timeline %d: the server's WAL is not a continuation of the checkpoint's", from, to)
}
