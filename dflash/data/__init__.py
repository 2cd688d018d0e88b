"""Chat data: rows of a source (`chat`), tokenized samples (`samples`), the Qwen tokenizer and chat template (`tokenizer`), the embedded offline rows (`embedded`)."""
