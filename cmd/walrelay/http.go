package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/exporter-toolkit/web"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/walrelay/walrelay/holds"
)

// httpOptions configure the metrics and health listener.
type httpOptions struct {
	// Addr is where to listen (--metrics-addr).
	Addr string
	// WebConfigFile is an exporter-toolkit web configuration (TLS, basic
	// auth), the file Prometheus exporters take as --web.config.file;
	// empty serves plain HTTP without authentication.
	WebConfigFile string
	// IdleTimeout overrides how long a keep-alive connection may sit idle
	// (tests shorten it); 0 means httpIdleTimeout.
	IdleTimeout time.Duration
}

// Limits of the metrics listener: a scrape is one small request and a
// response of some hundred kilobytes, so anything slower or larger is a
// client holding a descriptor, not a scraper.
const (
	httpReadHeaderTimeout = 10 * time.Second
	httpReadTimeout       = 30 * time.Second
	httpWriteTimeout      = 30 * time.Second
	httpIdleTimeout       = 2 * time.Minute // above Prometheus' longest usual scrape interval
	httpMaxHeaderBytes    = 16 << 10
)

// newHTTPServer is the server with its limits set.
func newHTTPServer(o httpOptions, h http.Handler) *http.Server {
	idle := o.IdleTimeout
	if idle == 0 {
		idle = httpIdleTimeout
	}
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: httpReadHeaderTimeout,
		ReadTimeout:       httpReadTimeout,
		WriteTimeout:      httpWriteTimeout,
		IdleTimeout:       idle,
		MaxHeaderBytes:    httpMaxHeaderBytes,
	}
}

// serveHTTP serves /metrics, /healthz (the process is alive), /readyz
// (ready reports nil) and, when status is set, /status (its answer as
// JSON: what `walrelay status --relay-url` reads) on o.Addr, with TLS and basic auth when
// o.WebConfigFile says so. It returns the address listened on and a
// function that stops the server. A web config that does not load is an
// error here, before anything is served.
func serveHTTP(o httpOptions, reg *prometheus.Registry, ready func() error, status func() holds.Status, log *zap.Logger) (string, func(), error) {
	if err := web.Validate(o.WebConfigFile); err != nil {
		return "", nil, fmt.Errorf("--web-config-file %s: %w", o.WebConfigFile, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	if status != nil {
		mux.Handle("/status", holds.StatusHandler(status))
	}
	l, err := net.Listen("tcp", o.Addr)
	if err != nil {
		return "", nil, fmt.Errorf("--metrics-addr %s: %w", o.Addr, err)
	}
	srv := newHTTPServer(o, mux)
	webLog := slog.New(&zapSlog{log: log.Named("http")})
	cfgFile := o.WebConfigFile
	go func() {
		if err := web.Serve(l, srv, &web.FlagConfig{WebConfigFile: &cfgFile}, webLog); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", zap.Error(err))
		}
	}()
	log.Info("serving metrics and health", zap.String("addr", l.Addr().String()), zap.Bool("web_config", cfgFile != ""))
	return l.Addr().String(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx) // the caller is stopping: a slower client is cut off
	}, nil
}

// zapSlog hands exporter-toolkit's slog records to zap, at debug level
// for its routine messages (it announces every listener), so that the
// relay's log keeps one format.
type zapSlog struct {
	log    *zap.Logger
	fields []zap.Field
}

func (h *zapSlog) Enabled(context.Context, slog.Level) bool { return true }

func (h *zapSlog) Handle(_ context.Context, r slog.Record) error {
	lvl := zapcore.DebugLevel
	switch {
	case r.Level >= slog.LevelError:
		lvl = zapcore.ErrorLevel
	case r.Level >= slog.LevelWarn:
		lvl = zapcore.WarnLevel
	}
	if ce := h.log.Check(lvl, r.Message); ce != nil {
		fields := append([]zap.Field(nil), h.fields...)
		r.Attrs(func(a slog.Attr) bool {
			fields = append(fields, zap.Any(a.Key, a.Value.Any()))
			return true
		})
		ce.Write(fields...)
	}
	return nil
}

func (h *zapSlog) WithAttrs(as []slog.Attr) slog.Handler {
	n := &zapSlog{log: h.log, fields: append([]zap.Field(nil), h.fields...)}
	for _, a := range as {
		n.fields = append(n.fields, zap.Any(a.Key, a.Value.Any()))
	}
	return n
}

func (h *zapSlog) WithGroup(name string) slog.Handler {
	return &zapSlog{log: h.log.Named(name), fields: h.fields}
}
