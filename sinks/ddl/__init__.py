"""The audit schema: numbered migrations NNN_name.sql, package data applied by sinks.audit (docs/audit.md)."""
