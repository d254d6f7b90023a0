"""Request traces: the format, references (infinite cache, Belady), synthetic shapes, and replay through the store."""
