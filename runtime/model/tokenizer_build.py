"""Byte-level BPE tokenizer for kvmem's tiny models, trained on the shipped corpus.

The tokenizer is trained with Hugging Face ``tokenizers`` on the text in
``runtime/corpus/*.txt`` (original text shipped with the package: prose,
dialogue, code, JSON, numbers and a little accented Latin, Greek, CJK and
emoji). It uses the ByteLevel pre-tokenizer and decoder (GPT-2 style), so:

* every byte string is encodable (all 256 byte symbols are in the vocabulary),
  and a model can emit a lone UTF-8 continuation byte;
* rare characters (each of ``RARE`` glyphs in the corpus appears once) stay
  split across several byte tokens, which exercises streaming detokenizers.

Ids 0-2 are the special tokens ``<|endoftext|>``, ``<|im_start|>`` and
``<|im_end|>``; the last two ids are the ordinary added tokens ``<tool_call>``
and ``</tool_call>`` (as in Qwen2.5), which also makes mlx-lm pick its
``json_tools`` tool parser for the chat template below. Training is
deterministic (same corpus and size give a byte-identical ``tokenizer.json``).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "corpus_digest",
    "corpus_texts",
    "train_tokenizer",
    "write_tokenizer_files",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML with optional system turn, Hermes/Qwen-style tools, verbatim content.
# ``content`` may be a string or a list of OpenAI-style parts ({"type": "text"}).
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}{{- part -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- render(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are "
    "inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object inside "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{\"name\": <function-name>, \"arguments\": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- set loop_messages = messages[1:] if has_system else messages -%}"
    "{%- else -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.content -%}{{- render(message.content) + '\\n' -}}{%- endif -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- if tool_call.function is defined -%}"
    "{%- set tool_call = tool_call.function -%}"
    "{%- endif -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (tool_call.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}"
    "{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + render(message.content)"
    " + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _corpus_files() -> list[Path]:
    root = Path(str(resources.files("runtime") / "corpus"))
    return sorted(root.glob("*.txt"))


@lru_cache(maxsize=1)
def corpus_texts() -> tuple[str, ...]:
    """The shipped training texts, one per file, in file-name order."""
    return tuple(p.read_text(encoding="utf-8") for p in _corpus_files())


@lru_cache(maxsize=1)
def corpus_digest() -> str:
    """SHA-256 over the corpus (names and contents): part of every recipe hash."""
    h = hashlib.sha256()
    for path, text in zip(_corpus_files(), corpus_texts(), strict=True):
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()


@lru_cache(maxsize=8)
def _trained_json(vocab_size: int) -> str:
    n_added = len(TOOL_TOKENS)
    if vocab_size < 256 + len(SPECIAL_TOKENS) + n_added:
        raise ValueError(f"vocab_size {vocab_size} cannot hold the 256 byte symbols")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = corpus_texts()
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok.to_str(pretty=True)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train (or reuse) the byte-level BPE tokenizer with at most ``vocab_size`` tokens.

    Training runs once per size per process (cached); each call returns a fresh
    ``Tokenizer`` so callers may mutate it. The result can be smaller than
    ``vocab_size`` when the corpus supports fewer merges (about 3.6K here).

    Args:
        vocab_size: Target size, special and added tokens included.

    Returns:
        A deterministic ``tokenizers.Tokenizer``.
    """
    return Tokenizer.from_str(_trained_json(vocab_size))


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for token in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        token_id = tok.token_to_id(token)
        assert token_id is not None
        out[str(token_id)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
    return out


def write_tokenizer_files(tok: Tokenizer, dest: Path, *, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The folder loads with ``transformers.AutoTokenizer`` as a
    ``PreTrainedTokenizerFast`` and hence with ``mlx_lm.load``.
    """
    (dest / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens_decoder(tok),
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]],
    }
    for name, obj in (
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", special_map),
    ):
        text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
        (dest / name).write_text(text, encoding="utf-8")
