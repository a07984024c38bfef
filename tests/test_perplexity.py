"""jaxinfer.perplexity against transformers' loss on the same tiny model and tokens."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def test_perplexity_matches_transformers(tmp_path):
    import transformers

    from jaxinfer.models.loader import load_model
    from jaxinfer.models.perplexity import perplexity
    from tests.tiny_models import save_tiny_model

    path = save_tiny_model("llama", tmp_path / "llama")
    token_ids = np.random.default_rng(0).integers(3, 300, 23).tolist()
    _, model = load_model(path)
    # chunks of 8 tokens in pages of 4: every chunk reads the earlier chunks from the cache
    got = perplexity(model, token_ids, chunk=8, page_size=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([token_ids])
        loss = hf(ids, labels=ids).loss.item()
    np.testing.assert_allclose(got, np.exp(loss), rtol=1e-4)


def test_perplexity_rejects_too_short(tmp_path):
    from jaxinfer.models.loader import load_model
    from jaxinfer.models.perplexity import perplexity
    from tests.tiny_models import save_tiny_model

    _, model = load_model(save_tiny_model("llama", tmp_path / "llama", with_tokenizer=False))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, [5])
