"""Facts of the DFlash recipe for the Qwen3.5/3.6 targets that several modules default to,
each defined here once (docs/ARCHITECTURE.md): the block size, the mask token and the vocabulary.
"""

BLOCK_SIZE = 16  # tokens per block: the anchor and 15 drafted slots
# The Qwen3.5/3.6 tokenizer's DFlash mask token: `<|audio_start|>`, a special token that never
# occurs in text chats.
MASK_TOKEN_ID = 248070
VOCAB_SIZE = 248320  # Qwen3.5/3.6 embedding rows (padded past the tokenizer's ids)
