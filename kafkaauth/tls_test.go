package kafkaauth

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

type ca struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newCA(t *testing.T, name string) *ca {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return &ca{c, key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

func (c *ca) leaf(t *testing.T, name string) (certPEM, keyPEM []byte, der []byte) {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &key.PublicKey, c.key)
	if err != nil {
		t.Fatal(err)
	}
	k, _ := x509.MarshalECPrivateKey(key)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: k}), der
}

// TestTLSFilesReload: a rotated client certificate and CA are used at the
// next handshake; a broken pair keeps the previous one with one WARN; a
// server of the old CA is refused once the CA file names only the new.
func TestTLSFilesReload(t *testing.T) {
	dir := t.TempDir()
	f := TLSFiles{CA: filepath.Join(dir, "ca.pem"), Cert: filepath.Join(dir, "c.pem"), Key: filepath.Join(dir, "k.pem")}
	write := func(path string, b []byte) {
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ca1, ca2 := newCA(t, "one"), newCA(t, "two")
	c1, k1, der1 := ca1.leaf(t, "client1")
	write(f.CA, ca1.pem)
	write(f.Cert, c1)
	write(f.Key, k1)
	core, logs := observer.New(zapcore.WarnLevel)
	cfg, err := f.Config(zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	got := func() []byte {
		c, err := cfg.GetClientCertificate(&tls.CertificateRequestInfo{})
		if err != nil {
			t.Fatal(err)
		}
		return c.Certificate[0]
	}
	if string(got()) != string(der1) {
		t.Fatal("first client certificate is not the file's")
	}
	c2, k2, der2 := ca2.leaf(t, "client2")
	write(f.Cert, c2)
	write(f.Key, k2)
	if string(got()) != string(der2) {
		t.Error("rotated client certificate not used at the next handshake")
	}
	_, k3, _ := ca2.leaf(t, "other")
	write(f.Key, k3) // does not match c2
	for range 3 {
		if string(got()) != string(der2) {
			t.Error("a broken pair replaced the good one")
		}
	}
	if logs.Len() != 1 {
		t.Errorf("%d WARN lines for a broken pair, want 1", logs.Len())
	}

	_, _, srvOld := ca1.leaf(t, "broker")
	old, _ := x509.ParseCertificate(srvOld)
	state := tls.ConnectionState{ServerName: "127.0.0.1", PeerCertificates: []*x509.Certificate{old}}
	if err := cfg.VerifyConnection(state); err != nil {
		t.Fatalf("server of the CA in the file refused: %v", err)
	}
	write(f.CA, ca2.pem)
	var verr *tls.CertificateVerificationError
	if err := cfg.VerifyConnection(state); !errors.As(err, &verr) {
		t.Errorf("server of the old CA after the CA file changed: %v, want a verification error", err)
	}
	_, _, srvNew := ca2.leaf(t, "broker")
	nw, _ := x509.ParseCertificate(srvNew)
	if err := cfg.VerifyConnection(tls.ConnectionState{ServerName: "127.0.0.1", PeerCertificates: []*x509.Certificate{nw}}); err != nil {
		t.Errorf("server of the new CA: %v", err)
	}
	if err := cfg.VerifyConnection(tls.ConnectionState{ServerName: "10.0.0.1", PeerCertificates: []*x509.Certificate{nw}}); err == nil {
		t.Error("a certificate for another host name was accepted")
	}
}
