-- The outbox table walrelay expects by default (see docs/outbox-table.md).
-- Services insert a row in the same transaction as the business change and
-- may delete it again in that transaction: the INSERT is already in the WAL.
CREATE TABLE "public"."outbox" (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    type           text        NOT NULL,
    payload        jsonb,
    created_at     timestamptz NOT NULL DEFAULT now(),
    traceparent    text,
    tracestate     text
);

-- Advice: refuse rows whose payload Kafka could never take, at the source,
-- where the writer sees the error. walrelay dead-letters such rows (without
-- their payload) anyway, but a CHECK keeps them out of the WAL. Keep the
-- bound under walrelay's --max-record-bytes (default 1000012) less the
-- headers. octet_length counts bytes: for jsonb measure its text form
-- (what walrelay sends), for json or text the value itself, for bytea the
-- raw bytes (octet_length(payload)).
ALTER TABLE "public"."outbox"
    ADD CONSTRAINT outbox_payload_size CHECK (octet_length(payload::text) <= 1000000);
