"""Records: the Parquet format (schema), writing and reading (io), row digests, float bit
helpers and the environment fingerprint a record carries."""
