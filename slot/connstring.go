package slot

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// defaultSSLMode is the sslmode used when neither the connection string nor
// PGSSLMODE sets one. pgx's own default, prefer, accepts any certificate and
// falls back to plaintext: a man in the middle would see the password and
// every streamed row.
const defaultSSLMode = "verify-full"

// unparseable is what Redact prints for a connection string that does not
// parse: its text may hold the password anywhere.
const unparseable = "(unparseable connection string)"

// Redact describes the connection target of a PostgreSQL URL or key=value
// string for logs and errors: user@host:port/database (hosts comma-separated
// when there are several), rebuilt from the parsed configuration. Nothing
// of the input's text is copied, so no password or other parameter can
// appear; a string that does not parse prints as a fixed placeholder.
func Redact(conn string) string {
	cfg, err := parseConfig(conn)
	if err != nil {
		return unparseable
	}
	return target(cfg)
}

// target is user@host:port[,host:port…]/database of cfg.
func target(cfg *pgconn.Config) string {
	hosts := []string{hostPort(cfg.Host, cfg.Port)}
	for _, fb := range cfg.Fallbacks {
		// sslmode prefer and allow list each host twice (TLS, plaintext).
		if hp := hostPort(fb.Host, fb.Port); !slices.Contains(hosts, hp) {
			hosts = append(hosts, hp)
		}
	}
	return cfg.User + "@" + strings.Join(hosts, ",") + "/" + cfg.Database
}

func hostPort(host string, port uint16) string {
	return net.JoinHostPort(host, strconv.Itoa(int(port)))
}

// CheckURL reports, as a *SetupError, a connection string that does not
// parse. The error never quotes the string (a password may be anywhere in
// text that does not parse) and names the usual fixes.
func CheckURL(conn string) error {
	_, err := parseConfig(conn)
	return err
}

// parseConfig parses conn with defaultSSLMode applied; a string that does
// not parse is a *SetupError whose text holds none of conn.
func parseConfig(conn string) (*pgconn.Config, error) {
	orig, err := pgconn.ParseConfig(conn)
	if err != nil {
		return nil, parseError(err, conn)
	}
	for _, h := range append([]string{orig.Host}, fallbackHosts(orig)...) {
		if strings.Contains(h, "@") {
			// An unencoded '@' in a URL's password: the rest of the
			// password became the host, and would be printed as one.
			return nil, parseError(errors.New("a host name holds '@'"), conn)
		}
	}
	withMode := withDefaultSSLMode(conn)
	if withMode == conn {
		return orig, nil
	}
	// The default is added to the text; make sure it landed as a
	// parameter and changed nothing else (a '?' or '@' in a password can
	// move where the query starts).
	cfg, err := pgconn.ParseConfig(withMode)
	if err != nil || !sameTarget(orig, cfg) {
		return nil, setupErrorf("cannot add walrelay's default sslmode=%s to the PostgreSQL connection string (source.SetupConfig.URL; not shown, as it may hold a password): "+
			"set sslmode in it explicitly, and percent-encode reserved characters in a URL's password (%%3F for ?, %%40 for @, %%23 for #, %%25 for %%)", defaultSSLMode)
	}
	return cfg, nil
}

// sameTarget reports whether a and b connect to the same place the same
// way, TLS aside.
func sameTarget(a, b *pgconn.Config) bool {
	if a.Host != b.Host || a.Port != b.Port || a.Database != b.Database || a.User != b.User || a.Password != b.Password ||
		!maps.Equal(a.RuntimeParams, b.RuntimeParams) {
		return false
	}
	hosts := func(c *pgconn.Config) []string {
		var hs []string
		for _, fb := range c.Fallbacks {
			if hp := hostPort(fb.Host, fb.Port); !slices.Contains(hs, hp) && hp != hostPort(c.Host, c.Port) {
				hs = append(hs, hp)
			}
		}
		return hs
	}
	return slices.Equal(hosts(a), hosts(b))
}

// parseError is the *SetupError for a connection string pgconn cannot
// parse; it holds nothing of conn.
func parseError(err error, conn string) error {
	// pgconn quotes the string with a best-effort redaction; use only the
	// underlying reason (e.g. "sslmode is invalid", "unable to read CA
	// file: …"), scrubbed of anything that may be a password and of quoted
	// input fragments.
	reason := ""
	if inner := errors.Unwrap(err); inner != nil {
		reason = quoted.ReplaceAllString(redactText(inner.Error(), conn), `"…"`)
		reason = " (" + reason + ")"
	}
	if tlsFiles.MatchString(reason) {
		// The string parses; a file it names does not load. The files
		// are read at each connection: one rotated half-way or replaced
		// by a broken pair shows here.
		return setupErrorf("the TLS files that the PostgreSQL connection string (source.SetupConfig.URL) names, sslrootcert, sslcert and sslkey, do not load%s: "+
			"fix or replace them (a certificate with its own key, PEM); they are read again at each connection", reason)
	}
	return setupErrorf("the PostgreSQL connection string (source.SetupConfig.URL) does not parse%s; it is not shown, as it may hold a password. "+
		"Write postgres://user@host:port/database?sslmode=verify-full or key=value pairs (host=… user=… dbname=…), "+
		"percent-encode reserved characters in a URL's password (%%23 for #, %%40 for @, %%3A for :, %%2F for /, %%3F for ?, %%25 for %%), "+
		"or leave the password out and set PGPASSWORD or a passfile (~/.pgpass)", reason)
}

// tlsFiles matches pgconn's reasons for TLS files that do not load.
var tlsFiles = regexp.MustCompile(`unable to (read CA file|add CA to cert pool|read sslkey|decrypt key|read cert|load cert)|failed to decode sslkey`)

var quoted = regexp.MustCompile(`"[^"]*"|'[^']*'|` + "`[^`]*`")

// sslModeParam finds an sslmode setting in a URL query or key=value string.
var sslModeParam = regexp.MustCompile(`(?i)(?:^|[?&\s])sslmode\s*=\s*('[^']*'|[^&\s]*)`)

// SSLMode is the sslmode connections to conn use, and whether it was chosen
// (in the string or by PGSSLMODE) rather than walrelay's default.
func SSLMode(conn string) (mode string, explicit bool) {
	if m := sslModeParam.FindStringSubmatch(conn); m != nil {
		return strings.Trim(m[1], "'"), true
	}
	if env := os.Getenv("PGSSLMODE"); env != "" {
		return env, true
	}
	return defaultSSLMode, false
}

// withDefaultSSLMode adds sslmode=defaultSSLMode to conn when no sslmode
// is chosen.
func withDefaultSSLMode(conn string) string {
	if _, explicit := SSLMode(conn); explicit {
		return conn
	}
	if strings.HasPrefix(conn, "postgres://") || strings.HasPrefix(conn, "postgresql://") {
		// The query starts at a '?' after the user info (a password may
		// hold '?'); parseConfig checks the result.
		rest := conn[strings.LastIndex(conn, "@")+1:]
		switch {
		case strings.HasSuffix(rest, "?"):
			return conn + "sslmode=" + defaultSSLMode
		case strings.Contains(rest, "?"):
			return conn + "&sslmode=" + defaultSSLMode
		}
		return conn + "?sslmode=" + defaultSSLMode
	}
	return strings.TrimSpace(conn + " sslmode=" + defaultSSLMode)
}

// TLSWarning is a warning for logs when conn's sslmode lets a man in the
// middle read or impersonate the server, or "" when it does not (the
// default, verify-full, or only Unix sockets, which never use TLS).
func TLSWarning(conn string) string {
	cfg, err := pgconn.ParseConfig(withDefaultSSLMode(conn))
	if err != nil {
		return ""
	}
	remote := false
	for _, h := range append([]string{cfg.Host}, fallbackHosts(cfg)...) {
		if network, _ := pgconn.NetworkAddress(h, cfg.Port); network != "unix" {
			remote = true
		}
	}
	if !remote {
		return ""
	}
	mode, _ := SSLMode(conn)
	const fix = "use sslmode=verify-full (with sslrootcert=<CA file> when the server's CA is not in the system roots)"
	switch mode {
	case "verify-full":
		return ""
	case "verify-ca":
		return "PostgreSQL sslmode=verify-ca checks the server certificate's CA but not its host name: any server with a certificate from that CA is accepted; " + fix
	case "require":
		return "PostgreSQL sslmode=require encrypts but does not verify the server certificate: anyone on the network path can impersonate PostgreSQL and read the password and every streamed row; " + fix
	default: // disable, allow, prefer
		return fmt.Sprintf("PostgreSQL sslmode=%s may connect in plaintext (and does not verify a certificate): the password and every streamed row can be read or altered on the network path; %s", mode, fix)
	}
}

func fallbackHosts(cfg *pgconn.Config) []string {
	var hs []string
	for _, fb := range cfg.Fallbacks {
		hs = append(hs, fb.Host)
	}
	return hs
}

// passwordParam matches a parameter whose name contains "password"
// (password, sslpassword, …) in a URL query or key=value string.
var passwordParam = regexp.MustCompile(`(?i)[a-z0-9_]*password[a-z0-9_]*\s*=\s*('(?:[^'\\]|\\.)*'|[^&\s]*)`)

// secrets lists every text in conn that may be a password, longest first:
// the parsed password (also from a passfile), the values of parameters
// whose name contains "password", and every reading of a URL's userinfo
// password (after the first ':' up to any '@'), raw and percent-decoded.
// It errs towards too much, as it must also work on strings that do not
// parse.
func secrets(conn string) []string {
	var out []string
	add := func(s string) {
		if s != "" && !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	if cfg, err := pgconn.ParseConfig(conn); err == nil {
		add(cfg.Password)
	}
	for _, v := range []string{conn, percentDecode(conn)} {
		for _, m := range passwordParam.FindAllStringSubmatch(v, -1) {
			add(m[1])
			if inner, ok := strings.CutPrefix(m[1], "'"); ok {
				inner = strings.TrimSuffix(inner, "'")
				add(inner)
				add(strings.NewReplacer(`\'`, `'`, `\\`, `\`).Replace(inner))
			}
		}
		_, rest, ok := strings.Cut(v, "://")
		if !ok {
			continue
		}
		for at := range len(rest) {
			if rest[at] != '@' {
				continue
			}
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				add(pw)
				add(percentDecode(pw))
			}
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}

// percentDecode decodes the valid %XX escapes of s and keeps the rest.
func percentDecode(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '%' && i+2 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+3], 16, 8); err == nil {
				b.WriteByte(byte(v))
				i += 2
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// redactText replaces everything in text that may be a password of conn.
func redactText(text, conn string) string {
	for _, s := range secrets(conn) {
		text = strings.ReplaceAll(text, s, "xxxxx")
	}
	return text
}

// RedactError removes any trace of a password of conn from err's text.
func RedactError(err error, conn string) error {
	if err == nil {
		return nil
	}
	return &redactedError{msg: redactText(err.Error(), conn), err: err}
}

// connectError is the error of a failed connection to conn: a server that
// refuses TLS while sslmode requires it is a *SetupError naming the fix
// (retrying will not change it); anything else is redacted.
func connectError(err error, conn string) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42704" || pgErr.Code == "22023") {
		// A parameter of the connection string (options=-c …) the server
		// does not know or takes no such value of: every attempt fails
		// alike.
		return setupErrorf("PostgreSQL at %s refused a setting of the connection string (source.SetupConfig.URL): %s: correct or remove it", Redact(conn), pgErr.Message)
	}
	if mode, _ := SSLMode(conn); strings.Contains(err.Error(), "server refused TLS connection") && mode != "prefer" && mode != "allow" && mode != "disable" {
		return setupErrorf("PostgreSQL at %s does not accept TLS, and sslmode=%s requires it (verify-full is walrelay's default when source.SetupConfig.URL sets no sslmode): turn ssl on in the server, or, on a trusted network only, set sslmode=disable in source.SetupConfig.URL", Redact(conn), mode)
	}
	return RedactError(passwordSourceHint(err), conn)
}

// Connect opens a normal (non-replication) connection for checks and
// queries, with the password kept out of any error. A string that does not
// parse is a *SetupError, before any connection attempt; without sslmode
// the connection uses defaultSSLMode.
func Connect(ctx context.Context, url string) (*pgx.Conn, error) {
	if _, err := parseConfig(url); err != nil {
		return nil, err
	}
	cfg, err := pgx.ParseConfig(withDefaultSSLMode(url))
	if err != nil {
		return nil, fmt.Errorf("parse PostgreSQL URL %s: %w", Redact(url), RedactError(err, url))
	}
	if _, ok := cfg.RuntimeParams["application_name"]; !ok {
		cfg.RuntimeParams["application_name"] = "walrelay"
	}
	cfg.RuntimeParams["client_encoding"] = clientEncoding
	cfg.AfterConnect = applySettings
	usePasswordSource(&cfg.Config)
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		if err := connectError(err, url); IsSetupError(err) {
			return nil, err
		}
		return nil, fmt.Errorf("connect to PostgreSQL %s: %w", Redact(url), RedactError(passwordSourceHint(err), url))
	}
	return conn, nil
}
