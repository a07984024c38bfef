"""The tokenizer layer: transformers' AutoTokenizer (HF directory or GGUF file), chat templates,
an incremental detokenizer for streaming, and stop strings.

No JAX here. The heavy lifting (BPE, byte fallback, chat templates in Jinja) is transformers' and
tokenizers'; this module adds what the engine needs on top: a small stable surface, streaming text
that never splits a UTF-8 character, and stop strings that may span token boundaries.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from jaxinfer import disk_cache

logger = logging.getLogger(__name__)

# Tokens of the prompt's tail decoded with the first output tokens, so that a first output token
# that merges with what precedes it (a leading space, a byte-fallback sequence) decodes right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class Tokenizer:
    """A thin wrapper over a transformers tokenizer (`hf_tokenizer` is the escape hatch)."""

    def __init__(self, hf_tokenizer, *, eos_token_ids: Sequence[int] = ()):
        self.hf_tokenizer = hf_tokenizer
        ids = [] if hf_tokenizer.eos_token_id is None else [int(hf_tokenizer.eos_token_id)]
        ids += [int(i) for i in eos_token_ids if int(i) not in ids]
        self.eos_token_ids: tuple[int, ...] = tuple(ids)

    @classmethod
    def from_source(cls, path: str | os.PathLike, gguf_file: str | None = None) -> "Tokenizer":
        """An HF directory (tokenizer.json / tokenizer_config.json ...), a `.gguf` file path, or a
        folder plus `gguf_file` (the name of the .gguf inside it). A hub name already in the local
        cache also works. EOS ids are the tokenizer's own plus generation_config.json's, if any."""
        path = os.fspath(path)
        if gguf_file is None and path.endswith(".gguf") and os.path.isfile(path):
            path, gguf_file = os.path.split(os.path.abspath(path))
        if gguf_file is not None and not os.path.isfile(os.path.join(path, gguf_file)):
            raise ValueError(f"gguf_file={gguf_file!r} is not a file in {path=}")
        if gguf_file is not None:
            return cls(_gguf_tokenizer(os.path.join(path, gguf_file)))
        try:
            hf_tokenizer = _auto_tokenizer().from_pretrained(path)
        except OSError as e:
            raise ValueError(
                f"cannot load a tokenizer from {path=}: expected an HF directory with tokenizer "
                f"files or a .gguf file ({e})") from None
        return cls(hf_tokenizer, eos_token_ids=_generation_config_eos(path))

    # -- properties -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included). The model's embedding
        may be larger (padded); never smaller."""
        return len(self.hf_tokenizer)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf_tokenizer.pad_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf_tokenizer.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf_tokenizer.chat_template)

    # -- text <-> ids -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """With `add_special_tokens`, the model's own convention applies (BOS only if it adds one;
        SmolLM2 does not)."""
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat_prompt(self, text: str) -> list[int]:
        """Ids of an already rendered chat prompt: the template wrote any BOS itself."""
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary entries (e.g. 'Ġworld'), not text; for debugging and token-level APIs."""
        return self.hf_tokenizer.convert_ids_to_tokens(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprobs `bytes`): its text's UTF-8, except for
        a token that holds part of a character, whose text alone decodes to U+FFFD: then a
        byte-fallback piece's byte ('<0xF0>', SentencePiece) or a byte-level BPE piece's bytes
        (GPT-2's byte alphabet), so that the tokens' bytes add up to the text's."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.convert_ids_to_tokens([token_id])[0]
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        byte_of = _byte_level_decoder()
        if piece and all(ch in byte_of for ch in piece):
            return bytes(byte_of[ch] for ch in piece)
        return text.encode()

    # -- chat -------------------------------------------------------------------------------------
    def render_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                             **template_kwargs) -> str:
        """The prompt text the model's chat template makes of `messages` (OpenAI-style dicts).
        `template_kwargs` go to the template (tools=..., continue_final_message=..., ...)."""
        self._require_chat_template()
        return self.hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """Token ids of the rendered chat prompt (special tokens in the template, no extra BOS)."""
        return self.encode_chat_prompt(
            self.render_chat_template(messages, add_generation_prompt, **template_kwargs))

    def _require_chat_template(self) -> None:
        if not self.has_chat_template:
            name = getattr(self.hf_tokenizer, "name_or_path", "") or "this tokenizer"
            raise ValueError(f"{name!r} has no chat template: send a plain prompt (completions) "
                             "or use a model with a chat template")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (transformers' own table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def _auto_tokenizer():
    from transformers import AutoTokenizer  # heavy (imports torch when installed): only when needed

    return AutoTokenizer


# -- GGUF tokenizers, through a disk cache ---------------------------------------------------------
# transformers converts a GGUF file's vocabulary and merges into a fast tokenizer on every load
# (seconds: the `gguf` reader parses ~100k strings one at a time). The converted tokenizer is
# saved once (`save_pretrained`) and loaded from there afterwards, keyed by the file's identity,
# this module's code and the versions of the packages that convert (transformers, tokenizers, and
# gguf, whose reader feeds the conversion without torch) (jaxinfer/disk_cache.py).
_TOKENIZER_CACHE_KIND = "tokenizers"
_TOKENIZER_CACHE_FORMAT = 1
_MIN_CACHED_GGUF_BYTES = 16 * 2**20  # smaller files (tests' tiny models) load fast anyway
_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_TOKENIZER_CACHE_PACKAGES = ("transformers", "tokenizers", "gguf")


def _gguf_tokenizer(gguf_path: str):
    folder, name = os.path.split(gguf_path)
    if not disk_cache.cache_enabled() or os.path.getsize(gguf_path) < _MIN_CACHED_GGUF_BYTES:
        return _load_gguf_tokenizer(folder, name)
    key = {"format": _TOKENIZER_CACHE_FORMAT, "source": disk_cache.file_identity(gguf_path),
           "code": disk_cache.code_version([__file__], _TOKENIZER_CACHE_PACKAGES)}
    slot = disk_cache.CacheSlot(_TOKENIZER_CACHE_KIND, os.path.realpath(gguf_path), key)
    entry = slot.lookup()
    if entry is not None:
        try:
            return _load_saved_tokenizer(str(entry))
        except Exception as e:  # noqa: BLE001 - a damaged entry: rebuild it
            logger.warning("tokenizer cache entry %s is unreadable (%s: %s); rebuilding it",
                           entry, type(e).__name__, e)
            slot.discard()
    hf_tokenizer = _load_gguf_tokenizer(folder, name)
    try:
        slot.publish(lambda tmp: hf_tokenizer.save_pretrained(str(tmp)))
    except OSError as e:
        logger.warning("cannot write the tokenizer cache %s: %s", slot.entry, e)
    return hf_tokenizer


def _load_gguf_tokenizer(folder: str, name: str):
    try:
        return _auto_tokenizer().from_pretrained(folder, gguf_file=name)
    except OSError as e:
        raise ValueError(f"cannot load a tokenizer from the GGUF file {name!r} in {folder!r} "
                         f"({e})") from None
    except ImportError as e:  # transformers' GGUF metadata reader imports torch (not ours to need)
        if "torch" not in str(e) and "torch" not in str(e.__cause__):
            raise
        logger.info("transformers' GGUF reader needs torch; reading the metadata with gguf")
        return gguf_tokenizer_without_torch(os.path.join(folder, name))


def gguf_tokenizer_without_torch(gguf_path: str):
    """transformers' GGUF tokenizer conversion, fed from the `gguf` package's reader instead of
    transformers' own (whose module imports torch, a dependency the server must not have). Mirrors
    `transformers.integrations.gguf.gguf_tokenizer_mapping.get_gguf_tokenizer`, whose conversion
    tables it reuses; tests check it equals the transformers path."""
    import gguf
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    reader = gguf.GGUFReader(gguf_path)
    full_arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")

    def value(key: str):
        field = reader.fields[key]
        if (field.types[:2] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
                and key not in full_arrays):
            return len(field.data)  # as transformers' reader: other string arrays as a count
        return field.contents()

    metadata = {k: value(k) for k in reader.fields if k.startswith(("tokenizer.", "general.arch"))}
    architecture = metadata["general.architecture"]
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    for special, key in mapping._SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[special] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = mapping.convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _load_saved_tokenizer(directory: str):
    """A tokenizer we saved: its fast class directly when it is the generic one (that skips
    AutoTokenizer's import of torch), else through AutoTokenizer."""
    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        tokenizer_class = json.load(f).get("tokenizer_class")
    if tokenizer_class in _FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    return _auto_tokenizer().from_pretrained(directory)


def _generation_config_eos(path: str) -> list[int]:
    cfg = os.path.join(path, "generation_config.json")
    if not os.path.isfile(cfg):
        return []
    try:
        with open(cfg) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return []
    if eos is None:
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


class IncrementalDetokenizer:
    """Streams the text of a request's output tokens, a delta at a time.

    Decodes only a short window of recent tokens (vLLM's prefix/read offsets): `prefix` is the
    window start, `read` the end of what is already emitted. A delta is `decode(ids[prefix:])`
    minus `decode(ids[prefix:read])`. While the window's text ends with U+FFFD (a UTF-8 character
    split across tokens), nothing is emitted and the offsets stay: the next token completes it.
    Tokens before the window are dropped, so memory stays constant. The concatenated deltas (plus
    `flush()`) equal `tokenizer.decode(output_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = [int(i) for i in list(prompt_ids)[-_PROMPT_CONTEXT_TOKENS:]]
        self._prefix_offset = 0  # window start in self._ids
        self._read_offset = len(self._ids)  # tokens before this are emitted
        self.num_tokens_seen = 0  # output tokens given to add()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append output tokens; returns the newly complete text ('' while a character is split)."""
        self._ids.extend(int(i) for i in new_ids)
        self.num_tokens_seen += len(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is held back (an incomplete character decodes to
        U+FFFD, as in a full decode)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or a character still split: wait for the next token
        delta = new_text[len(prefix_text):]
        # The new window starts at the first unread token; drop what is before it.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return delta


def check_stop(text: str, stop_strings: Sequence[str], *, include: bool = False,
               num_new_chars: int | None = None) -> tuple[str, str | None]:
    """Find the first stop string in `text`: `(text cut before it, the stop)` or `(text, None)`.

    "First" is the match that ends earliest (ties: the one that starts earliest), i.e. where
    generation would have stopped had the text arrived one character at a time; a stop may span
    any number of tokens. `include=True` keeps the stop string in the returned text.
    `num_new_chars`: only the last `num_new_chars` characters are new since the previous call, so
    only matches that end in them are searched (O(new) per streaming step instead of O(text)).
    """
    stops = [s for s in stop_strings if s]
    if not stops:
        return text, None
    start = 0
    if num_new_chars is not None:
        start = max(0, len(text) - num_new_chars - max(len(s) for s in stops) + 1)
    best: tuple[int, int, str] | None = None  # (end, begin, stop)
    for s in stops:
        begin = text.find(s, start)
        if begin >= 0 and (best is None or (begin + len(s), begin) < best[:2]):
            best = (begin + len(s), begin, s)
    if best is None:
        return text, None
    end, begin, s = best
    return text[:end] if include else text[:begin], s


def stop_holdback_len(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string: a streaming
    client must not be sent those characters yet (they may become a stop that is cut off)."""
    best = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
