"""The chunk store: content-addressed KV chunks of a prefix, their integrity, and cleanup."""
