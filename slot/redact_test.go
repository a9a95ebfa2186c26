package slot

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// secretURLs hold the password Secret99 (and the key password Keypass77)
// in the shapes that used to slip through redaction: URLs that do not
// parse, bad percent escapes, sslpassword, key=value strings.
var secretURLs = []struct {
	conn   string
	target string // what Redact prints; "" when the string does not parse
}{
	{"postgres://relay:ab#Secret99@db/app", "relay@db:5432/app"},
	{"postgres://relay:ab%zzSecret99@db/app", ""},
	{"postgres://relay:Secret99@db:6432/app?sslpassword=Keypass77", "relay@db:6432/app"},
	{"postgres://relay@db/app?sslmode=bogus&password=Secret99", ""},
	{"postgres://relay:p@ss:Secret99@db:5432/app", ""},
	{"postgres://relay:Secret99@x@db:5432/app", ""},
	{"postgres://relay:x@Secret99@db:5432/app", ""},
	{"postgresql://relay:Secret99@db1:5432,db2:5433/app?target_session_attrs=read-write", "relay@db1:5432,db2:5433/app"},
	{"host=db user=relay password=Secret99 sslpassword=Keypass77 dbname=app", "relay@db:5432/app"},
	{"host=db user=relay password='Secret99 x' dbname=app sslmode=bogus", ""},
	{"host=db user=relay PassWord = Secret99 dbname=app port=notaport", ""},
}

func assertNoSecret(t *testing.T, what, text string) {
	t.Helper()
	for _, s := range []string{"Secret99", "Keypass77"} {
		if strings.Contains(text, s) {
			t.Errorf("%s shows the secret %s: %s", what, s, text)
		}
	}
}

func TestRedactPrintsTheTargetOnly(t *testing.T) {
	for _, tc := range secretURLs {
		got := Redact(tc.conn)
		assertNoSecret(t, "Redact("+tc.conn+")", got)
		want := tc.target
		if want == "" {
			want = "(unparseable connection string)"
		}
		if got != want {
			t.Errorf("Redact(%s) = %q, want %q", tc.conn, got, want)
		}
	}
}

func TestRedactErrRemovesEveryPassword(t *testing.T) {
	for _, tc := range secretURLs {
		// An error that quotes the string whole, as url.Parse's does.
		err := RedactError(errors.New("parse "+tc.conn+": bad"), tc.conn)
		assertNoSecret(t, "RedactError", err.Error())
	}
}

func TestUnparseableURLIsASetupErrorWithoutItsText(t *testing.T) {
	for _, tc := range secretURLs {
		err := CheckURL(tc.conn)
		if tc.target != "" {
			if err != nil {
				t.Errorf("CheckURL(%s): %v", tc.conn, err)
			}
			continue
		}
		if err == nil || !IsSetupError(err) {
			t.Errorf("CheckURL(%s) = %v, want a setup error", tc.conn, err)
			continue
		}
		assertNoSecret(t, "CheckURL", err.Error())
		if !strings.Contains(err.Error(), "PGPASSWORD") {
			t.Errorf("the error does not name the fix: %v", err)
		}
		if _, err := ReplicationConfig(tc.conn); !IsSetupError(err) {
			t.Errorf("ReplicationConfig(%s) = %v, want a setup error", tc.conn, err)
		} else {
			assertNoSecret(t, "ReplicationConfig", err.Error())
		}
		// Refused before any connection attempt: no dial, no timeout.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		start := time.Now()
		_, err = Connect(ctx, tc.conn)
		cancel()
		if !IsSetupError(err) || time.Since(start) > time.Second {
			t.Errorf("Connect(%s) = %v after %s, want a setup error at once", tc.conn, err, time.Since(start))
		} else {
			assertNoSecret(t, "Connect", err.Error())
		}
	}
}

// TestConnectErrorsHideThePassword dials a closed port with URLs that
// parse: the connection error names the target, never the password.
func TestConnectErrorsHideThePassword(t *testing.T) {
	for _, conn := range []string{
		"postgres://relay:ab#Secret99@127.0.0.1:1/app?sslmode=disable&connect_timeout=2",
		"postgres://relay:Secret99@127.0.0.1:1/app?sslmode=disable&sslpassword=Keypass77&connect_timeout=2",
		"host=127.0.0.1 port=1 user=relay password=Secret99 sslpassword=Keypass77 dbname=app sslmode=disable connect_timeout=2",
	} {
		_, err := Connect(context.Background(), conn)
		if err == nil {
			t.Fatalf("Connect(%s) succeeded", conn)
		}
		assertNoSecret(t, "Connect", err.Error())
		if !strings.Contains(err.Error(), "relay@127.0.0.1:1/app") {
			t.Errorf("the error does not name the target: %v", err)
		}
		_, err = ReplicationConfig(conn)
		if err != nil {
			t.Errorf("ReplicationConfig(%s): %v", conn, err)
		}
	}
}

func TestSSLMode(t *testing.T) {
	for _, tc := range []struct {
		conn, env, mode string
		explicit        bool
	}{
		{"postgres://u@h/db", "", "verify-full", false},
		{"postgres://u@h/db?application_name=x", "", "verify-full", false},
		{"postgres://u@h/db?sslmode=require", "", "require", true},
		{"postgres://u@h/db?sslmode=disable", "verify-full", "disable", true},
		{"host=h user=u sslmode=prefer", "", "prefer", true},
		{"host=h user=u", "", "verify-full", false},
		{"postgres://u@h/db", "allow", "allow", true},
	} {
		t.Setenv("PGSSLMODE", tc.env)
		mode, explicit := SSLMode(tc.conn)
		if mode != tc.mode || explicit != tc.explicit {
			t.Errorf("SSLMode(%s) with PGSSLMODE=%q = %s, %v; want %s, %v", tc.conn, tc.env, mode, explicit, tc.mode, tc.explicit)
		}
	}
}

// TestDefaultSSLModeVerifies: without sslmode the connection verifies the
// server's certificate and host name and has no plaintext fallback
// (pgx's own default, prefer, has both holes).
func TestDefaultSSLModeVerifies(t *testing.T) {
	t.Setenv("PGSSLMODE", "")
	for _, conn := range []string{
		"postgres://relay@db.example/app", "host=db.example user=relay dbname=app",
		"postgres://relay:a?b@db.example/app", "postgres://relay@db.example/app?", "postgres://relay:a#b@db.example/app?application_name=x",
	} {
		cfg, err := ReplicationConfig(conn)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.Database != "app" || cfg.User != "relay" {
			t.Errorf("%s: database %q user %q: adding the default sslmode changed the target", conn, cfg.Database, cfg.User)
		}
		if cfg.TLSConfig == nil || cfg.TLSConfig.InsecureSkipVerify && cfg.TLSConfig.VerifyPeerCertificate == nil {
			t.Errorf("%s: TLS %+v, want verified TLS", conn, cfg.TLSConfig)
		}
		if cfg.TLSConfig != nil && cfg.TLSConfig.ServerName != "db.example" {
			t.Errorf("%s: TLS server name %q, want the host verified", conn, cfg.TLSConfig.ServerName)
		}
		if len(cfg.Fallbacks) != 0 {
			t.Errorf("%s: %d fallbacks (plaintext after TLS fails?), want none", conn, len(cfg.Fallbacks))
		}
	}
	// An explicit mode is honoured.
	cfg, err := ReplicationConfig("postgres://relay@db.example/app?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.TLSConfig != nil {
		t.Errorf("sslmode=disable: TLS %+v", cfg.TLSConfig)
	}
}

func TestTLSWarning(t *testing.T) {
	t.Setenv("PGSSLMODE", "")
	for _, tc := range []struct {
		conn string
		want string // "" for no warning
	}{
		{"postgres://u@h/db", ""},
		{"postgres://u@h/db?sslmode=verify-full", ""},
		{"postgres://u@h/db?sslmode=verify-ca", "host name"},
		{"postgres://u@h/db?sslmode=require", "does not verify"},
		{"postgres://u@h/db?sslmode=prefer", "plaintext"},
		{"postgres://u@h/db?sslmode=allow", "plaintext"},
		{"postgres://u@h/db?sslmode=disable", "plaintext"},
		{"host=/var/run/postgresql user=u sslmode=disable", ""}, // a Unix socket never uses TLS
	} {
		got := TLSWarning(tc.conn)
		if tc.want == "" && got != "" || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("TLSWarning(%s) = %q, want %q", tc.conn, got, tc.want)
		}
	}
}
