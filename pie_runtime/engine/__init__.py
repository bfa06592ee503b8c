"""The engine: the only process that touches the device. It owns the models, their paged KV pools and the
working sets built on them, and serves fires from every client in batched steps."""
