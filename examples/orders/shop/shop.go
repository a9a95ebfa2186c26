// Package shop is the example's order service and its ledger consumer:
// the code a service writes on each side of walrelay.
//
// Writer side: every state change of an order and its event commit in one
// transaction (outbox.Writer). Consumer side: the ledger applies each
// event once (inbox.Consumer); its handler is deliberately naive (it
// appends a row per event, no checks), so that any duplicate or
// out-of-order delivery the inbox let through would show in the ledger.
package shop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/walrelay/walrelay/inbox"
	"github.com/walrelay/walrelay/outbox"
)

// Outbox is the outbox table the service writes (walrelay's default).
var Outbox = outbox.Table{}

// InboxTable is the ledger consumer's inbox table.
const InboxTable = "inbox"

// Schema creates the service's tables, the outbox and the inbox.
func Schema() string {
	return `CREATE TABLE IF NOT EXISTS orders (
    id          bigserial PRIMARY KEY,
    customer    text   NOT NULL,
    total_cents bigint NOT NULL,
    status      text   NOT NULL,
    version     int    NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    seq         bigserial PRIMARY KEY,
    order_id    bigint NOT NULL,
    version     int    NOT NULL,
    event_type  text   NOT NULL,
    amount_cents bigint NOT NULL,
    event_id    text   NOT NULL
);
` + strings.Replace(Outbox.DDL(), "CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1) + "\n" + inbox.DDL(InboxTable)
}

// Event is the payload of every order event.
type Event struct {
	OrderID    int64  `json:"order_id"`
	Version    int    `json:"version"`
	Type       string `json:"type"`
	TotalCents int64  `json:"total_cents"`
}

// Service writes orders.
type Service struct {
	DB     *pgxpool.Pool
	Outbox *outbox.Writer
	// Tracer makes a span per business transaction (default: the
	// program's global provider's). The outbox row carries its trace
	// context, so walrelay's span and the ledger's follow it in one trace.
	Tracer trace.Tracer
}

// tracer is the Service's Tracer, or the global provider's.
func (s *Service) tracer() trace.Tracer {
	if s.Tracer != nil {
		return s.Tracer
	}
	return otel.Tracer("github.com/walrelay/walrelay/examples/orders/shop")
}

// traced runs f in a span named name: the business transaction.
func (s *Service) traced(ctx context.Context, name string, f func(ctx context.Context) error) error {
	ctx, span := s.tracer().Start(ctx, name)
	defer span.End()
	err := f(ctx)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	return err
}

// NewService returns a Service writing to the default outbox table.
func NewService(db *pgxpool.Pool) *Service {
	w, err := outbox.NewWriter(Outbox, outbox.Options{})
	if err != nil {
		panic(err) // the table definition above is fixed and valid
	}
	return &Service{DB: db, Outbox: w}
}

// Place creates an order (version 1) and its OrderPlaced event in one
// transaction and returns its id.
func (s *Service) Place(ctx context.Context, customer string, totalCents int64) (int64, error) {
	var id int64
	err := s.traced(ctx, "place order", func(ctx context.Context) error {
		return pgx.BeginFunc(ctx, s.DB, func(tx pgx.Tx) error {
			if err := tx.QueryRow(ctx, `INSERT INTO orders (customer, total_cents, status, version) VALUES ($1, $2, 'placed', 1) RETURNING id`,
				customer, totalCents).Scan(&id); err != nil {
				return err
			}
			return s.emit(ctx, tx, Event{OrderID: id, Version: 1, Type: "OrderPlaced", TotalCents: totalCents})
		})
	})
	return id, err
}

// ErrFinal is Advance's error for an order that is shipped already.
var ErrFinal = errors.New("nothing comes after")

// Advance moves an order to its next status (placed, paid, shipped) and
// writes the event, in one transaction; it returns the new version.
func (s *Service) Advance(ctx context.Context, id int64) (int, error) {
	var ev Event
	err := s.traced(ctx, "advance order", func(ctx context.Context) error {
		return pgx.BeginFunc(ctx, s.DB, func(tx pgx.Tx) error {
			var status string
			if err := tx.QueryRow(ctx, `SELECT status, version, total_cents FROM orders WHERE id = $1 FOR UPDATE`, id).Scan(&status, &ev.Version, &ev.TotalCents); err != nil {
				return err
			}
			next := map[string]string{"placed": "paid", "paid": "shipped"}[status]
			if next == "" {
				return fmt.Errorf("order %d is %s: %w", id, status, ErrFinal)
			}
			ev.OrderID, ev.Version, ev.Type = id, ev.Version+1, map[string]string{"paid": "OrderPaid", "shipped": "OrderShipped"}[next]
			if _, err := tx.Exec(ctx, `UPDATE orders SET status = $2, version = $3 WHERE id = $1`, id, next, ev.Version); err != nil {
				return err
			}
			return s.emit(ctx, tx, ev)
		})
	})
	return ev.Version, err
}

func (s *Service) emit(ctx context.Context, tx pgx.Tx, ev Event) error {
	payload, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	_, err = s.Outbox.Write(ctx, tx, outbox.Event{
		AggregateType: "order", AggregateID: strconv.FormatInt(ev.OrderID, 10), Type: ev.Type, Payload: payload,
	})
	return err
}

// ApplyToLedger is the ledger consumer's inbox.Handler: one ledger row per
// event, in the inbox's transaction. The amount is the order total on
// payment, zero otherwise.
func ApplyToLedger(ctx context.Context, tx pgx.Tx, m *inbox.Message) error {
	var ev Event
	if err := json.Unmarshal(m.Record.Value, &ev); err != nil {
		return fmt.Errorf("not an order event: %w", err)
	}
	var amount int64
	if ev.Type == "OrderPaid" {
		amount = ev.TotalCents
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger (order_id, version, event_type, amount_cents, event_id) VALUES ($1, $2, $3, $4, $5)`,
		ev.OrderID, ev.Version, ev.Type, amount, m.ID)
	return err
}

// Check compares the ledger with the orders: exactly one ledger row per
// order event (versions 1 to the order's version), applied per order in
// version order. It returns the number of ledger rows and a description
// of every difference (none when they agree).
func Check(ctx context.Context, db *pgxpool.Pool) (rows int, problems []string, err error) {
	want := map[int64]int{}
	r, err := db.Query(ctx, `SELECT id, version FROM orders`)
	if err != nil {
		return 0, nil, err
	}
	for r.Next() {
		var id int64
		var v int
		if err := r.Scan(&id, &v); err != nil {
			return 0, nil, err
		}
		want[id] = v
	}
	if err := r.Err(); err != nil {
		return 0, nil, err
	}
	got := map[int64][]int{}
	r, err = db.Query(ctx, `SELECT order_id, version FROM ledger ORDER BY seq`)
	if err != nil {
		return 0, nil, err
	}
	for r.Next() {
		var id int64
		var v int
		if err := r.Scan(&id, &v); err != nil {
			return 0, nil, err
		}
		got[id] = append(got[id], v)
		rows++
	}
	if err := r.Err(); err != nil {
		return 0, nil, err
	}
	for id, v := range want {
		g := got[id]
		ok := len(g) == v
		for i := 0; ok && i < v; i++ {
			ok = g[i] == i+1
		}
		if !ok {
			problems = append(problems, fmt.Sprintf("order %d at version %d: ledger applied versions %v", id, v, g))
		}
	}
	for id, g := range got {
		if _, ok := want[id]; !ok {
			problems = append(problems, fmt.Sprintf("ledger has versions %v of order %d, which does not exist", g, id))
		}
	}
	return rows, problems, nil
}
