package main

import (
	"archive/tar"
	"bytes"
	"debug/buildinfo"
	"debug/elf"
	"encoding/pem"
	"errors"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
)

const (
	repo        = "../.."
	testVersion = "v0.0.0-imagetest"
	dockerfile  = "../../Dockerfile"
)

var (
	buildOnce sync.Once
	built     struct {
		dir  string
		opts Options
		err  error
	}
)

// TestMain removes the image the tests built (buildImage shares one).
func TestMain(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// buildImage runs Build once for the package's tests, as `make image` does.
func buildImage(t *testing.T) (string, Options) {
	t.Helper()
	buildOnce.Do(func() {
		built.dir, built.err = os.MkdirTemp("", "walrelay-image-")
		if built.err != nil {
			return
		}
		built.opts = Options{Repo: repo, Version: testVersion}
		_, built.err = Build(built.opts, built.dir)
		if built.err == nil {
			built.err = built.opts.defaults()
		}
	})
	if built.err != nil {
		t.Fatalf("build: %v", built.err)
	}
	return built.dir, built.opts
}

func layoutImage(t *testing.T, dir string) v1.Image {
	t.Helper()
	p, err := layout.FromPath(filepath.Join(dir, ociLayoutDir))
	if err != nil {
		t.Fatal(err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != testVersion {
		t.Fatalf("OCI layout index %+v: want one image named %s", im.Manifests, testVersion)
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// TestImageConfig: the image runs as the numeric nonroot user, starts
// `walrelay run`, says its version, revision and time in labels, and
// carries no secret in its configuration or history.
func TestImageConfig(t *testing.T) {
	dir, o := buildImage(t)
	img := layoutImage(t, dir)
	if mt, _ := img.MediaType(); mt != types.OCIManifestSchema1 {
		t.Errorf("manifest media type %s, want OCI", mt)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	c := cf.Config
	// Kubernetes' runAsNonRoot can only verify a numeric user.
	if !regexp.MustCompile(`^[1-9][0-9]*:[0-9]+$`).MatchString(c.User) {
		t.Errorf("user %q: want a numeric non-root uid:gid", c.User)
	}
	if !slices.Equal(c.Entrypoint, []string{"/walrelay"}) || !slices.Equal(c.Cmd, []string{"run"}) {
		t.Errorf("entrypoint %v cmd %v, want [/walrelay] [run]", c.Entrypoint, c.Cmd)
	}
	if _, ok := c.ExposedPorts["9187/tcp"]; !ok || len(c.ExposedPorts) != 1 {
		t.Errorf("exposed ports %v, want 9187/tcp (--metrics-addr's default)", c.ExposedPorts)
	}
	if cf.OS != "linux" || cf.Architecture != runtime.GOARCH {
		t.Errorf("platform %s/%s, want linux/%s", cf.OS, cf.Architecture, runtime.GOARCH)
	}
	head, err := git(repo, "rev-parse", "HEAD")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"org.opencontainers.image.version":  testVersion,
		"org.opencontainers.image.revision": head,
		"org.opencontainers.image.created":  o.Epoch.Format(time.RFC3339),
	}
	for k, v := range want {
		if c.Labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, c.Labels[k], v)
		}
	}
	if !cf.Created.Time.Equal(o.Epoch) {
		t.Errorf("created %s, want the commit's time %s (reproducible)", cf.Created.Time, o.Epoch)
	}
	// Nothing of the building machine's environment: only what Assemble sets.
	secretish := regexp.MustCompile(`(?i)password|secret|token|private.?key|credential|://[^/\s:@]+:[^/\s@]+@`)
	if !slices.Equal(c.Env, []string{"SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"}) {
		t.Errorf("env %v, want only SSL_CERT_FILE", c.Env)
	}
	var texts []string
	texts = append(texts, c.Env...)
	for k, v := range c.Labels {
		texts = append(texts, k+"="+v)
	}
	for _, h := range cf.History {
		texts = append(texts, h.CreatedBy, h.Comment)
	}
	for _, s := range texts {
		if secretish.MatchString(s) {
			t.Errorf("image configuration holds %q", s)
		}
	}
}

// layerFiles reads the image's one layer: name → header and content.
func layerFiles(t *testing.T, img v1.Image) (map[string]*tar.Header, map[string][]byte) {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(layers) != 1 {
		t.Fatalf("%d layers, want 1", len(layers))
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	hdrs, data := map[string]*tar.Header{}, map[string][]byte{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return hdrs, data
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		hdrs[h.Name], data[h.Name] = h, b
	}
}

// TestImageLayer: the layer holds exactly the binary, the CA bundle and the
// user database, root's and read-only for the relay, with no key and no
// path of the building machine in it; the binary is static, built with
// -trimpath, and says the image's version.
func TestImageLayer(t *testing.T) {
	dir, o := buildImage(t)
	img := layoutImage(t, dir)
	hdrs, data := layerFiles(t, img)
	wantNames := []string{"etc/", "etc/group", "etc/passwd", "etc/ssl/", "etc/ssl/certs/", "etc/ssl/certs/ca-certificates.crt", "home/", "home/nonroot/", "walrelay"}
	if got := slices.Sorted(maps.Keys(hdrs)); !slices.Equal(got, wantNames) {
		t.Fatalf("layer files %v, want %v", got, wantNames)
	}
	for n, h := range hdrs {
		if h.Uid != 0 || h.Gid != 0 || h.Mode&0o7022 != 0 || !h.ModTime.Equal(o.Epoch) {
			t.Errorf("%s: owner %d:%d mode %o time %s: want root's, not writable by others, no setuid, at %s", n, h.Uid, h.Gid, h.Mode, h.ModTime, o.Epoch)
		}
	}
	if !strings.Contains(string(data["etc/passwd"]), ":65532:65532:") {
		t.Errorf("/etc/passwd has no user 65532:\n%s", data["etc/passwd"])
	}

	// Text files: PEM certificates only, no private key.
	for _, n := range []string{"etc/group", "etc/passwd", caBundlePath} {
		rest, certs := data[n], 0
		for {
			var b *pem.Block
			b, rest = pem.Decode(rest)
			if b == nil {
				break
			}
			if b.Type != "CERTIFICATE" {
				t.Errorf("%s holds a PEM %s", n, b.Type)
			}
			certs++
		}
		if n == caBundlePath && certs < 100 {
			t.Errorf("CA bundle holds %d certificates, want Mozilla's root store (over 100)", certs)
		}
	}

	bin := data["walrelay"]
	abs, _ := filepath.Abs(repo)
	paths := []string{abs}
	for _, v := range []string{"GOMODCACHE", "GOROOT"} {
		out, err := exec.Command("go", "env", v).Output()
		if err != nil {
			t.Fatal(err)
		}
		paths = append(paths, strings.TrimSpace(string(out)))
	}
	for _, p := range paths {
		if len(p) > 1 && bytes.Contains(bin, []byte(p+"/")) {
			t.Errorf("the binary holds the building machine's path %s: not built with -trimpath", p)
		}
	}
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary has a dynamic loader (PT_INTERP): not static, the image has no libc")
		}
	}
	bi, err := buildinfo.Read(bytes.NewReader(bin))
	if err != nil {
		t.Fatal(err)
	}
	settings := map[string]string{}
	for _, s := range bi.Settings {
		settings[s.Key] = s.Value
	}
	for k, v := range map[string]string{"CGO_ENABLED": "0", "-trimpath": "true", "GOOS": "linux"} {
		if settings[k] != v {
			t.Errorf("build setting %s = %q, want %q", k, settings[k], v)
		}
	}

	// The binary in the image says the image's version, run inside the
	// layer's files alone (no libc, no shell, the image's /etc) as the
	// image's user: chroot, which needs root; elsewhere from a copy.
	if runtime.GOOS != "linux" {
		return
	}
	root := t.TempDir()
	for n, h := range hdrs {
		p := filepath.Join(root, n)
		if h.Typeflag == tar.TypeDir {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data[n], os.FileMode(h.Mode)); err != nil {
			t.Fatal(err)
		}
	}
	run := exec.Command(filepath.Join(root, "walrelay"), "--version")
	if ch, err := exec.LookPath("chroot"); err == nil && os.Geteuid() == 0 {
		if err := os.Chmod(root, 0o755); err != nil {
			t.Fatal(err)
		}
		run = exec.Command(ch, "--userspec="+imageUser, root, "/walrelay", "--version")
	} else {
		t.Log("not root or no chroot: the binary runs from a copy, not inside the image's files")
	}
	run.Env = []string{}
	out, err := run.CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != testVersion {
		t.Errorf("%s: %q (%v), want %s", run, out, err, testVersion)
	}
}

// TestImageReproducible: the same binary and options give the same digest,
// the written layout holds that image, and the tarball holds the same
// configuration and layer.
func TestImageReproducible(t *testing.T) {
	dir, o := buildImage(t)
	bin, err := os.ReadFile(filepath.Join(dir, builtBinaryName))
	if err != nil {
		t.Fatal(err)
	}
	var digests []v1.Hash
	for range 2 {
		img, err := Assemble(bin, o)
		if err != nil {
			t.Fatal(err)
		}
		d, err := img.Digest()
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, d)
	}
	written, err := layoutImage(t, dir).Digest()
	if err != nil {
		t.Fatal(err)
	}
	if digests[0] != digests[1] || digests[0] != written {
		t.Errorf("digests %v and the layout's %s: the build is not reproducible", digests, written)
	}
	other := o
	other.Epoch = o.Epoch.Add(time.Second)
	img, err := Assemble(bin, other)
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := img.Digest(); d == digests[0] {
		t.Error("another epoch gave the same digest: the digest check would not notice a change")
	}

	tag, _ := name.NewTag(repositoryName + ":" + testVersion)
	timg, err := tarball.ImageFromPath(filepath.Join(dir, dockerTarball), &tag)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := layoutImage(t, dir).ConfigName()
	if got, err := timg.ConfigName(); err != nil || got != want {
		t.Errorf("tarball config %s (%v), want the layout's %s", got, err, want)
	}
}

// TestDockerfileMatches: the Dockerfile's final stage states the image
// `make image` builds: user, entry point, command, port and label names,
// and the fixed label values.
func TestDockerfileMatches(t *testing.T) {
	f, err := os.Open(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := parser.Parse(f)
	if err != nil {
		t.Fatal(err)
	}
	// The instructions after the last FROM.
	var final []*parser.Node
	for _, n := range res.AST.Children {
		if strings.EqualFold(n.Value, "from") {
			final = nil
		}
		final = append(final, n)
	}
	args := func(n *parser.Node) []string {
		var out []string
		for a := n.Next; a != nil; a = a.Next {
			out = append(out, a.Value)
		}
		return out
	}
	got := map[string][]string{}
	labels := map[string]string{}
	for _, n := range final {
		switch v := strings.ToLower(n.Value); v {
		case "entrypoint", "cmd":
			if !n.Attributes["json"] {
				t.Errorf("%s is in shell form: the image has no shell", strings.ToUpper(v))
			}
			got[v] = args(n)
		case "user", "expose":
			got[v] = args(n)
		case "label":
			// The parser gives each pair as key, value, "=".
			a := args(n)
			for i := 0; i+1 < len(a); i += 3 {
				labels[a[i]] = strings.Trim(a[i+1], `"`)
			}
		}
	}
	for k, want := range map[string][]string{
		"entrypoint": entrypoint,
		"cmd":        cmd,
		"user":       {imageUser},
		"expose":     {strings.TrimSuffix(metricsPort, "/tcp")},
	} {
		if !slices.Equal(got[k], want) {
			t.Errorf("Dockerfile %s %v, want %v (as make image)", strings.ToUpper(k), got[k], want)
		}
	}
	img := Labels(Options{Version: "v", Revision: "r", Epoch: time.Unix(0, 0)})
	if g, w := slices.Sorted(maps.Keys(labels)), slices.Sorted(maps.Keys(img)); !slices.Equal(g, w) {
		t.Errorf("Dockerfile labels %v, want %v (as make image)", g, w)
	}
	for _, k := range []string{"title", "description", "source"} {
		if k = labelPrefix + k; labels[k] != img[k] {
			t.Errorf("Dockerfile label %s = %q, want %q", k, labels[k], img[k])
		}
	}
}
