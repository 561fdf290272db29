"""The index-addressed loader, its read-ahead and worker start, per-step batches and tokenizer records."""
