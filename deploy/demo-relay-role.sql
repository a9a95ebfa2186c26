-- LOCAL DEMO ONLY (docker-compose.yml): runs once, as the superuser, when
-- the demo database is created, after outbox.sql. The password is a demo
-- value; never reuse it.
--
-- The relay runs as a role of its own with the least it needs, the same
-- as docs/getting-started.md's: LOGIN and REPLICATION, no superuser, no
-- ownership of the outbox; SELECT on it for the initial snapshot, and a
-- schema of its own for its record of what the slot streams from
-- (walrelay.slots). The publication is created here by the table's owner,
-- so the relay never has to create or alter it; the relay creates its
-- replication slot itself (REPLICATION allows that). The relay role needs
-- no "host replication" line in pg_hba.conf: it streams through a database
-- connection (replication=database), which the image's default pg_hba
-- allows. TestDemoRelayRoleStreams runs this file.
CREATE ROLE walrelay WITH LOGIN REPLICATION PASSWORD 'walrelay-demo';
CREATE SCHEMA walrelay AUTHORIZATION walrelay;
GRANT SELECT ON public.outbox TO walrelay;
CREATE PUBLICATION walrelay_outbox FOR TABLE public.outbox
    WITH (publish = 'insert', publish_via_partition_root = true);
