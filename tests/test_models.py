"""The Llama-family model over the paged KV cache against HF transformers (float32)."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models.layers import rope_inv_freq
from jaxinfer.models.loader import load_model, model_from_params
from jaxinfer.ops.kv_cache import KVCache, allocate_kv_cache
from tests.tiny_models import paged_batch, save_tiny_model, tiny_hf_config

PAGE_SIZE = 4
NUM_PAGES = 24
LLAMA3_ROPE = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8)
VARIANTS = {  # name: (arch, overrides)
    "llama": ("llama", {}),
    "llama3_rope": ("llama", dict(rope_theta=500.0, rope_parameters=LLAMA3_ROPE)),
    "mistral": ("mistral", dict(sliding_window=6)),
    "qwen2": ("qwen2", {}),
}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def make_forward(model):
    """The runtime's pattern: split once, jit a plain function that merges inside, donate the cache."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def forward(state, input_ids, positions, kv_cache, md):
        model = nnx.merge(graphdef, state)
        hidden, kv_cache = model(input_ids, positions, kv_cache, md, attention_backend="xla")
        return model.compute_logits(hidden), kv_cache

    return functools.partial(forward, state)


def hf_logits(hf_model, token_ids) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


class Variant:
    def __init__(self, path):
        import transformers

        self.path = path
        self.config, self.model = load_model(path)
        self.forward = make_forward(self.model)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    built = {}

    def get(name) -> Variant:
        if name not in built:
            arch, overrides = VARIANTS[name]
            built[name] = Variant(save_tiny_model(arch, tmp_path_factory.mktemp(name), **overrides))
        return built[name]

    return get


def run_schedule(forward, config, seqs, schedule, page_ids, *, fill=0.0):
    """Feed `seqs` (full token lists) through the paged cache following `schedule`.

    schedule: list of steps, each a list of (seq_index, num_new_tokens); steps where every
    sequence has one token use the decode shape (T = S = 4), others T = 16, S = 4.
    Returns {(seq_index, position): logits row}.
    """
    cache = allocate_kv_cache(config, NUM_PAGES, PAGE_SIZE, jnp.float32)
    cache = KVCache(jnp.full_like(cache.k, fill), jnp.full_like(cache.v, fill))
    computed = [0] * len(seqs)
    rows = {}
    for step in schedule:
        batch = []
        for s, n in step:
            batch.append((seqs[s][computed[s]:computed[s] + n], computed[s], page_ids[s]))
        decode = all(n == 1 for _, n in step)
        ids, positions, md = paged_batch(batch, page_size=PAGE_SIZE, num_tokens=4 if decode else 16,
                                         num_seqs=4, pages_per_seq=5)
        logits, cache = forward(ids, positions, cache, md)
        logits = np.asarray(logits)
        t = 0
        for s, n in step:
            for i in range(n):
                rows[(s, computed[s] + i)] = logits[t]
                t += 1
            computed[s] += n
    return rows


# Three sequences: chunked prefills, a whole prefill, then single-token decodes, mixed in steps.
SEQ_LENS = (16, 12, 9)
SCHEDULE = [
    [(0, 7), (1, 5)],
    [(0, 6), (1, 4), (2, 6)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 1)],
]


def make_seqs(seed):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, 300, n)) for n in SEQ_LENS]


def distinct_pages(seed):
    pages = list(np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES)))
    return [[int(pages.pop()) for _ in range(-(-n // PAGE_SIZE))] for n in SEQ_LENS]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_paged_forward_matches_transformers(variants, name):
    """Chunked prefill + decode through the paged cache == HF's dense forward, every row."""
    v = variants(name)
    seqs = make_seqs(1)
    rows = run_schedule(v.forward, v.config, seqs, SCHEDULE, distinct_pages(2))
    assert len(rows) == sum(SEQ_LENS)
    for s, seq in enumerate(seqs):
        ref = hf_logits(v.hf, seq)
        ours = np.stack([rows[(s, p)] for p in range(len(seq))])
        assert ours.dtype == np.float32
        assert rel_err(ours, ref) < 1e-4, (name, s)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_single_prefill_matches_transformers(variants, name):
    v = variants(name)
    seq = make_seqs(3)[1]
    rows = run_schedule(v.forward, v.config, [seq], [[(0, len(seq))]], [[9, 3, 17]])
    ours = np.stack([rows[(0, p)] for p in range(len(seq))])
    assert rel_err(ours, hf_logits(v.hf, seq)) < 1e-4


def test_page_placement_and_stale_cache_change_nothing(variants):
    """Other physical pages, and a cache full of NaN outside the written slots: same logits."""
    v = variants("mistral")
    seqs = make_seqs(4)
    a = run_schedule(v.forward, v.config, seqs, SCHEDULE, distinct_pages(5))
    b = run_schedule(v.forward, v.config, seqs, SCHEDULE, distinct_pages(6), fill=np.nan)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-5)


def test_sliding_window_is_applied(variants):
    v = variants("mistral")
    window = v.config.sliding_window
    no_window = model_from_params(dataclasses.replace(v.config, sliding_window=None),
                                  nnx.to_pure_dict(nnx.state(v.model)), jnp.float32)
    seq = make_seqs(7)[0]
    with_w = run_schedule(v.forward, v.config, [seq], [[(0, len(seq))]], [[1, 2, 3, 4]])
    without = run_schedule(make_forward(no_window), v.config, [seq], [[(0, len(seq))]],
                           [[1, 2, 3, 4]])
    for p in range(len(seq)):
        differs = np.abs(with_w[(0, p)] - without[(0, p)]).max() > 1e-3
        assert differs == (p >= window), p


def test_bfloat16_params(variants):
    v = variants("llama")
    config, model = load_model(v.path, EngineConfig(dtype="bfloat16"))
    leaves = jax.tree.leaves(nnx.state(model))
    assert leaves and all(x.dtype == jnp.bfloat16 for x in leaves)
    seq = make_seqs(8)[2]
    rows = run_schedule(make_forward(model), config, [seq], [[(0, len(seq))]], [[5, 6, 7]])
    ours = np.stack([rows[(0, p)] for p in range(len(seq))])
    assert ours.dtype == np.float32
    assert rel_err(ours, hf_logits(v.hf, seq)) < 5e-2


def test_model_interface_shapes(variants):
    v = variants("qwen2")
    ids, positions, md = paged_batch([([5, 6, 7], 0, [2])], page_size=PAGE_SIZE, num_tokens=8,
                                     num_seqs=2, pages_per_seq=2)
    cache = allocate_kv_cache(v.config, 4, PAGE_SIZE, jnp.float32)
    graphdef, state = nnx.split(v.model)

    @jax.jit
    def run(state, cache):
        model = nnx.merge(graphdef, state)
        hidden, cache = model(ids, positions, cache, md)
        return hidden, model.compute_logits(hidden[jnp.array([2])]), cache

    hidden, logits, new_cache = run(state, cache)
    assert hidden.shape == (8, v.config.hidden_size)
    assert new_cache.k.shape == cache.k.shape and new_cache.v.dtype == cache.v.dtype
    written = np.asarray(new_cache.k)
    assert written[:, 2, :3].any() and not written[:, 2, 3:].any() and not written[:, 3].any()
    assert logits.shape == (1, v.config.vocab_size) and logits.dtype == jnp.float32


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, dict(rope_type="linear", factor=2.5)])
def test_rope_inv_freq_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = tiny_hf_config("llama", rope_theta=500000.0, rope_parameters=rope,
                               hidden_size=256, num_attention_heads=4)
    ours = rope_inv_freq(ModelConfig.from_hf_dict(json.loads(hf_config.to_json_string())))
    ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_dummy_load_any_config(tmp_path):
    hf_config = tiny_hf_config("llama", num_hidden_layers=3)
    (tmp_path / "config.json").write_text(hf_config.to_json_string())
    config, model = load_model(str(tmp_path / "config.json"),
                               EngineConfig(load_format="dummy", dtype="bfloat16"))
    assert config.num_layers == 3
    state = nnx.state(model)
    assert state["layers"]["self_attn"]["qkv_proj"]["weight"][...].shape == (3, 64, 128)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state))
    ids, positions, md = paged_batch([([5, 6, 7], 0, [1])], page_size=PAGE_SIZE, num_tokens=4,
                                     num_seqs=1, pages_per_seq=1)
    cache = allocate_kv_cache(config, 2, PAGE_SIZE, jnp.bfloat16)
    logits, _ = make_forward(model)(ids, positions, cache, md)
    assert np.isfinite(np.asarray(logits)).all()


def _compiled_cosines(path, num_layers: int) -> int:
    """cosine ops in the optimized HLO of an unrolled tiny Llama step of `num_layers` layers."""
    (path / "config.json").write_text(
        tiny_hf_config("llama", num_hidden_layers=num_layers).to_json_string())
    config, model = load_model(str(path / "config.json"), EngineConfig(load_format="dummy"))
    model.unroll_layers()
    ids, positions, md = paged_batch([([5, 6, 7], 0, [1])], page_size=PAGE_SIZE, num_tokens=4,
                                     num_seqs=1, pages_per_seq=1)
    cache = allocate_kv_cache(config, 2, PAGE_SIZE, jnp.float32)
    graphdef, state = nnx.split(model)

    def forward(state, ids, positions, cache, md):  # arguments, as in a step: not constants
        return nnx.merge(graphdef, state)(ids, positions, cache, md, attention_backend="xla")

    compiled = jax.jit(forward).lower(state, ids, positions, cache, md).compile()
    return compiled.as_text().count(" cosine(")


def test_rope_angles_are_computed_once_a_step(tmp_path_factory):
    """cos/sin of the positions are evaluated once a step, however many layers use them: fused
    into each layer's rope, XLA evaluated them per element of every layer's q and k."""
    one = _compiled_cosines(tmp_path_factory.mktemp("one"), 1)
    four = _compiled_cosines(tmp_path_factory.mktemp("four"), 4)
    assert one >= 1
    assert four == one


# ---- the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same file


@pytest.fixture(scope="module")
def smollm2(hf_smollm2):
    """Ours, plus transformers on the same GGUF (the session fixture in conftest.py)."""
    tok, hf = hf_smollm2
    config, model = load_model("smollm2-135m")
    return config, model, make_forward(model), hf, tok


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    config, _, forward, hf, tok = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):",
               "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"]
    seqs = [tok(p)["input_ids"] for p in prompts]
    pages = [[3, 8], [5, 1], [2, 7]]
    cache = allocate_kv_cache(config, 12, 16, jnp.float32)
    ids, positions, md = paged_batch([(s, 0, p) for s, p in zip(seqs, pages)], page_size=16,
                                     num_tokens=32, num_seqs=4, pages_per_seq=2)
    logits, _ = forward(ids, positions, cache, md)
    logits = np.asarray(logits)
    start = 0
    for seq in seqs:
        ours = logits[start:start + len(seq)]
        start += len(seq)
        ref = hf_logits(hf, seq)
        assert rel_err(ours, ref) < 1e-4
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers(smollm2):
    config, _, forward, hf, tok = smollm2
    messages = [{"role": "user", "content": "Name three colors."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt)["input_ids"]
    num_new = 16
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                          dtype=torch.long), max_new_tokens=num_new, do_sample=False)
    ref = ref[0, len(prompt_ids):].tolist()

    pages = [4, 9, 2, 6, 11, 1, 3]  # 7 pages x 16 slots: room for prompt + continuation
    assert len(prompt_ids) + num_new <= len(pages) * 16
    cache = allocate_kv_cache(config, 12, 16, jnp.float32)
    num_tokens = 1 << (len(prompt_ids) - 1).bit_length()
    ids, positions, md = paged_batch([(prompt_ids, 0, pages)], page_size=16, num_tokens=num_tokens,
                                     num_seqs=1, pages_per_seq=8)
    logits, cache = forward(ids, positions, cache, md)
    out = [int(np.asarray(logits)[len(prompt_ids) - 1].argmax())]
    while len(out) < len(ref):
        seq_len = len(prompt_ids) + len(out)
        ids, positions, md = paged_batch([([out[-1]], seq_len - 1, pages)], page_size=16,
                                         num_tokens=1, num_seqs=1, pages_per_seq=8)
        logits, cache = forward(ids, positions, cache, md)
        out.append(int(np.asarray(logits)[0].argmax()))
    assert out == ref, (tok.decode(out), tok.decode(ref))


@pytest.mark.parametrize("arch,hidden_size,num_heads", [("qwen2", 448, 7), ("llama", 384, 3)])
def test_gqa_groups_on_the_cpu_kernels_match_transformers(tmp_path, arch, hidden_size, num_heads):
    """Qwen2.5-0.5B's shape of attention (7 query heads a KV head, head_dim 64, 16-token pages),
    whose groups the CPU kernel's decode path splits into items of 4 and 3 heads, and a group of
    3 at head_dim 128 (Llama 3 8B's head size), split into 2 and 1. Through the engine, every
    prompt token's logprob across two prefill chunks equals transformers' log-softmax, and greedy
    decoding continues as transformers' does."""
    import transformers

    from cpu_kernels.ragged_paged_attention import available
    from jaxinfer import LLM, SamplingParams

    assert available(), "the CPU kernel did not build (is a C++ compiler installed?)"
    path = save_tiny_model(arch, tmp_path / arch, hidden_size=hidden_size,
                           num_attention_heads=num_heads, num_key_value_heads=1,
                           intermediate_size=128, num_hidden_layers=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, page_size=16, num_pages=16, max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=128)
    assert llm.engine.runner.attention_backend == "cpu"
    prompt = np.random.default_rng(5).integers(3, 300, 50).tolist()
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    ref = torch.log_softmax(torch.tensor(hf_logits(hf, prompt)[:-1]), dim=-1).numpy()
    ours = [e.logprob for e in out.prompt_logprobs[1:]]
    np.testing.assert_allclose(ours, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=8, do_sample=False)
    assert out.outputs[0].token_ids == greedy[0, len(prompt):].tolist()
