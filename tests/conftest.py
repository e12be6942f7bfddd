"""Shared fixtures: small local Hugging Face model directories built from config with seeded
random weights (exercising the "local directory" loading path with no download), and the
default model loaded once per session."""

from __future__ import annotations

import os

# Every test starts and stops its own Ray instance. Ray's auto-connect would let a stray call
# after `ray.shutdown()` (a client's feed thread still reading, say) silently join whatever
# cluster is still up and leak into the next test; turn it off before Ray is imported.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_VOCAB = 49152  # the default model's tokenizer, shipped with every tiny model dir


def _save_tiny(path, hf_model) -> str:
    from transformers import AutoTokenizer

    from replica.model.loader import default_model_dir

    hf_model.save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # A wide init makes the logits peaked, so greedy choices are not near-ties.
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=512, vocab_size=TINY_VOCAB, initializer_range=0.2)
    return _save_tiny(tmp_path_factory.mktemp("tiny-gpt2"), GPT2LMHeadModel(config).eval())


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # Qwen2 has Q/K/V biases; random ones make the test cover them
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.2)
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), model)
