"""One router per resource: blocks, prefixes, lookup, and operations (stats, metrics, health)."""
