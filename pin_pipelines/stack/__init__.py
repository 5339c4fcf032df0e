"""The local services (PostgreSQL, Kafka, ClickHouse server): installed if missing, started.

Everything lives under the state folder (`PIN_STATE_DIR`, default `<repo>/.pin`); services listen on
loopback only. A service whose address is not loopback is external: it is checked, never managed.
"""
