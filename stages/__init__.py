"""One module per pipeline stage, each exposing `run(config) -> result`."""
