"""The target serving: served acceptance (`evaluation`), regenerated answers (`generation`) and their continuous-batching engine (`decoding`)."""
