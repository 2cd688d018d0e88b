"""The store, the contract between the stages: its schema and root attributes (`schema`), the plan of buckets and shards (`plan`), codecs (`codecs`), writer, reader and inspection."""
