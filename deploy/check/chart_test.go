package check

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/intstr"
	kyaml "k8s.io/apimachinery/pkg/util/yaml"
	psaapi "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
	"sigs.k8s.io/yaml"
)

const (
	chartDir                = "../helm/walrelay"
	kubernetesAlertsFile    = "../prometheus/alerts-kubernetes.yml"
	helmMissingExplanation  = "helm not found: `make deps-helm` installs the pinned version (the Makefile passes it as WALRELAY_HELM)"
	chartReleaseName        = "walrelay"
	chartReleaseNamespace   = "relays"
	chartShutdownTimeoutEnv = "WALRELAY_SHUTDOWN_TIMEOUT"
)

// chartCase is one values file the chart is linted and rendered with.
type chartCase struct {
	name      string
	values    string // "" for the chart's defaults
	delivery  string
	wantKinds []string
	// kubernetesRules: the PrometheusRule holds alerts-kubernetes.yml too.
	kubernetesRules bool
}

var chartCases = []chartCase{
	{
		name: "default", delivery: "at-least-once",
		wantKinds: []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"},
	},
	{
		name: "full", values: "ci/full-values.yaml", delivery: "exactly-once", kubernetesRules: true,
		wantKinds: []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "PrometheusRule", "Service", "ServiceAccount", "ServiceMonitor"},
	},
	{
		name: "at-least-once", values: "ci/at-least-once-values.yaml", delivery: "at-least-once",
		wantKinds: []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "PrometheusRule", "Service", "ServiceAccount", "ServiceMonitor"},
	}, {
		name: "cloud", values: "ci/cloud-values.yaml", delivery: "at-least-once",
		wantKinds: []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"},
	},
}

// helmBinary is $WALRELAY_HELM, else helm on PATH; the test skips without
// one (make test always passes it).
func helmBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("WALRELAY_HELM"); p != "" {
		return p
	}
	p, err := exec.LookPath("helm")
	if err != nil {
		t.Skip(helmMissingExplanation)
	}
	return p
}

// helm runs helm on the chart; stderr is kept apart because helm warns
// there about the files/ links on every run.
func helm(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, helmBinary(t), args...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

func valuesArgs(c chartCase) []string {
	if c.values == "" {
		return nil
	}
	return []string{"-f", filepath.Join(chartDir, c.values)}
}

// render is `helm template` of the chart with c's values.
func render(t *testing.T, c chartCase, extra ...string) (string, error) {
	t.Helper()
	args := append([]string{"template", chartReleaseName, chartDir, "--namespace", chartReleaseNamespace}, valuesArgs(c)...)
	out, errOut, err := helm(t, append(args, extra...)...)
	if err != nil {
		return "", fmt.Errorf("helm template: %v\n%s", err, errOut)
	}
	return out, nil
}

// scheme knows every kind the chart may render, so that decoding is typed.
func scheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme, monitoringv1.AddToScheme} {
		if err := add(s); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// decodeStrict decodes every YAML document of a rendering into its
// Kubernetes API type the way an API server with strict field validation
// does: an unknown field, a duplicate field or a field of the wrong case is
// an error, and so is a kind the scheme does not know.
func decodeStrict(s *runtime.Scheme, rendered string) ([]runtime.Object, error) {
	ser := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, s, s, kjson.SerializerOptions{Yaml: true, Strict: true})
	r := kyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(rendered)))
	var objs []runtime.Object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, gvk, err := ser.Decode(doc, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%v: %w\n%s", gvk, err, doc)
		}
		objs = append(objs, obj)
	}
}

// stripComments drops the lines that are only a comment (helm's "# Source:").
func stripComments(doc []byte) []byte {
	var out []byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(line); len(t) > 0 && t[0] != '#' && !bytes.Equal(t, []byte("---")) {
			out = append(out, line...)
			out = append(out, '\n')
		}
	}
	return out
}

// rendered is one rendering's objects by kind.
type rendered struct {
	deploy  *appsv1.Deployment
	svc     *corev1.Service
	sa      *corev1.ServiceAccount
	pdb     *policyv1.PodDisruptionBudget
	cm      *corev1.ConfigMap
	sm      *monitoringv1.ServiceMonitor
	rule    *monitoringv1.PrometheusRule
	kinds   []string
	objects []runtime.Object
}

func sortObjects(t *testing.T, objs []runtime.Object) rendered {
	t.Helper()
	var r rendered
	seen := map[string]bool{}
	for _, o := range objs {
		kind := reflect.TypeOf(o).Elem().Name()
		if seen[kind] {
			t.Errorf("two objects of kind %s", kind)
		}
		seen[kind] = true
		r.kinds = append(r.kinds, kind)
		switch o := o.(type) {
		case *appsv1.Deployment:
			r.deploy = o
		case *corev1.Service:
			r.svc = o
		case *corev1.ServiceAccount:
			r.sa = o
		case *policyv1.PodDisruptionBudget:
			r.pdb = o
		case *corev1.ConfigMap:
			r.cm = o
		case *monitoringv1.ServiceMonitor:
			r.sm = o
		case *monitoringv1.PrometheusRule:
			r.rule = o
		default:
			t.Errorf("unexpected object %T", o)
		}
	}
	r.objects = objs
	sort.Strings(r.kinds)
	return r
}

func TestChartLint(t *testing.T) {
	for _, c := range chartCases {
		t.Run(c.name, func(t *testing.T) {
			out, errOut, err := helm(t, append([]string{"lint", "--strict", chartDir}, valuesArgs(c)...)...)
			if err != nil {
				t.Fatalf("helm lint --strict: %v\n%s%s", err, out, errOut)
			}
		})
	}
}

// TestChartDecodesStrictly renders the chart with each values file and
// decodes every object with the Kubernetes API types; then checks what the
// relay needs of them.
func TestChartDecodesStrictly(t *testing.T) {
	s := scheme(t)
	envVars := runEnvVars(t)
	for _, c := range chartCases {
		t.Run(c.name, func(t *testing.T) {
			out, err := render(t, c)
			if err != nil {
				t.Fatal(err)
			}
			objs, err := decodeStrict(s, out)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			r := sortObjects(t, objs)
			if !slices.Equal(r.kinds, c.wantKinds) {
				t.Fatalf("rendered kinds %v, want %v", r.kinds, c.wantKinds)
			}
			t.Logf("objects: %s", objectList(objs))
			checkDeployment(t, r.deploy, c, envVars)
			checkService(t, r.svc, r.deploy)
			checkPDB(t, r.pdb, r.deploy)
			if r.sa.AutomountServiceAccountToken == nil || *r.sa.AutomountServiceAccountToken {
				t.Error("ServiceAccount mounts its token; the relay needs no API access")
			}
			checkDashboard(t, r.cm)
			if r.sm != nil {
				checkServiceMonitor(t, r.sm, r.svc)
			}
			if r.rule != nil {
				checkPrometheusRule(t, r.rule, r.svc, c)
			}
			checkNoSecrets(t, out)
		})
	}
}

// objectList names the objects as kind/name, for the log and the report.
func objectList(objs []runtime.Object) string {
	var names []string
	for _, o := range objs {
		m, _ := o.(metav1.Object)
		names = append(names, reflect.TypeOf(o).Elem().Name()+"/"+m.GetName())
	}
	return strings.Join(names, ", ")
}

func container(t *testing.T, d *appsv1.Deployment) *corev1.Container {
	t.Helper()
	for i := range d.Spec.Template.Spec.Containers {
		if c := &d.Spec.Template.Spec.Containers[i]; c.Name == "walrelay" {
			return c
		}
	}
	t.Fatal("no container named walrelay (alerts-kubernetes.yml matches that name)")
	return nil
}

func envOf(c *corev1.Container, name string) (corev1.EnvVar, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e, true
		}
	}
	return corev1.EnvVar{}, false
}

// secretEnv are variables that may only come from a Secret: those that
// hold one (the ones naming where one is, a _FILE, _URL or _COMMAND, may be
// plain).
var secretEnv = regexp.MustCompile(`(PG_URL|PASSWORD|SECRET|TOKEN|PGPASS)$`)

func checkDeployment(t *testing.T, d *appsv1.Deployment, cc chartCase, envVars map[string]bool) {
	t.Helper()
	spec := d.Spec.Template.Spec
	if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
		t.Errorf("replicas %v: want 2 (one streams, one waits as the standby)", d.Spec.Replicas)
	}
	sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
	if err != nil || sel.Empty() || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("Deployment selector %v does not select its pod template's labels %v (%v)", d.Spec.Selector, d.Spec.Template.Labels, err)
	}
	// Only the streaming pod is ever ready: a rolling update that keeps a
	// pod available waits forever for a new pod to become ready.
	ru := d.Spec.Strategy.RollingUpdate
	if d.Spec.Strategy.Type != appsv1.RollingUpdateDeploymentStrategyType || ru == nil || ru.MaxUnavailable == nil {
		t.Errorf("strategy %+v: want RollingUpdate with maxUnavailable", d.Spec.Strategy)
	} else if v, err := intstr.GetScaledValueFromIntOrPercent(ru.MaxUnavailable, int(*d.Spec.Replicas), true); err != nil || v < int(*d.Spec.Replicas) {
		t.Errorf("maxUnavailable %s: the rollout would wait forever for a standby to become ready; want all replicas", ru.MaxUnavailable.String())
	}
	if spec.EnableServiceLinks == nil || *spec.EnableServiceLinks {
		t.Error("enableServiceLinks is not false: a Service named walrelay would put WALRELAY_* variables in the relay's environment")
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("the pod mounts a service account token; the relay never calls the API")
	}

	// The Restricted Pod Security Standard, as the admission plugin checks it.
	eval, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	res := policy.AggregateCheckResults(eval.EvaluatePod(psaapi.LevelVersion{Level: psaapi.LevelRestricted, Version: psaapi.LatestVersion()}, &d.Spec.Template.ObjectMeta, &spec))
	if !res.Allowed {
		t.Errorf("pod violates the restricted Pod Security Standard: %s", res.ForbiddenDetail())
	}

	c := container(t, d)
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("root filesystem is not read-only")
	}
	if !slices.Equal(c.Args, []string{"run"}) {
		t.Errorf("args %v, want [run]", c.Args)
	}
	if len(c.Ports) != 1 || c.Ports[0].Name != "metrics" {
		t.Fatalf("ports %+v: want one named metrics", c.Ports)
	}
	addr, ok := envOf(c, "WALRELAY_METRICS_ADDR")
	if !ok || addr.Value != fmt.Sprintf(":%d", c.Ports[0].ContainerPort) {
		t.Errorf("WALRELAY_METRICS_ADDR %q does not listen on the container port %d", addr.Value, c.Ports[0].ContainerPort)
	}
	for probe, want := range map[*corev1.Probe]string{c.LivenessProbe: "/healthz", c.ReadinessProbe: "/readyz"} {
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != want || probe.HTTPGet.Port.String() != "metrics" {
			t.Errorf("probe %+v: want GET %s on port metrics", probe, want)
		}
	}

	// Kubernetes must not kill a relay that is still confirming.
	st, ok := envOf(c, chartShutdownTimeoutEnv)
	if !ok {
		t.Fatalf("no %s", chartShutdownTimeoutEnv)
	}
	shutdown, err := time.ParseDuration(st.Value)
	if err != nil {
		t.Fatalf("%s %q: %v", chartShutdownTimeoutEnv, st.Value, err)
	}
	if grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second; grace <= shutdown {
		t.Errorf("terminationGracePeriodSeconds %s is not longer than --shutdown-timeout %s", grace, shutdown)
	}

	if del, _ := envOf(c, "WALRELAY_DELIVERY"); del.Value != cc.delivery {
		t.Errorf("WALRELAY_DELIVERY %q, want %q", del.Value, cc.delivery)
	}
	pg, _ := envOf(c, "WALRELAY_PG_URL")
	if pg.ValueFrom == nil || pg.ValueFrom.SecretKeyRef == nil {
		t.Error("WALRELAY_PG_URL does not come from a Secret")
	}
	for _, e := range c.Env {
		if secretEnv.MatchString(e.Name) && (e.Value != "" || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil) {
			t.Errorf("%s is given in plain text; it must come from a Secret (secretKeyRef)", e.Name)
		}
		if strings.HasPrefix(e.Name, "WALRELAY_") && !envVars[e.Name] {
			t.Errorf("%s names no flag of `walrelay run` (kong ignores it)", e.Name)
		}
	}

	// Memory: a limit, a request under it, and GOMEMLIMIT under the limit.
	lim, req := c.Resources.Limits.Memory(), c.Resources.Requests.Memory()
	if lim.IsZero() || req.IsZero() || req.Cmp(*lim) > 0 {
		t.Errorf("memory request %s, limit %s: want both, request <= limit", req, lim)
	}
	if gml, ok := envOf(c, "GOMEMLIMIT"); ok {
		q, err := goMemLimit(gml.Value)
		if err != nil || q.Cmp(*lim) >= 0 {
			t.Errorf("GOMEMLIMIT %q is not under the memory limit %s (%v)", gml.Value, lim, err)
		}
	}

	// Every secret volume is read-only and not world-readable.
	for _, v := range spec.Volumes {
		if v.Secret != nil && (v.Secret.DefaultMode == nil || *v.Secret.DefaultMode&0o007 != 0) {
			t.Errorf("secret volume %s: mode %v, want no access for others", v.Name, v.Secret.DefaultMode)
		}
	}
	for _, m := range c.VolumeMounts {
		if !m.ReadOnly {
			t.Errorf("volume mount %s is writable", m.Name)
		}
	}

	checkRelayAcceptsEnv(t, c)
}

// goMemLimit reads a GOMEMLIMIT value (bytes, or with the runtime's
// suffixes B, KiB, MiB, GiB, TiB) as a quantity.
func goMemLimit(v string) (resource.Quantity, error) {
	v = strings.NewReplacer("KiB", "Ki", "MiB", "Mi", "GiB", "Gi", "TiB", "Ti").Replace(v)
	return resource.ParseQuantity(strings.TrimSuffix(v, "B"))
}

// checkRelayAcceptsEnv starts the real `walrelay run` with the container's
// environment (Secrets replaced by stand-ins, mounted files by files of
// the same kind) and waits for it to log that it starts, which it does only
// once every flag and variable parsed and the configuration checked out;
// a malformed one exits 80 first. It connects nowhere meanwhile that
// answers: the database is a closed port.
func checkRelayAcceptsEnv(t *testing.T, c *corev1.Container) {
	t.Helper()
	dir := t.TempDir()
	certPEM, keyPEM := selfSigned(t)
	var env []string
	for _, e := range c.Env {
		v := e.Value
		switch {
		case e.ValueFrom != nil && e.Name == "WALRELAY_PG_URL":
			v = "postgres://relay@127.0.0.1:1/app?sslmode=disable"
		case e.ValueFrom != nil:
			v = "stand-in"
		case e.Name == "WALRELAY_METRICS_ADDR":
			v = "127.0.0.1:0"
		case strings.HasPrefix(v, "/etc/walrelay/"):
			p := filepath.Join(dir, strings.TrimPrefix(v, "/etc/walrelay/"))
			content := certPEM
			if strings.HasSuffix(e.Name, "_KEY") {
				content = keyPEM
			}
			if e.Name == "PGPASSFILE" {
				content = []byte("127.0.0.1:1:app:relay:stand-in\n")
			}
			if e.Name == "WALRELAY_WEB_CONFIG_FILE" {
				content = []byte("{}\n")
			}
			if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, content, 0o600); err != nil {
				t.Fatal(err)
			}
			v = p
		}
		env = append(env, e.Name+"="+v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, walrelayBinary(t), c.Args...)
	cmd.Env = append(env, "PATH="+os.Getenv("PATH"))
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	var log strings.Builder
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), `"walrelay starting"`) {
			return
		}
	}
	err = cmd.Wait()
	t.Errorf("walrelay run with the chart's environment exited before starting (%v):\n%s", err, log.String())
}

// selfSigned is a throwaway certificate and key in PEM, for the TLS files
// the chart mounts (walrelay parses them at startup).
func selfSigned(t *testing.T) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "stand-in"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

func checkService(t *testing.T, s *corev1.Service, d *appsv1.Deployment) {
	t.Helper()
	if !labels.SelectorFromSet(s.Spec.Selector).Matches(labels.Set(d.Spec.Template.Labels)) || len(s.Spec.Selector) == 0 {
		t.Errorf("Service selector %v does not select the pods %v", s.Spec.Selector, d.Spec.Template.Labels)
	}
	if !s.Spec.PublishNotReadyAddresses {
		t.Error("the Service leaves out not-ready pods: the standbys' metrics would not be scraped")
	}
	if len(s.Spec.Ports) != 1 || s.Spec.Ports[0].TargetPort.String() != "metrics" {
		t.Errorf("Service ports %+v: want one targeting the container port metrics", s.Spec.Ports)
	}
}

func checkPDB(t *testing.T, p *policyv1.PodDisruptionBudget, d *appsv1.Deployment) {
	t.Helper()
	sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
	if err != nil || sel.Empty() || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("PodDisruptionBudget selector %v does not select the pods (%v)", p.Spec.Selector, err)
	}
	if p.Spec.MinAvailable == nil || p.Spec.MinAvailable.IntValue() >= int(*d.Spec.Replicas) {
		t.Errorf("minAvailable %v with %d replicas: a drain could evict no pod", p.Spec.MinAvailable, *d.Spec.Replicas)
	}
	// A standby is never ready, so never "healthy": without AlwaysAllow a
	// drain could not evict it while the active pod lags.
	if p.Spec.UnhealthyPodEvictionPolicy == nil || *p.Spec.UnhealthyPodEvictionPolicy != policyv1.AlwaysAllow {
		t.Errorf("unhealthyPodEvictionPolicy %v, want AlwaysAllow", p.Spec.UnhealthyPodEvictionPolicy)
	}
}

func checkDashboard(t *testing.T, cm *corev1.ConfigMap) {
	t.Helper()
	want, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	if got := cm.Data["walrelay.json"]; got != strings.TrimRight(string(want), "\n") {
		t.Errorf("dashboard ConfigMap differs from %s (%d bytes against %d)", dashboardFile, len(got), len(want))
	}
	if cm.Labels["grafana_dashboard"] == "" {
		t.Error("dashboard ConfigMap lacks the grafana_dashboard label Grafana's sidecar selects")
	}
}

func checkServiceMonitor(t *testing.T, sm *monitoringv1.ServiceMonitor, svc *corev1.Service) {
	t.Helper()
	sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
	if err != nil || sel.Empty() || !sel.Matches(labels.Set(svc.Labels)) {
		t.Errorf("ServiceMonitor selector %v does not select the Service's labels %v", sm.Spec.Selector, svc.Labels)
	}
	if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != svc.Spec.Ports[0].Name {
		t.Errorf("ServiceMonitor endpoints %+v: want the Service's port %s", sm.Spec.Endpoints, svc.Spec.Ports[0].Name)
	}
	if svc.Labels[sm.Spec.JobLabel] == "" {
		t.Errorf("jobLabel %q is not a label of the Service: the job would be the Service's name, not the one the alerts match", sm.Spec.JobLabel)
	}
}

// checkPrometheusRule: the rendered rules are alerts.yml (and
// alerts-kubernetes.yml) with the job matcher set to the job the
// ServiceMonitor gives, and they load in Prometheus' rule parser.
func checkPrometheusRule(t *testing.T, pr *monitoringv1.PrometheusRule, svc *corev1.Service, cc chartCase) {
	t.Helper()
	job := svc.Labels["app.kubernetes.io/name"]
	spec, err := yaml.Marshal(pr.Spec)
	if err != nil {
		t.Fatal(err)
	}
	groups, errs := rulefmt.Parse(spec, false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Errorf("rendered rules: %v", err)
	}
	if groups == nil {
		return
	}
	want := parseRuleFile(t, alertsFile, job)
	if cc.kubernetesRules {
		want = append(want, parseRuleFile(t, kubernetesAlertsFile, job)...)
	}
	if !reflect.DeepEqual(groups.Groups, want) {
		got, _ := yaml.Marshal(groups.Groups)
		exp, _ := yaml.Marshal(want)
		t.Errorf("rendered PrometheusRule differs from the rule files:\n--- rendered\n%s\n--- files\n%s", got, exp)
	}
}

func parseRuleFile(t *testing.T, path, job string) []rulefmt.RuleGroup {
	t.Helper()
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	src = bytes.ReplaceAll(src, []byte(`job="walrelay"`), []byte(fmt.Sprintf("job=%q", job)))
	g, errs := rulefmt.Parse(src, false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	if len(errs) > 0 {
		t.Fatalf("%s: %v", path, errs)
	}
	return g.Groups
}

// checkNoSecrets: nothing that looks like a credential in any object.
var credentialLike = regexp.MustCompile(`(?i)-----BEGIN [A-Z ]*PRIVATE KEY|://[^/\s:@]+:[^/\s@]+@|kind:\s*Secret\b`)

func checkNoSecrets(t *testing.T, out string) {
	t.Helper()
	if m := credentialLike.FindString(out); m != "" {
		t.Errorf("the rendering holds something credential-like: %q", m)
	}
}

// TestKubernetesAlertRules loads alerts-kubernetes.yml like alerts.yml and
// checks it names exactly the exit codes main.go defines as a restart's
// dead ends.
func TestKubernetesAlertRules(t *testing.T) {
	groups, errs := rulefmt.ParseFile(kubernetesAlertsFile, false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Errorf("rulefmt: %v", err)
	}
	if groups == nil {
		t.Fatal("no rule groups parsed")
	}
	codeRe := regexp.MustCompile(`_exitcode\{container="walrelay"\} == (\d+)`)
	var codes []int
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if sev := r.Labels["severity"]; sev != "critical" && sev != "warning" {
				t.Errorf("%s: severity %q", r.Alert, sev)
			}
			for _, a := range []string{"summary", "description"} {
				if strings.TrimSpace(r.Annotations[a]) == "" {
					t.Errorf("%s: missing %s annotation", r.Alert, a)
				}
			}
			for _, m := range codeRe.FindAllStringSubmatch(r.Expr, -1) {
				var n int
				fmt.Sscan(m[1], &n)
				codes = append(codes, n)
			}
		}
	}
	sort.Ints(codes)
	if want := noRestartCodes(t); !slices.Equal(codes, want) {
		t.Errorf("alerts-kubernetes.yml alerts on exit codes %v; main.go's codes a restart cannot fix are %v", codes, want)
	}
}

// TestChartRunFlags: the chart's list of `walrelay run` flags (which
// config keys it accepts) is the binary's.
func TestChartRunFlags(t *testing.T) {
	src, err := os.ReadFile(filepath.Join(chartDir, "templates/_helpers.tpl"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?s)define "walrelay.runFlags" -\}\}\n(.*?)\n\{\{- end`).FindSubmatch(src)
	if m == nil {
		t.Fatal(`no walrelay.runFlags in _helpers.tpl`)
	}
	chart := map[string]bool{}
	for _, f := range strings.Fields(string(m[1])) {
		chart["WALRELAY_"+strings.ToUpper(strings.ReplaceAll(f, "-", "_"))] = true
	}
	bin := runEnvVars(t)
	for v := range bin {
		if !chart[v] {
			t.Errorf("walrelay run reads %s, which walrelay.runFlags in templates/_helpers.tpl lacks: add the flag there", v)
		}
	}
	for v := range chart {
		if !bin[v] {
			t.Errorf("walrelay.runFlags in templates/_helpers.tpl lists %s, which walrelay run no longer reads: remove it", v)
		}
	}
}

// TestChartRefuses: values the chart must refuse at render time (its
// templates, or values.schema.json), with a message naming the value.
func TestChartRefuses(t *testing.T) {
	for _, tc := range []struct{ set, want string }{
		{"config.pg-url=postgres://u:p@h/db", "config.pg-url: set by the chart's own values"},
		{"config.kafka-sasl-password=x", "config.kafka-sasl-password: set by the chart's own values"},
		{"config.schema-registry-password=x", "config.schema-registry-password: set by the chart's own values"},
		{"config.max-inflight-byte=1", "config.max-inflight-byte: not a flag of `walrelay run`"},
		{"postgres.urlSecret.name=", "postgres.urlSecret.name: name the Secret"},
		{"kafka.sasl.mechanism=plain", "kafka.sasl.passwordSecret.name"},
		{"kafka.sasl.mechanism=plain,kafka.sasl.passwordSecret.name=s", "kafka.sasl.user"},
		{"kafka.broker=k:9092", "additional properties 'broker' not allowed"},
		{"slot=Orders", "does not match pattern"},
		{"delivery=exactly-twice", "/delivery"},
		{"serviceMonitor.enabled=true,service.enabled=false", "serviceMonitor.enabled needs service.enabled"},
	} {
		_, err := render(t, chartCases[0], "--set", tc.set)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("--set %s: %v, want an error containing %q", tc.set, err, tc.want)
		}
	}
}

// TestDecodeStrictRejects: the strict decoding above can fail: an unknown
// field, a misspelt one and an unknown kind are errors.
func TestDecodeStrictRejects(t *testing.T) {
	s := scheme(t)
	for name, doc := range map[string]string{
		"unknown field": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replica: 2\n",
		"wrong case":    "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  PublishNotReadyAddresses: true\n",
		"unknown kind":  "apiVersion: v1\nkind: Servce\nmetadata: {name: x}\n",
		"duplicate":     "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\ndata: {c: d}\n",
	} {
		if _, err := decodeStrict(s, doc); err == nil {
			t.Errorf("%s: decoded without error", name)
		}
	}
	if _, err := decodeStrict(s, "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  publishNotReadyAddresses: true\n"); err != nil {
		t.Errorf("a valid Service: %v", err)
	}
}
