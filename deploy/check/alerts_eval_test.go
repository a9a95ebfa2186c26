package check

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/promqltest"
	"github.com/prometheus/prometheus/rules"
)

// alertRule is the alerting rule name of alerts.yml, ready to evaluate.
func alertRule(t *testing.T, name string) *rules.AlertingRule {
	t.Helper()
	groups, errs := rulefmt.ParseFile(alertsFile, false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	if len(errs) > 0 {
		t.Fatalf("rulefmt: %v", errs)
	}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Alert != name {
				continue
			}
			expr, err := promql.ParseExpr(r.Expr)
			if err != nil {
				t.Fatal(err)
			}
			return rules.NewAlertingRule(r.Alert, expr, time.Duration(r.For), time.Duration(r.KeepFiringFor),
				labels.FromMap(r.Labels), labels.FromMap(r.Annotations), labels.EmptyLabels(), "", false, slog.New(slog.DiscardHandler))
		}
	}
	t.Fatalf("no alert %s in %s", name, alertsFile)
	return nil
}

// firstFiring evaluates the rule every minute from 0 to until over the
// series load loads (promqltest's load syntax, one sample a minute from
// time 0) and returns when it first fired, or -1.
func firstFiring(t *testing.T, rule *rules.AlertingRule, load string, until time.Duration) time.Duration {
	t.Helper()
	storage := promqltest.LoadedStorage(t, "load 1m\n"+load)
	engine := promqltest.NewTestEngine(t, false, 5*time.Minute, promqltest.DefaultMaxSamplesPerQuery)
	query := rules.EngineQueryFunc(engine, storage)
	for at := time.Duration(0); at <= until; at += time.Minute {
		if _, err := rule.Eval(context.Background(), 0, time.Unix(0, 0).Add(at), query, nil, 0); err != nil {
			t.Fatalf("evaluate %s at %s: %v", rule.Name(), at, err)
		}
		for _, a := range rule.ActiveAlerts() {
			if a.State == rules.StateFiring {
				return at
			}
		}
	}
	return -1
}

// TestSlotInvalidationSoonFiresBeforeZero: a stuck slot whose time left
// falls by a minute every minute, from two hours, makes
// WalrelaySlotInvalidationSoon fire while time is left (under an hour, held
// 5 minutes: 55 minutes before invalidation); a slot with a day of WAL,
// and one without max_slot_wal_keep_size (the series absent), never do.
func TestSlotInvalidationSoonFiresBeforeZero(t *testing.T) {
	stuck := `walrelay_slot_time_to_invalidation_seconds{instance="relay-1"} 7200-60x130`
	at := firstFiring(t, alertRule(t, "WalrelaySlotInvalidationSoon"), stuck, 130*time.Minute)
	left := 2*time.Hour - at
	t.Logf("fired at %s, with %s left before invalidation", at, left)
	if at < 0 || left <= 0 {
		t.Errorf("WalrelaySlotInvalidationSoon fired at %s (time left %s): want it firing before the time left reaches zero", at, left)
	}
	if left > time.Hour {
		t.Errorf("WalrelaySlotInvalidationSoon fired with %s left: want under an hour, so that it does not fire for slots with room", left)
	}
	for name, load := range map[string]string{
		"a day of WAL": `walrelay_slot_time_to_invalidation_seconds{instance="relay-1"} 86400+0x130`,
		"no limit":     `walrelay_slot_retained_wal_bytes{instance="relay-1"} 1000+0x130`,
	} {
		if at := firstFiring(t, alertRule(t, "WalrelaySlotInvalidationSoon"), load, 130*time.Minute); at >= 0 {
			t.Errorf("%s: WalrelaySlotInvalidationSoon fired at %s", name, at)
		}
	}
	// walrelay_slot_safe_wal_size_bytes is absent without a limit: were it
	// 0 instead, WalrelaySlotNearInvalidation would page every relay.
	if at := firstFiring(t, alertRule(t, "WalrelaySlotNearInvalidation"), `walrelay_slot_retained_wal_bytes{instance="relay-1"} 1000+0x30`, 30*time.Minute); at >= 0 {
		t.Errorf("WalrelaySlotNearInvalidation fired without the safe_wal_size series at %s", at)
	}
}

// TestSlotHeldByTransactionFires: a transaction open and growing older
// fires WalrelaySlotHeldByTransaction once it is 15 minutes old (after 5
// more); a prepared one does too; none does not.
func TestSlotHeldByTransactionFires(t *testing.T) {
	for name, tc := range map[string]struct {
		load string
		want bool
	}{
		"open":     {`walrelay_source_oldest_xact_age_seconds{instance="relay-1"} 0+60x40`, true},
		"prepared": {`walrelay_source_oldest_prepared_xact_age_seconds{instance="relay-1"} 0+60x40`, true},
		"none":     {`walrelay_source_oldest_xact_age_seconds{instance="relay-1"} 0+0x40`, false},
	} {
		at := firstFiring(t, alertRule(t, "WalrelaySlotHeldByTransaction"), tc.load, 40*time.Minute)
		if (at >= 0) != tc.want {
			t.Errorf("%s: first fired at %s, want firing %v", name, at, tc.want)
		}
		if tc.want && (at < 20*time.Minute || at > 22*time.Minute) {
			t.Errorf("%s: fired at %s, want about 20m (15m old, held 5m)", name, at)
		}
	}
}

// TestDeliveryHeldFires: a dependency holding delivery for 2m fires
// WalrelayDeliveryHeld with the dependency and the reason as labels (what
// its summary names); a hold of a minute, and the 0 every dependency
// exports while it holds nothing, do not fire it.
func TestDeliveryHeldFires(t *testing.T) {
	rule := alertRule(t, "WalrelayDeliveryHeld")
	held := `walrelay_delivery_held{instance="relay-1",dependency="schema_registry",reason="Unreachable"} 1+0x10
walrelay_delivery_held{instance="relay-1",dependency="kafka",reason=""} 0+0x10`
	at := firstFiring(t, rule, held, 10*time.Minute)
	if at < 2*time.Minute || at > 3*time.Minute {
		t.Fatalf("fired at %s, want after 2m held", at)
	}
	var named bool
	for _, a := range rule.ActiveAlerts() {
		if a.State == rules.StateFiring && a.Labels.Get("dependency") == "schema_registry" && a.Labels.Get("reason") == "Unreachable" {
			named = true
		}
		if a.Labels.Get("dependency") == "kafka" {
			t.Errorf("fired for kafka, which held nothing: %v", a.Labels)
		}
	}
	if !named {
		t.Errorf("no firing alert names schema_registry and Unreachable: %v", rule.ActiveAlerts())
	}
	blip := `walrelay_delivery_held{instance="relay-1",dependency="kafka",reason="NotAcknowledging"} 1 0 0 0 0 0`
	if at := firstFiring(t, alertRule(t, "WalrelayDeliveryHeld"), blip, 5*time.Minute); at >= 0 {
		t.Errorf("a one-minute hold fired it at %s", at)
	}
}

// TestStandbyReplayAlertsFire: replay paused for 2m, or behind by more
// than 300s for 5m, fire their alerts; a replay caught up fires neither.
func TestStandbyReplayAlertsFire(t *testing.T) {
	if at := firstFiring(t, alertRule(t, "WalrelayStandbyReplayPaused"), `walrelay_standby_replay_paused{instance="relay-1"} 0 0 1+0x10`, 12*time.Minute); at != 4*time.Minute {
		t.Errorf("WalrelayStandbyReplayPaused fired at %s, want 4m (paused at 2m, held 2m)", at)
	}
	if at := firstFiring(t, alertRule(t, "WalrelayStandbyReplayLagging"), `walrelay_standby_replay_lag_seconds{instance="relay-1"} 0+60x20`, 20*time.Minute); at < 10*time.Minute || at > 12*time.Minute {
		t.Errorf("WalrelayStandbyReplayLagging fired at %s, want about 11m (over 300s at 6m, held 5m)", at)
	}
	for name, load := range map[string]string{
		"paused": `walrelay_standby_replay_paused{instance="relay-1"} 0+0x20`,
		"lag":    `walrelay_standby_replay_lag_seconds{instance="relay-1"} 0+0x20`,
	} {
		rule := "WalrelayStandbyReplayPaused"
		if name == "lag" {
			rule = "WalrelayStandbyReplayLagging"
		}
		if at := firstFiring(t, alertRule(t, rule), load, 20*time.Minute); at >= 0 {
			t.Errorf("%s fired at %s for a replay caught up", rule, at)
		}
	}
}
