package kafkaauth

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"

	"go.uber.org/zap"
)

// TLSFiles are the PEM files of a TLS client: the CA(s) that sign the
// servers' certificates, and the client's own certificate and key. The
// *tls.Config of Config reads them again at every handshake (every new
// connection) and uses what changed: a rotated CA or client certificate
// (cert-manager, Vault) takes effect at the next connection, without a
// restart. A replacement that does not load (a certificate and a key that
// do not match, a CA file without a certificate, a file half written) is
// logged at WARN once and the previous material is kept.
type TLSFiles struct {
	CA         string
	Cert       string
	Key        string
	ServerName string
	// InsecureSkipVerify does not verify the servers' certificates.
	InsecureSkipVerify bool
}

// Config loads the files (an error names the one that does not load) and
// returns the client configuration that keeps them current.
func (f TLSFiles) Config(log *zap.Logger) (*tls.Config, error) {
	if (f.Cert == "") != (f.Key == "") {
		return nil, errors.New("kafkaauth.TLSFiles.Cert and kafkaauth.TLSFiles.Key go together")
	}
	r := &tlsReloader{files: f, log: log}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: f.ServerName, InsecureSkipVerify: f.InsecureSkipVerify}
	if f.CA != "" {
		if _, err := r.roots(); err != nil {
			return nil, err
		}
		if !f.InsecureSkipVerify {
			// The standard verification reads RootCAs, fixed when the
			// config is made: verify here instead, with the CA file's
			// current certificates.
			cfg.InsecureSkipVerify = true //nolint:gosec // VerifyConnection verifies, with the reloaded roots
			cfg.VerifyConnection = r.verify
		}
	}
	if f.Cert != "" {
		if _, err := r.clientCert(); err != nil {
			return nil, err
		}
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return r.clientCert() }
	}
	return cfg, nil
}

// tlsReloader holds what the files held when they last loaded, and the
// digest of what failed to load (so that it is logged once).
type tlsReloader struct {
	files TLSFiles
	log   *zap.Logger

	mu                sync.Mutex
	caPEM             []byte
	pool              *x509.CertPool
	certPEM, keyPEM   []byte
	cert              *tls.Certificate
	badCA, badPair    [32]byte
	haveBadCA, badKey bool
}

// roots is the CA file's pool, reloaded when the file changed.
func (r *tlsReloader) roots() (*x509.CertPool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	b, err := os.ReadFile(r.files.CA)
	if err == nil && r.pool != nil && bytes.Equal(b, r.caPEM) {
		return r.pool, nil
	}
	if err == nil {
		pool := x509.NewCertPool()
		if pool.AppendCertsFromPEM(b) {
			if r.pool != nil {
				r.log.Info("kafka TLS CA file reloaded", zap.String("file", r.files.CA))
			}
			r.caPEM, r.pool, r.haveBadCA = b, pool, false
			return pool, nil
		}
		err = fmt.Errorf("kafkaauth.TLSFiles.CA %s: no PEM certificate in it", r.files.CA)
	} else {
		err = fmt.Errorf("kafkaauth.TLSFiles.CA: %w", err)
	}
	if r.pool == nil {
		return nil, err
	}
	if sum := sha256.Sum256(b); !r.haveBadCA || sum != r.badCA {
		r.badCA, r.haveBadCA = sum, true
		r.log.Warn("kafka TLS CA file not reloaded; the previous CA is kept", zap.Error(err))
	}
	return r.pool, nil
}

// clientCert is the client's certificate, reloaded when either file
// changed.
func (r *tlsReloader) clientCert() (*tls.Certificate, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	certPEM, err := os.ReadFile(r.files.Cert)
	var keyPEM []byte
	if err == nil {
		keyPEM, err = os.ReadFile(r.files.Key)
	}
	if err == nil && r.cert != nil && bytes.Equal(certPEM, r.certPEM) && bytes.Equal(keyPEM, r.keyPEM) {
		return r.cert, nil
	}
	if err == nil {
		var pair tls.Certificate
		if pair, err = tls.X509KeyPair(certPEM, keyPEM); err == nil {
			if r.cert != nil {
				r.log.Info("kafka TLS client certificate reloaded", zap.String("cert", r.files.Cert), zap.String("key", r.files.Key))
			}
			r.certPEM, r.keyPEM, r.cert, r.badKey = certPEM, keyPEM, &pair, false
			return r.cert, nil
		}
	}
	// tls.X509KeyPair's errors describe the files, never the key's bytes.
	err = fmt.Errorf("kafkaauth.TLSFiles.Cert/kafkaauth.TLSFiles.Key (%s, %s): %w", r.files.Cert, r.files.Key, err)
	if r.cert == nil {
		return nil, err
	}
	if sum := sha256.Sum256(append(append([]byte(nil), certPEM...), keyPEM...)); !r.badKey || sum != r.badPair {
		r.badPair, r.badKey = sum, true
		r.log.Warn("kafka TLS client certificate not reloaded; the previous one is kept", zap.Error(err))
	}
	return r.cert, nil
}

// verify checks the server's chain against the current CA file and its
// name against the name dialed (or TLSFiles.ServerName): what crypto/tls
// does itself when RootCAs is set.
func (r *tlsReloader) verify(cs tls.ConnectionState) error {
	pool, err := r.roots()
	if err != nil {
		return err
	}
	if len(cs.PeerCertificates) == 0 {
		return errors.New("tls: the server sent no certificate")
	}
	opts := x509.VerifyOptions{Roots: pool, DNSName: cs.ServerName, Intermediates: x509.NewCertPool()}
	for _, c := range cs.PeerCertificates[1:] {
		opts.Intermediates.AddCert(c)
	}
	if _, err := cs.PeerCertificates[0].Verify(opts); err != nil {
		return &tls.CertificateVerificationError{UnverifiedCertificates: cs.PeerCertificates, Err: err}
	}
	return nil
}
