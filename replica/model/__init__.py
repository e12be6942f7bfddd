"""What computes a step: the decoder for the LLaMA, Qwen2 and GPT-2 families, its attention,
matrix products, K/V caches and sampler, the model runner that lays a step out as one flat
batch, the offline weight loader, and the fake models (with their cost models) that stand in for
it in scheduling experiments."""
