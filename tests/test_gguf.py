"""GGUF targets: a tiny Llama GGUF written here with the `gguf` package (no download) becomes a
cached checkpoint directory that loads as a stage-one target, with the GGUF's tokenizer and
chat template; a GGUF without a template needs `target.chat_template`."""

import numpy as np
import pytest
import torch

from dflash.data.tokenizer import choose_mask_token, load_target_tokenizer
from dflash.extract import gguf as dflash_gguf
from dflash.extract.target import load_target, pad_batch, prepare_checkpoint

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unused_0>", "<unused_1>"]


def write_tiny_gguf(path, chat_template: str | None, seed: int = 0) -> None:
    """A 4-layer Llama (hidden 64, 4 heads / 2 KV heads) with a byte-level BPE vocabulary, f32 tensors."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    hidden, layers, heads, kv_heads, ffn = 64, 4, 4, 2, 128
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = SPECIALS + list(bytes_to_unicode().values()) + [merge.replace(" ", "") for merge in merges]
    token_types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(0)
    if chat_template:
        writer.add_chat_template(chat_template)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(hidden, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv_heads * hidden // heads, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv_heads * hidden // heads, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(hidden, hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(hidden, ffn))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", weight(len(tokens), hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_gguf(path, CHAT_TEMPLATE)
    return path


def test_gguf_target_converts_once_and_captures_like_the_gguf_model(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = prepare_checkpoint(str(tiny_gguf), str(tmp_path / "cache"))
    assert checkpoint.parent == tmp_path / "cache" and (checkpoint / dflash_gguf.SOURCE_NAME).is_file()
    mtime = (checkpoint / "model.safetensors").stat().st_mtime_ns
    assert prepare_checkpoint(str(tiny_gguf), str(tmp_path / "cache")) == checkpoint  # cached: no second conversion
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == mtime

    target = load_target(str(checkpoint), "cpu", torch.float32, layer_ids=[0, 2])
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, 266)
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                     dtype=torch.float32).eval()
    input_ids, mask = pad_batch([np.array([5, 80, 90, 100, 7]), np.array([9, 10])], pad_id=0)
    captured = target.capture(input_ids, mask)
    with torch.no_grad():
        states = reference(input_ids[:1], output_hidden_states=True).hidden_states
    # The checkpoint holds the GGUF's weights rounded to bfloat16.
    for slot, layer_id in enumerate([0, 2]):
        torch.testing.assert_close(captured[0, :, slot], states[layer_id + 1][0], atol=0.05, rtol=0.05)


def test_gguf_tokenizer_and_template_come_from_the_file(tiny_gguf, tmp_path):
    checkpoint = prepare_checkpoint(str(tiny_gguf), str(tmp_path / "cache"))
    tokenizer = load_target_tokenizer(checkpoint)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The unused specials are mask-token candidates unless the data holds them.
    assert choose_mask_token(tokenizer, [np.array([1, 2, 40])]) == 3
    assert choose_mask_token(tokenizer, [np.array([1, 3, 40])]) == 4


def test_gguf_without_chat_template_needs_one(tmp_path):
    path = tmp_path / "bare.gguf"
    write_tiny_gguf(path, chat_template=None)
    checkpoint = prepare_checkpoint(str(path), str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="target.chat_template"):
        load_target_tokenizer(checkpoint)
    template_file = tmp_path / "template.jinja"
    template_file.write_text(CHAT_TEMPLATE)
    for given in (CHAT_TEMPLATE, str(template_file)):
        assert load_target_tokenizer(checkpoint, given).chat_template == CHAT_TEMPLATE


def test_missing_gguf_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="target.path"):
        prepare_checkpoint(str(tmp_path / "nope.gguf"), str(tmp_path))
