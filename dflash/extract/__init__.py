"""Stage one's library: the target (`target`, `tiny_target`, `gguf`), the capture of layer outputs (`capture`) and the shard writers (`writers`)."""
