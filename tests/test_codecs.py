"""bf16 and fp8 context-feature codecs: exactness, error on activation-like data, shapes and dtypes."""

import pytest
import torch

from dflash.store.codecs import CODECS, FP8_E4M3_MAX, bytes_per_token_raw, decode, encode


def activation_like(num_tokens, num_layers, hidden_size, seed):
    """Gaussian features with a few massive-activation channels (x100), as in real LLMs."""
    generator = torch.Generator().manual_seed(seed)
    hidden_TnH = torch.randn(num_tokens, num_layers, hidden_size, generator=generator)
    massive_channels = torch.randperm(hidden_size, generator=generator)[:4]
    hidden_TnH[:, :, massive_channels] *= 100.0
    return hidden_TnH.to(torch.bfloat16)


def test_bf16_round_trip_is_bit_exact_including_special_values():
    hidden_TnH = torch.randn(33, 3, 16).to(torch.bfloat16)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3.0e38, 65504.0])
    hidden_TnH[0, 0, : len(specials)] = specials.to(torch.bfloat16)
    encoded = encode(hidden_TnH, "bf16")
    assert set(encoded) == {"hidden"}
    assert encoded["hidden"].shape == (33, 48) and encoded["hidden"].dtype == torch.uint16
    decoded_TD = decode(encoded["hidden"], None, "bf16", num_layers=3)
    assert decoded_TD.shape == (33, 48) and decoded_TD.dtype == torch.bfloat16
    original_bits = hidden_TnH.reshape(33, 48).view(torch.int16)
    assert torch.equal(decoded_TD.view(torch.int16), original_bits)  # NaN payloads and -0.0 too


def test_bf16_layers_are_concatenated_in_order():
    hidden_TnH = torch.arange(2 * 3 * 4, dtype=torch.bfloat16).reshape(2, 3, 4)
    decoded_TD = decode(encode(hidden_TnH, "bf16")["hidden"], None, "bf16", num_layers=3)
    assert torch.equal(decoded_TD[1, 4:8], hidden_TnH[1, 1])


def test_fp8_relative_error_on_massive_activation_channels():
    hidden_TnH = activation_like(512, 5, 256, seed=0)
    encoded = encode(hidden_TnH, "fp8")
    assert encoded["hidden"].shape == (512, 5 * 256) and encoded["hidden"].dtype == torch.uint8
    assert encoded["scale"].shape == (512, 5) and encoded["scale"].dtype == torch.float32
    decoded_TD = decode(encoded["hidden"], encoded["scale"], "fp8", num_layers=5, dtype=torch.float32)
    original_TD = hidden_TnH.float().reshape(512, -1)
    relative_error = ((original_TD - decoded_TD).norm() / original_TD.norm()).item()
    cosine_T = torch.nn.functional.cosine_similarity(original_TD, decoded_TD, dim=-1)
    # The massive channels set each row's scale, so the ordinary channels lose the most precision.
    ordinary_D = (hidden_TnH.float().abs().amax(dim=(0, 1)) < 50).repeat(5)
    ordinary_error = ((original_TD - decoded_TD)[:, ordinary_D].norm() / original_TD[:, ordinary_D].norm()).item()
    print(f"fp8 e4m3 per-token-per-layer scale: relative error {relative_error:.4%} "
          f"(ordinary channels {ordinary_error:.4%}), min cosine {cosine_T.min().item():.6f}")
    assert relative_error < 0.03
    assert ordinary_error < 0.04
    # Each row's absmax lands exactly on 448: the scale uses the full fp8 range.
    fp8_TnH = encoded["hidden"].view(torch.float8_e4m3fn).float().reshape(512, 5, 256)
    assert torch.equal(fp8_TnH.abs().amax(dim=-1), torch.full((512, 5), FP8_E4M3_MAX))


def test_fp8_zero_rows_and_dtype_of_decode():
    hidden_TnH = activation_like(4, 2, 8, seed=1)
    hidden_TnH[2] = 0.0
    encoded = encode(hidden_TnH, "fp8")
    assert torch.isfinite(encoded["scale"]).all() and (encoded["scale"] > 0).all()
    decoded_TD = decode(encoded["hidden"], encoded["scale"], "fp8", num_layers=2)
    assert decoded_TD.dtype == torch.bfloat16 and decoded_TD.shape == (4, 16)
    assert torch.equal(decoded_TD[2], torch.zeros(16, dtype=torch.bfloat16))


def test_torch_fp8_cast_rounds_to_nearest_even():
    """encode relies on round-to-nearest-even. It does not rely on saturation: torch 2.13 on the
    CPU saturates 1e4 to 448, but torch 2.11 (CPU and CUDA) gives NaN, hence the clamp."""
    # e4m3 spacing between 1 and 2 is 1/8: halfway cases go to the even mantissa.
    halfway = torch.tensor([1.0625, 1.1875, 1.07, 448.0, -448.0])
    assert halfway.to(torch.float8_e4m3fn).float().tolist() == [1.0, 1.25, 1.125, 448.0, -448.0]


def test_fp8_encode_never_produces_nan_on_extreme_rows():
    hidden_TnH = torch.tensor([[[3.0e38, -3.0e38, 1.0, 0.0]], [[1e-30, 2e-30, -1e-30, 0.0]]])
    encoded = encode(hidden_TnH, "fp8")
    decoded_TD = decode(encoded["hidden"], encoded["scale"], "fp8", num_layers=1, dtype=torch.float32)
    assert torch.isfinite(decoded_TD).all()
    torch.testing.assert_close(decoded_TD[:, :2], hidden_TnH[:, 0, :2], rtol=0.07, atol=0)


def test_decode_rejects_mismatched_inputs():
    encoded = encode(activation_like(3, 2, 8, seed=2), "fp8")
    with pytest.raises(ValueError, match="scale"):
        decode(encoded["hidden"], None, "fp8", num_layers=2)
    with pytest.raises(ValueError, match="n=3"):
        decode(encoded["hidden"], encoded["scale"], "fp8", num_layers=3)
    with pytest.raises(ValueError, match="uint16"):
        decode(encoded["hidden"], None, "bf16", num_layers=2)
    with pytest.raises(ValueError, match="store.codec"):
        encode(torch.zeros(1, 1, 1), "int4")


def test_codec_names_and_raw_size():
    assert CODECS == ("bf16", "fp8")
    assert bytes_per_token_raw(5, 5120) == 51200
