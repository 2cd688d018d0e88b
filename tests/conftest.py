"""Test set-up: CPU-only runs must not route Qwen3.5 linear attention to fla's Triton kernels.

When CUDA is absent, make `fla` unimportable before transformers is imported, so
transformers uses its pure-torch Gated DeltaNet path (docs/ENVIRONMENT.md).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    sys.modules["fla"] = None  # importing fla now raises ImportError

# Under pytest-xdist the workers share the cores: each takes its share of threads (in-process tensors and, through
# OMP_NUM_THREADS, the subprocesses it starts), instead of every one using all the cores and most of the time
# going to threads waiting on each other (2 workers on 2 cores: 1 thread each, and the suite runs faster).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

# The longest files (each half a minute or more on 2 cores), longest first: the README's command hands whole
# files to two workers in collection order (--dist loadfile --no-loadscope-reorder), so a long file collected
# last would run alone at the end while the other worker idles.
SLOW_FILES_FIRST = ("test_recipe.py", "test_extract_e2e.py", "test_train_e2e.py", "test_generate.py", "test_labels.py",
                    "test_eval.py", "test_follow.py", "test_soft_targets.py", "test_sampling.py", "test_mix.py",
                    "test_tools_smoke.py", "test_decoding.py", "test_codec_training.py", "test_embedded.py")


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES_FIRST)))  # stable: the rest in file order


@pytest.fixture(scope="session")
def tokenizer_cache_dir() -> Path:
    """Where tests cache the generated 33 MB tokenizer across sessions: $DFLASH_TEST_CACHE or ~/.cache/dflash-test."""
    return Path(os.environ.get("DFLASH_TEST_CACHE", Path.home() / ".cache" / "dflash-test")) / "tokenizer"


@pytest.fixture(scope="session")
def qwen_tokenizer(tokenizer_cache_dir):
    """The real Qwen3.5/3.6 tokenizer with our ChatML template, built once and cached across sessions."""
    from dflash.data.tokenizer import build_qwen_tokenizer

    return build_qwen_tokenizer(tokenizer_cache_dir)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tokenizer_cache_dir):
    """A tiny random Qwen3.5 checkpoint with our tokenizer (dflash.extract.tiny_target.build_tiny_target), once per session."""
    from dflash.extract.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-target") / "target", tokenizer_cache_dir)


@pytest.fixture(scope="session")
def embedded_cache_dir(tmp_path_factory, tokenizer_cache_dir) -> Path:
    """A `data.cache_dir` whose embedded tiny target (`target-tiny`) is built once per session."""
    from dflash.extract.tiny_target import build_tiny_target

    cache_dir = tmp_path_factory.mktemp("embedded-cache")
    build_tiny_target(cache_dir / "target-tiny", tokenizer_cache_dir)
    return cache_dir


@pytest.fixture(scope="session")
def pipeline_config(embedded_cache_dir):
    """Write `rows.jsonl` (some embedded code-chat rows) and a tiny-target `config.toml` in a
    folder; `extra_toml` adds the sections a test needs. Returns the config path."""
    import json

    from dflash.data.embedded import code_chat_rows

    def write(root: Path, first_rows: int, last_rows: int, extra_toml: str) -> Path:
        rows = code_chat_rows()
        picked = rows[:first_rows] + rows[-last_rows:]  # HumanEval problems and stdlib modules
        data_path = root / "rows.jsonl"
        data_path.write_text("".join(json.dumps(row) + "\n" for row in picked))
        config_path = root / "config.toml"
        config_path.write_text(f"""
[target]
path = "embedded:tiny"
num_layer_ids = 3
[data]
source = "{data_path}"
max_length = 512
num_workers = 1
cache_dir = "{embedded_cache_dir}"
{extra_toml}""")
        return config_path

    return write
