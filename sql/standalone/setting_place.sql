-- outbox_dispatch without the library: where each setting belongs. Its own
-- file, run by an install and again by an update from an earlier release
-- (sidecar/src/script.rs, UPDATES), since a release's settings may change.
SET LOCAL search_path = pg_catalog, pg_temp;

-- Where setting name belongs without the library: 'database' (this
-- table), 'sidecar' (its own configuration: a secret, or a path on its
-- host), 'library' (the launcher's, with nothing to say here), 'session'
-- (each session's own SET), 'internal' (the rotation's); NULL for a name
-- the library does not have. Every outbox.* setting of src/config.rs is
-- one of these (tests/test_standalone.py checks them against the
-- library's).
CREATE OR REPLACE FUNCTION outbox.setting_place(name text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT CASE
    WHEN name = ANY (ARRAY['outbox.broker_url', 'outbox.redis_url', 'outbox.broker_password_file',
                           'outbox.redis_password_file', 'outbox.redis_sentinel_password_file',
                           'outbox.broker_tls_ca_file', 'outbox.redis_tls_ca_file', 'outbox.broker_tls_cert_file',
                           'outbox.broker_tls_key_file', 'outbox.kafka_sasl_plain_cleartext']) THEN 'sidecar'
    WHEN name = ANY (ARRAY['outbox.workers', 'outbox.database']) THEN 'library'
    WHEN name = ANY (ARRAY['outbox.default_queue', 'outbox.notify', 'outbox.notify_channel']) THEN 'session'
    WHEN name = 'outbox.moving' THEN 'internal'
    WHEN name = ANY (ARRAY['outbox.enabled', 'outbox.redis_sentinel_master', 'outbox.redis_wait_replicas',
                           'outbox.redis_key_prefix', 'outbox.priority_steps', 'outbox.priority_separator',
                           'outbox.batch_size', 'outbox.max_batch_bytes', 'outbox.poll_interval',
                           'outbox.linger', 'outbox.max_retries', 'outbox.retry_backoff',
                           'outbox.reconnect_delay_min', 'outbox.reconnect_delay_max', 'outbox.broker_timeout',
                           'outbox.processing_timeout', 'outbox.ack_timeout', 'outbox.max_redeliveries',
                           'outbox.statement_timeout', 'outbox.sweep_interval', 'outbox.retention',
                           'outbox.lifecycle_interval', 'outbox.heartbeat_interval', 'outbox.report_key',
                           'outbox.report_timeout', 'outbox.max_payload_bytes', 'outbox.inbox_retention',
                           'outbox.amqp_queue_type', 'outbox.amqp_max_priority', 'outbox.key_on_failure',
                           'outbox.kafka_topic', 'outbox.kafka_tombstones', 'outbox.kafka_sasl_mechanism',
                           'outbox.kafka_request_timeout', 'outbox.kafka_compression',
                           'outbox.kafka_key_format', 'outbox.redis_timeout'])
        THEN 'database'
END
$$;
