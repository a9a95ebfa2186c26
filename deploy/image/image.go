// Command image builds walrelay's container image without a container
// engine: the static binary, a CA bundle, /etc/passwd and /etc/group for the
// nonroot user, in one layer on nothing, written as an OCI image layout and
// as a tarball that `docker load`, `podman load` and `kind load
// image-archive` take. The same commit, Go version and target give the same
// image digest: file times, owners and the creation time come from the
// commit (SOURCE_DATE_EPOCH overrides), the binary is built with -trimpath
// and without a build id. The image matches the Dockerfile (user, entry
// point, port, labels); image_test.go checks both.
//
//	go run . -version v1.2.3 -out ../../bin/image    (make image)
//
// It is a module of its own so that go-containerregistry stays out of
// walrelay's go.mod.
package main

import (
	"archive/tar"
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/crypto/x509roots/fallback/bundle"
)

// The image's fixed parts. The Dockerfile states the same (image_test.go
// compares them): distroless' nonroot user is 65532.
const (
	imageUser       = "65532:65532"
	binaryPath      = "walrelay" // in the layer: /walrelay
	caBundlePath    = "etc/ssl/certs/ca-certificates.crt"
	metricsPort     = "9187/tcp"
	repositoryName  = "walrelay"
	labelPrefix     = "org.opencontainers.image."
	sourceURL       = "https://github.com/walrelay/walrelay"
	imageTitle      = "walrelay"
	imageDesc       = "PostgreSQL outbox to Kafka relay"
	ociLayoutDir    = "oci"
	dockerTarball   = "walrelay-image.tar"
	builtBinaryName = "walrelay"
)

var (
	entrypoint = []string{"/walrelay"}
	cmd        = []string{"run"}
)

// Options of one build.
type Options struct {
	// Repo is the walrelay repository (its root, holding go.mod).
	Repo string
	// Version is main.version in the binary and the version label.
	Version string
	// Revision is the commit (the revision label); default git's HEAD.
	Revision string
	// Epoch is the time of every file and of the image; default
	// SOURCE_DATE_EPOCH, else the commit's time.
	Epoch time.Time
	// GOARCH of the binary and the image; default the host's.
	GOARCH string
}

func main() {
	var o Options
	var out string
	flag.StringVar(&o.Repo, "repo", "../..", "walrelay repository root")
	flag.StringVar(&o.Version, "version", "", "walrelay version (required): the binary's and the image's")
	flag.StringVar(&o.GOARCH, "goarch", runtime.GOARCH, "target architecture")
	flag.StringVar(&out, "out", "../../bin/image", "output directory: oci/ (OCI image layout), walrelay-image.tar, walrelay")
	flag.Parse()
	if o.Version == "" {
		fmt.Fprintln(os.Stderr, "image: -version is required (make image passes git describe)")
		os.Exit(80)
	}
	img, err := Build(o, out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(2)
	}
	d, _ := img.Digest()
	fmt.Printf("image %s:%s %s\n  OCI layout: %s\n  tarball:    %s (docker load -i …)\n", repositoryName, o.Version, d, filepath.Join(out, ociLayoutDir), filepath.Join(out, dockerTarball))
}

// Build compiles walrelay into out, assembles the image and writes it to
// out as an OCI image layout and a tarball.
func Build(o Options, out string) (v1.Image, error) {
	if err := o.defaults(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return nil, err
	}
	bin := filepath.Join(out, builtBinaryName)
	if err := compile(o, bin); err != nil {
		return nil, err
	}
	binary, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	img, err := Assemble(binary, o)
	if err != nil {
		return nil, err
	}
	return img, write(img, o.Version, out)
}

func (o *Options) defaults() error {
	if o.GOARCH == "" {
		o.GOARCH = runtime.GOARCH
	}
	if o.Revision == "" {
		rev, err := git(o.Repo, "rev-parse", "HEAD")
		if err != nil {
			return err
		}
		o.Revision = rev
	}
	if o.Epoch.IsZero() {
		s := os.Getenv("SOURCE_DATE_EPOCH")
		if s == "" {
			var err error
			if s, err = git(o.Repo, "log", "-1", "--format=%ct"); err != nil {
				return err
			}
		}
		sec, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", s, err)
		}
		o.Epoch = time.Unix(sec, 0).UTC()
	}
	return nil
}

func git(dir string, args ...string) (string, error) {
	c := exec.Command("git", args...)
	c.Dir = dir
	out, err := c.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %w (set SOURCE_DATE_EPOCH outside a git checkout)", strings.Join(args, " "), err)
	}
	return strings.TrimSpace(string(out)), nil
}

// compile builds the static binary: no cgo (no libc needed in the image),
// no file paths of this machine (-trimpath) and no build id, so that the
// same source and Go version give the same bytes.
func compile(o Options, bin string) error {
	c := exec.Command("go", "build", "-trimpath",
		"-ldflags", "-s -w -buildid= -X main.version="+o.Version,
		"-o", bin, "./cmd/walrelay")
	c.Dir = o.Repo
	c.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+o.GOARCH)
	if out, err := c.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %w\n%s", err, out)
	}
	return nil
}

// Assemble builds the image around binary.
func Assemble(binary []byte, o Options) (v1.Image, error) {
	if o.Version == "" || o.Revision == "" || o.Epoch.IsZero() {
		return nil, errors.New("Assemble: Version, Revision and Epoch must be set")
	}
	if o.GOARCH == "" {
		o.GOARCH = runtime.GOARCH
	}
	ca, err := caBundle()
	if err != nil {
		return nil, err
	}
	layerTar, err := rootfs(binary, ca, o.Epoch)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   v1.Time{Time: o.Epoch},
			CreatedBy: "deploy/image: /walrelay, the CA bundle, /etc/passwd and /etc/group (make image)",
			Comment:   "walrelay " + o.Version,
		},
	})
	if err != nil {
		return nil, err
	}
	img = mutate.MediaType(img, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture = o.GOARCH
	cf.OS = "linux"
	cf.Created = v1.Time{Time: o.Epoch}
	cf.Config = v1.Config{
		User:         imageUser,
		Entrypoint:   entrypoint,
		Cmd:          cmd,
		Env:          []string{"SSL_CERT_FILE=/" + caBundlePath},
		WorkingDir:   "/",
		ExposedPorts: map[string]struct{}{metricsPort: {}},
		Labels:       Labels(o),
	}
	return mutate.ConfigFile(img, cf)
}

// Labels are the image's OCI annotations-as-labels.
func Labels(o Options) map[string]string {
	return map[string]string{
		labelPrefix + "title":       imageTitle,
		labelPrefix + "description": imageDesc,
		labelPrefix + "source":      sourceURL,
		labelPrefix + "version":     o.Version,
		labelPrefix + "revision":    o.Revision,
		labelPrefix + "created":     o.Epoch.UTC().Format(time.RFC3339),
	}
}

// caBundle is Mozilla's root store as golang.org/x/crypto/x509roots ships
// it (pinned by go.sum, so the bundle does not depend on the building
// machine), in PEM, for the system roots walrelay verifies PostgreSQL and
// Kafka against. Roots NSS trusts only with a constraint (distrust after a
// date) cannot be said in PEM and are left out.
func caBundle() ([]byte, error) {
	var buf bytes.Buffer
	n := 0
	for r := range bundle.Roots() {
		if r.Constraint != nil {
			continue
		}
		if _, err := x509.ParseCertificate(r.Certificate); err != nil {
			return nil, fmt.Errorf("CA bundle: %w", err)
		}
		if err := pem.Encode(&buf, &pem.Block{Type: "CERTIFICATE", Bytes: r.Certificate}); err != nil {
			return nil, err
		}
		n++
	}
	if n == 0 {
		return nil, errors.New("CA bundle: no root certificate")
	}
	return buf.Bytes(), nil
}

// rootfs is the layer's tar: directories and files in a fixed order, owned
// by root, timed at epoch. Nothing is writable by the nonroot user, who
// needs to write nothing.
func rootfs(binary, ca []byte, epoch time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: 0o755, ModTime: epoch, Format: tar.FormatPAX})
	}
	file := func(name string, mode int64, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	steps := []func() error{
		func() error { return dir("etc") },
		func() error { return file("etc/group", 0o644, []byte("root:x:0:\nnonroot:x:65532:\n")) },
		func() error {
			return file("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"))
		},
		func() error { return dir("etc/ssl") },
		func() error { return dir("etc/ssl/certs") },
		func() error { return file(caBundlePath, 0o644, ca) },
		func() error { return dir("home") },
		func() error { return dir("home/nonroot") },
		func() error { return file(binaryPath, 0o755, binary) },
	}
	for _, s := range steps {
		if err := s(); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// write puts img into out as an OCI image layout (oci/, tagged with the
// version) and a tarball (walrelay-image.tar, repository walrelay).
func write(img v1.Image, version, out string) error {
	dir := filepath.Join(out, ociLayoutDir)
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": version,
	})); err != nil {
		return err
	}
	tag, err := name.NewTag(repositoryName + ":" + version)
	if err != nil {
		return fmt.Errorf("version %q is not a valid image tag: %w", version, err)
	}
	return tarball.WriteToFile(filepath.Join(out, dockerTarball), tag, img)
}
