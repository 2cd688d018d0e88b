"""The store, the contract between the stages: its schema and root attributes (`schema`), codecs (`codecs`), writer, reader and inspection."""
