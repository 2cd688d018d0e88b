"""The failures a user can act on: a bad config, a store or checkpoint that does not fit, a bad
row, a corrupt shard, non-finite numbers. The CLI prints their message as one `Error: ...`
line and exits 1 (`dflash --debug ...` or DFLASH_DEBUG=1 shows the traceback); anything else is
a bug and keeps its traceback."""


class DflashError(Exception):
    """Base of the expected failures; subclasses also derive from the builtin they refine."""
