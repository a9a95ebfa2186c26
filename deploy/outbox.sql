-- The outbox table walrelay expects by default (see README, "The outbox table").
-- Services insert a row in the same transaction as the business change and
-- may delete it again in that transaction: the INSERT is already in the WAL.
CREATE TABLE "public"."outbox" (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    type           text        NOT NULL,
    payload        jsonb,
    created_at     timestamptz NOT NULL DEFAULT now()
);
