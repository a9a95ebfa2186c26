// Package keycloak starts a throwaway Keycloak (development mode,
// in-memory storage, loopback, a free port) for the integration tests of
// OAUTHBEARER against a real identity provider: a realm with one
// confidential client for the client-credentials grant, an audience mapper
// for the broker's expected audience, tokens of a lifetime the test
// chooses, and SIGSTOP/SIGCONT to make it hang as a frozen identity
// provider does. It is test infrastructure only.
//
// Keycloak is its server distribution as Maven Central carries it
// (keycloak-quarkus-dist's zip, see pom.xml), unpacked once into the
// user's cache directory under a name keyed by the pom's hash. Its first
// start there builds the server for development mode (minutes on a loaded
// machine); later starts reuse that build. It needs Java 21 or later
// (schemaregistry.Java finds one).
package keycloak

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/walrelay/walrelay/test/mavencp"
	"github.com/walrelay/walrelay/test/schemaregistry"
)

// pom is the Maven project naming Keycloak's archive; embedded so that
// its hash keys the cache.
//
//go:embed pom.xml
var pom []byte

// The bootstrap administrator of every Keycloak started here (loopback
// only, in memory, gone with the process).
const (
	adminUser     = "admin"
	adminPassword = "admin-Pa55-test"
)

// project is Keycloak's archive on Maven Central, unpacked into
// <user cache dir>/walrelay/keycloak-<first 8 bytes of the pom's SHA-256,
// hex>.
var project = mavencp.Project{Name: "keycloak", What: "Keycloak", Pom: pom}

// Home returns Keycloak's directory (holding bin/kc.sh), unpacking the
// archive with Maven first when it is not there (downloading it into
// ~/.m2 if need be).
func Home() (string, error) { return project.Unpack(home) }

// home is the one keycloak-* directory under dir holding bin/kc.sh.
func home(dir string) (string, error) {
	found, _ := filepath.Glob(filepath.Join(dir, "keycloak-*", "bin", "kc.sh"))
	if len(found) != 1 {
		return "", fmt.Errorf("keycloak: %s holds %d Keycloak distributions, want 1", dir, len(found))
	}
	return filepath.Dir(filepath.Dir(found[0])), nil
}

// Keycloak is a running Keycloak.
type Keycloak struct {
	// URL is its base URL (http://127.0.0.1:<port>).
	URL string
	// Log is the file it writes its output to.
	Log string

	cmd    *exec.Cmd
	exited chan struct{}
	once   sync.Once
}

// Start starts Keycloak and waits until it answers, or ctx ends. Its
// output goes to a file in logDir.
func Start(ctx context.Context, logDir string) (*Keycloak, error) {
	home, err := Home()
	if err != nil {
		return nil, err
	}
	java, err := schemaregistry.Java()
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	k := &Keycloak{URL: fmt.Sprintf("http://127.0.0.1:%d", port), Log: filepath.Join(logDir, "keycloak.log"), exited: make(chan struct{})}
	out, err := os.Create(k.Log)
	if err != nil {
		return nil, err
	}
	// Development mode with in-memory storage: nothing is left in home for
	// the next start, and the options never change, so the build of the
	// first start is reused.
	k.cmd = exec.Command(filepath.Join(home, "bin", "kc.sh"), "start-dev", "--db", "dev-mem",
		"--http-host", "127.0.0.1", "--http-port", fmt.Sprint(port))
	k.cmd.Env = append(os.Environ(), "JAVA_HOME="+filepath.Dir(filepath.Dir(java)),
		"KC_BOOTSTRAP_ADMIN_USERNAME="+adminUser, "KC_BOOTSTRAP_ADMIN_PASSWORD="+adminPassword)
	k.cmd.Stdout, k.cmd.Stderr = out, out
	// kc.sh may run the JVM as its child: both get a process group of
	// their own, which Hang, Continue and Stop signal.
	k.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := k.cmd.Start(); err != nil {
		out.Close()
		return nil, fmt.Errorf("start Keycloak: %w", err)
	}
	go func() {
		_ = k.cmd.Wait()
		out.Close()
		close(k.exited)
	}()
	for {
		resp, err := http.Get(k.URL + "/realms/master/.well-known/openid-configuration")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return k, nil
			}
		}
		select {
		case <-k.exited:
			return nil, fmt.Errorf("keycloak: exited before answering: %s", tail(k.Log))
		case <-ctx.Done():
			k.Stop()
			return nil, fmt.Errorf("keycloak: not answering: %w (log: %s)", ctx.Err(), tail(k.Log))
		case <-time.After(200 * time.Millisecond): // the next look at a starting JVM
		}
	}
}

// Realm is a realm made by AddRealm.
type Realm struct {
	k    *Keycloak
	name string
}

// Issuer is the realm's issuer (the tokens' iss).
func (r *Realm) Issuer() string { return r.k.URL + "/realms/" + r.name }

// TokenURL is the realm's token endpoint.
func (r *Realm) TokenURL() string { return r.Issuer() + "/protocol/openid-connect/token" }

// JWKSURL serves the realm's signing keys.
func (r *Realm) JWKSURL() string { return r.Issuer() + "/protocol/openid-connect/certs" }

// AddRealm makes a realm whose access tokens live life, with a
// confidential client (client credentials only) whose tokens carry
// audience, and records its client-credentials logins (Issued).
func (k *Keycloak) AddRealm(name string, life time.Duration, clientID, secret, audience string) (*Realm, error) {
	realm := map[string]any{
		"realm": name, "enabled": true, "accessTokenLifespan": int(life.Seconds()),
		"eventsEnabled": true, "enabledEventTypes": []string{"CLIENT_LOGIN"},
		"clients": []map[string]any{{
			"clientId": clientID, "secret": secret, "publicClient": false, "serviceAccountsEnabled": true,
			"standardFlowEnabled": false, "directAccessGrantsEnabled": false,
			"protocolMappers": []map[string]any{{
				"name": "audience", "protocol": "openid-connect", "protocolMapper": "oidc-audience-mapper",
				"config": map[string]string{"included.custom.audience": audience, "access.token.claim": "true", "id.token.claim": "false"},
			}},
		}},
	}
	if err := k.admin(http.MethodPost, "/admin/realms", realm, nil); err != nil {
		return nil, err
	}
	return &Realm{k: k, name: name}, nil
}

// Issued counts the tokens the realm gave by the client-credentials grant
// (its CLIENT_LOGIN events).
func (r *Realm) Issued() (int64, error) {
	var events []json.RawMessage
	err := r.k.admin(http.MethodGet, "/admin/realms/"+r.name+"/events?type=CLIENT_LOGIN&max=100000", nil, &events)
	return int64(len(events)), err
}

// admin calls Keycloak's admin API as the bootstrap administrator,
// decoding the answer into out (when not nil).
func (k *Keycloak) admin(method, path string, in, out any) error {
	form := url.Values{"grant_type": {"password"}, "client_id": {"admin-cli"}, "username": {adminUser}, "password": {adminPassword}}
	resp, err := http.PostForm(k.URL+"/realms/master/protocol/openid-connect/token", form)
	if err != nil {
		return err
	}
	var tok struct {
		AccessToken string `json:"access_token"`
	}
	err = json.NewDecoder(resp.Body).Decode(&tok)
	resp.Body.Close()
	if err != nil || tok.AccessToken == "" {
		return fmt.Errorf("keycloak: the administrator's token: HTTP %d, %v", resp.StatusCode, err)
	}
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, k.URL+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+tok.AccessToken)
	req.Header.Set("Content-Type", "application/json")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("keycloak: %s %s: HTTP %d: %s", method, path, resp.StatusCode, b)
	}
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}

// Hang stops Keycloak (SIGSTOP to its process group): its kernel still
// accepts connections, and nothing answers them, until Continue.
func (k *Keycloak) Hang() error { return syscall.Kill(-k.cmd.Process.Pid, syscall.SIGSTOP) }

// Continue undoes Hang (SIGCONT): the requests taken meanwhile are
// answered.
func (k *Keycloak) Continue() error { return syscall.Kill(-k.cmd.Process.Pid, syscall.SIGCONT) }

// Stop kills Keycloak (stopped or not) and waits for it to exit; its log
// stays.
func (k *Keycloak) Stop() {
	k.once.Do(func() {
		_ = syscall.Kill(-k.cmd.Process.Pid, syscall.SIGKILL)
		<-k.exited
	})
}

// tail is the end of the log file, for an error.
func tail(file string) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return file + ":\n" + strings.Join(lines, "\n")
}
