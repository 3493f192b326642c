"""Model shapes of public large training runs, by name, so `scaletrain plan gpt-1t ...` can be
held against what those runs measured (docs/planner.md, "Held against published runs").

Each shape follows its paper's table; where our model cannot express a detail that does not
change the size (MPT's ALiBi has no parameters: it is planned as rotary), the comment says so.
Megatron ties the embedding and the head across pipeline stages with an all-reduce; our
pipeline needs them untied, which adds one V×h matrix to the last stage (under 1% of these
models).
"""

from __future__ import annotations

_GPT = dict(norm="layernorm", activation="gelu", position="learned", bias=True, vocab_size=51200,
            max_seq_len=2048, tie_embeddings=False)

MODELS: dict[str, dict] = {
    # Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters"),
    # Table 1 and the ZeRO-3 comparison; Korthikanti et al. 2022, Table 3
    "gpt-22b": dict(_GPT, dim=6144, n_layers=48, n_heads=64),
    "gpt-39b": dict(_GPT, dim=8192, n_layers=48, n_heads=64),
    "gpt-175b": dict(_GPT, dim=12288, n_layers=96, n_heads=96),
    "gpt-530b": dict(_GPT, dim=20480, n_layers=105, n_heads=128),
    "gpt-1t": dict(_GPT, dim=25600, n_layers=128, n_heads=160),
    # MosaicML MPT-7B (llm-foundry yamls/mpt-7b): LayerNorm without bias, GELU MLP of 4h, ALiBi
    # (no parameters; planned as rotary), tied embeddings
    "mpt-7b": dict(norm="layernorm", activation="gelu", position="rope", bias=False, vocab_size=50432,
                   dim=4096, n_layers=32, n_heads=32, max_seq_len=2048, tie_embeddings=True),
    # Llama 3 405B (Dubey et al. 2024, Table 3; meta-llama/Llama-3.1-405B config.json)
    "llama-405b": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                       max_seq_len=8192, norm="rmsnorm", activation="swiglu", position="rope",
                       rope_theta=500000.0, tie_embeddings=False, bias=False),
}
