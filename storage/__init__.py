"""Everything persisted by a run, addressed by fsspec URLs (local path, file://, s3://)."""
