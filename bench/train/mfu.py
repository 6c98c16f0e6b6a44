"""Model FLOPs utilisation (MFU): the FLOPs a model's training needs per token, from its config,
times tokens/s, over the device's peak.

FLOPs per trained token, as PaLM (Chowdhery et al. 2022, appendix B) and torchtitan count them:

    6 × N  +  12 × L × H × Q × T

* N: the weights every token multiplies by: per layer the attention's q, k, v and o projections
  and the MLP's gate, up and down (3 matrices: Llama's gated MLP), then lm_head (hidden × vocab,
  counted whether or not it is tied to the embedding: tied, it is still a matmul). The embedding
  lookup, norms and biases are not matmuls and are left out. 6 = 2 FLOPs per multiply-add × 3
  (forward, and backward's two matmuls).
* 12 × L × H × Q × T: attention's scores (QKᵀ) and weighted sum (AV) per token over a sequence of
  T tokens, L layers of H heads of size Q; forward and backward, the causal mask not discounted.

Activation recomputation is not counted (MFU, not hardware FLOPs utilisation): a run that
recomputes does more work for the same MFU.
"""

from __future__ import annotations

# Dense (no sparsity) peak TFLOP/s of one device by name, as its maker's data sheet gives them:
# bf16/fp16 tensor cores, and fp32 (TF32 tensor cores for A100 and later). Matched by substring of
# torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    # (name contains, bf16, tf32)
    ("GH200", 989.4, 494.7),
    ("H200", 989.4, 494.7),
    ("H100 PCIe", 756.0, 378.0),
    ("H100 NVL", 835.0, 417.5),
    ("H100", 989.4, 494.7),  # SXM
    ("H800", 989.4, 494.7),
    ("B200", 2250.0, 1100.0),
    ("A100", 312.0, 156.0),
    ("A800", 312.0, 156.0),
    ("L40S", 362.1, 183.0),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 60.0),
)


def matmul_params(cfg: dict) -> int:
    """N above: the weights of every matmul a token passes through, from a Llama-style config."""
    d = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or d // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    attention = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2  # q, o; k, v
    mlp = 3 * d * cfg["intermediate_size"]
    return cfg["num_hidden_layers"] * (attention + mlp) + d * cfg["vocab_size"]


def flops_per_token(cfg: dict, seq_len: float) -> float:
    """Training FLOPs per token (formula above) for sequences of ``seq_len`` tokens."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    attention = 12 * cfg["num_hidden_layers"] * heads * head_dim * seq_len
    return 6 * matmul_params(cfg) + attention


def peak_tflops(device: str, precision: str) -> float | None:
    """One device's dense peak for ``precision`` (bf16 or fp32), or None for a device not in the
    table (and for CPUs)."""
    for name, bf16, tf32 in PEAK_TFLOPS:
        if name in device:
            return bf16 if precision in ("bf16", "fp16") else tf32
    return None


def mfu(
    tokens_per_s: float, cfg: dict, seq_len: float, device: str, devices: int, precision: str
) -> dict:
    """What the JSON records: achieved TFLOP/s, the peak it is measured against and their ratio
    (``mfu``: None, with ``why``, when the device's peak is unknown)."""
    per_token = flops_per_token(cfg, seq_len)
    achieved = tokens_per_s * per_token / 1e12
    peak = peak_tflops(device, precision)
    out = {
        "flops_per_token": per_token,
        "seq_len": seq_len,
        "tflops": achieved,
        "device": device,
        "devices": devices,
        "peak_tflops_per_device": peak,
        "mfu": None if peak is None else achieved / (peak * devices),
    }
    if peak is None:
        out["why"] = f"no peak known for {device!r} (bench/train/mfu.py PEAK_TFLOPS)"
    return out
