"""Store codecs for context features: `bf16` (lossless bits) and `fp8` (e4m3 with per-row scales).

Torch only, so they run wherever the tensors are: stage one encodes on the GPU right after
the target forward, stage two decodes on the GPU right before the drafter. zarr v3 has no
bfloat16 or float8 dtype, so both store raw bits in unsigned integers.

`fp8` scales each token's each layer by its absmax, so the largest value of every
`(token, layer)` row maps to 448, the largest finite float8_e4m3fn. Values are clamped to
+-448 before the cast: torch's cast rounds to nearest-even but does not saturate everywhere
(torch 2.13 on the CPU turns 1e4 into 448, torch 2.11 into NaN, on the CPU and on CUDA).
"""

import torch

CODECS = ("bf16", "fp8")

# Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0


def bytes_per_token_raw(n: int, hidden_size: int) -> int:
    """Bytes of one token's context feature in bf16, before any codec: `n * H * 2`."""
    return n * hidden_size * 2


def check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"store.codec: unknown codec {codec!r}; expected one of {CODECS}")


def encode(hidden_TnH: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """Encode `(T, n, H)` features for the store, on their own device.

    "bf16": `{"hidden": (T, n*H) uint16}`, the bf16 bits. "fp8": `{"hidden": (T, n*H) uint8,
    "scale": (T, n) float32}`, the float8_e4m3fn bits of `x / scale` with `scale = absmax / 448`.
    """
    check_codec(codec)
    if hidden_TnH.ndim != 3:
        raise ValueError(f"encode: expected hidden (T, n, H), got shape {tuple(hidden_TnH.shape)}")
    num_tokens = hidden_TnH.shape[0]
    if codec == "bf16":
        bits_TnH = hidden_TnH.to(torch.bfloat16).contiguous().view(torch.uint16)
        return {"hidden": bits_TnH.reshape(num_tokens, -1)}
    hidden_TnH = hidden_TnH.float()
    absmax_Tn = hidden_TnH.abs().amax(dim=-1)
    # All-zero rows (e.g. padding) would divide by zero; any positive scale encodes them as 0.
    scale_Tn = torch.where(absmax_Tn > 0, absmax_Tn / FP8_E4M3_MAX, torch.ones_like(absmax_Tn))
    scaled_TnH = (hidden_TnH / scale_Tn.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    bits_TnH = scaled_TnH.to(torch.float8_e4m3fn).view(torch.uint8)
    return {"hidden": bits_TnH.reshape(num_tokens, -1), "scale": scale_Tn}


def decode(
    hidden: torch.Tensor,
    scale: torch.Tensor | None,
    codec: str,
    num_layers: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Decode store rows `(T, n*H)` back to features `(T, n*H)` in `dtype`, on their own device."""
    check_codec(codec)
    if hidden.ndim != 2 or hidden.shape[1] % num_layers != 0:
        raise ValueError(f"decode: expected hidden (T, n*H) with n={num_layers}, got shape {tuple(hidden.shape)}")
    if codec == "bf16":
        if hidden.dtype != torch.uint16:
            raise ValueError(f"decode: bf16 codec expects uint16 bits, got {hidden.dtype}")
        return hidden.contiguous().view(torch.bfloat16).to(dtype)
    if hidden.dtype != torch.uint8:
        raise ValueError(f"decode: fp8 codec expects uint8 bits, got {hidden.dtype}")
    num_tokens = hidden.shape[0]
    if scale is None or tuple(scale.shape) != (num_tokens, num_layers):
        got = None if scale is None else tuple(scale.shape)
        raise ValueError(f"decode: fp8 codec needs scale ({num_tokens}, {num_layers}), got {got}")
    values_TnH = hidden.contiguous().view(torch.float8_e4m3fn).reshape(num_tokens, num_layers, -1).float()
    return (values_TnH * scale.float().unsqueeze(-1)).to(dtype).reshape(num_tokens, -1)
