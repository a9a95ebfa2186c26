package refdoc

import (
	"fmt"
	"reflect"
	"sort"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Metric is one metric family as a scrape sees it.
type Metric struct {
	Name    string
	Type    string // counter, gauge, histogram, …
	Labels  []string
	Help    string
	Buckets []float64 // a histogram's upper bounds, +Inf left out
}

// recorder is a Registerer that counts the descriptors of what is
// registered on it, so that a family left out of a scrape is noticed.
type recorder struct {
	prometheus.Registerer
	descs []string
}

func (r *recorder) Register(c prometheus.Collector) error {
	if err := r.Registerer.Register(c); err != nil {
		return err
	}
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		r.descs = append(r.descs, d.String())
	}
	return nil
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// Metrics returns every metric build registers, sorted by name. build
// registers its metrics on the registerer it is given and returns the
// struct that holds them; each of its fields that is a vector gets one
// series (labels are only seen on a series) and each settable gauge a
// value (an optional gauge is exported only once set), so that every
// family registered shows in the scrape. A family that still does not is
// an error.
func Metrics(build func(prometheus.Registerer) any) ([]Metric, error) {
	reg := prometheus.NewPedanticRegistry()
	rec := &recorder{Registerer: reg}
	held := reflect.ValueOf(build(rec))
	for held.Kind() == reflect.Pointer {
		held = held.Elem()
	}
	if held.Kind() != reflect.Struct {
		return nil, fmt.Errorf("build returned %s, want a struct of metrics", held.Type())
	}
	for i := range held.NumField() {
		if !held.Type().Field(i).IsExported() {
			continue
		}
		touch(held.Field(i))
	}
	families, err := reg.Gather()
	if err != nil {
		return nil, err
	}
	if len(families) != len(rec.descs) {
		var names []string
		for _, mf := range families {
			names = append(names, mf.GetName())
		}
		return nil, fmt.Errorf("%d metrics registered, %d in the scrape (%s): a field that holds a metric needs a series or a value before it shows", len(rec.descs), len(families), strings.Join(names, ", "))
	}
	var out []Metric
	for _, mf := range families {
		m := Metric{Name: mf.GetName(), Type: strings.ToLower(mf.GetType().String()), Help: mf.GetHelp()}
		if len(mf.Metric) > 0 {
			for _, l := range mf.Metric[0].Label {
				m.Labels = append(m.Labels, l.GetName())
			}
			if h := mf.Metric[0].Histogram; h != nil {
				m.Buckets = buckets(h)
			}
		}
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func buckets(h *dto.Histogram) []float64 {
	var bs []float64
	for _, b := range h.Bucket {
		bs = append(bs, b.GetUpperBound())
	}
	return bs
}

// touch gives v, a field holding a metric, what makes it show in a scrape:
// a vector one series (GetMetricWithLabelValues with as many values as it
// has labels: it refuses any other number), a gauge a value.
func touch(v reflect.Value) {
	if v.Kind() == reflect.Pointer && v.IsNil() {
		return
	}
	if get := v.MethodByName("GetMetricWithLabelValues"); get.IsValid() {
		for n := 1; n <= 10; n++ {
			args := make([]reflect.Value, n)
			for i := range args {
				args[i] = reflect.ValueOf("x")
			}
			if res := get.Call(args); res[1].IsNil() {
				return
			}
		}
		return
	}
	if set := v.MethodByName("Set"); set.IsValid() && set.Type().NumIn() == 1 && set.Type().In(0).Kind() == reflect.Float64 {
		set.Call([]reflect.Value{reflect.ValueOf(1.0)})
	}
}
