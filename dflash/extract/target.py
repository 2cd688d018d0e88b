"""The frozen target: load a causal LM checkpoint and capture chosen decoder-layer outputs.

Layer id `i` means the output of decoder layer `i` (`hidden_states[i + 1]` of a transformers
forward with `output_hidden_states=True`). `load_target` keeps only the decoder layers up to
the last needed id, and `TargetModel.capture` calls the base model (the module that owns the
decoder layers) rather than the causal-LM wrapper, so neither the dropped layers nor the LM
head ever run. Calling the base model costs one final norm over `(B, T, H)`, negligible next
to the layers, and needs no exception-based control flow through transformers' forward.

Batches are right-padded, one sequence per row: packing sequences into one row leaks between
them in the Qwen3.5 hybrid family (docs/ENVIRONMENT.md). With right padding, every real token
only sees real tokens before it, so its states equal an unpadded single-row forward.
"""

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from dflash.padding import round_up

# Where causal-LM wrappers keep their decoder layers, relative to the loaded model.
DECODER_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "model.decoder.layers",
    "transformer.h",
    "transformer.layers",
    "gpt_neox.layers",
)

# Checkpoint key prefixes of vision-language wrappers, mapped to the text-only model's keys.
TEXT_PREFIX_REMAP = (("model.language_model.", "model."),)


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """Evenly spaced ids from 1 to L-3: `round(1 + k*(L-4)/(n-1))` (64 layers, 5 -> [1,16,31,46,61])."""
    if n < 2:
        raise ValueError(f"target.layer_ids: default ids need n >= 2 layers, got n={n}; set target.layer_ids")
    layer_ids = [round(1 + k * (num_layers - 4) / (n - 1)) for k in range(n)]
    validate_layer_ids(layer_ids, num_layers)
    return layer_ids


def validate_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """Raise ValueError naming `target.layer_ids` unless ids are strictly increasing in [0, L)."""
    if not layer_ids:
        raise ValueError("target.layer_ids: empty; at least one decoder layer id is needed")
    for layer_id in layer_ids:
        if not 0 <= layer_id < num_layers:
            raise ValueError(
                f"target.layer_ids: id {layer_id} out of range for a target with {num_layers} "
                f"decoder layers (valid 0..{num_layers - 1}); got {list(layer_ids)}"
            )
    if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])):
        # The store concatenates layers in id order; duplicates or reordering would be silent bugs.
        raise ValueError(f"target.layer_ids: ids must be strictly increasing, got {list(layer_ids)}")


def pad_batch(seqs: list[np.ndarray], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token sequences into `(input_ids_BT int64, attention_mask_BT int64)` on the CPU.

    The padded length is rounded up to `multiple`: kernels that compile or autotune per
    sequence length (fla's Triton kernels) then see a bounded set of shapes.
    """
    if not seqs:
        raise ValueError("pad_batch: empty batch")
    max_len = round_up(max(len(seq) for seq in seqs), multiple)
    input_ids_BT = torch.full((len(seqs), max_len), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(seqs), max_len), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if len(seq) == 0:
            raise ValueError(f"pad_batch: sequence {row} is empty")
        input_ids_BT[row, : len(seq)] = torch.as_tensor(np.asarray(seq), dtype=torch.long)
        attention_mask_BT[row, : len(seq)] = 1
    return input_ids_BT, attention_mask_BT


def read_config_hash(path: str) -> tuple[str, dict]:
    """sha256 of the checkpoint's config.json (canonical JSON, so whitespace does not matter)."""
    config_dict = json.loads((Path(path) / "config.json").read_text())
    canonical = json.dumps(config_dict, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest(), config_dict


def describe_target_config(config, path: str) -> dict:
    """The store's `target` attributes from a checkpoint's config, without loading weights.

    `{path, config_hash, model_type, num_hidden_layers, hidden_size, vocab_size}`; sizes come
    from the text config (vision-language checkpoints nest it), `model_type` and the hash
    from the checkpoint's own config.json, as `TargetModel` reports them.
    """
    config_hash, config_dict = read_config_hash(path)
    text_config = config.get_text_config()
    return {
        "path": str(path),
        "config_hash": config_hash,
        "model_type": config_dict.get("model_type", config.model_type),
        "num_hidden_layers": int(text_config.num_hidden_layers),
        "hidden_size": int(text_config.hidden_size),
        "vocab_size": int(text_config.vocab_size),
    }


def weights_fingerprint(path: str | Path) -> str:
    """A hash of a checkpoint's weights that a copy or move keeps: for every safetensors file,
    its name, size, header (names, shapes, dtypes, offsets) and first MiB of tensor data.
    Cheap at any size; a fine-tune with the same config.json gets another hash."""
    digest = hashlib.sha256()
    for file in checkpoint_files(str(path)):
        with open(file, "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            digest.update(f"{file.name}:{file.stat().st_size}:".encode())
            digest.update(handle.read(header_size))
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()


def text_config_summary(config) -> dict:
    """The target's text-model sizes a drafter is sized from (`drafter.size = "auto"`), as plain data.

    Recorded in the store (`target_text_config`), so stage two needs no checkpoint.
    """
    text = config.get_text_config()
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    return {
        "model_type": text.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(text.num_hidden_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(text, "head_dim", None) or hidden // heads),
        "intermediate_size": getattr(text, "intermediate_size", None),
        "vocab_size": int(text.vocab_size),
        "rope_theta": rope_base(text),
        "rms_norm_eps": getattr(text, "rms_norm_eps", None),
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
    }


def rope_base(text_config) -> float | None:
    """RoPE theta of a text config: `rope_parameters` (transformers 5; per layer type in some
    models, then the full-attention one) or the older `rope_theta`."""
    parameters = getattr(text_config, "rope_parameters", None) or {}
    if parameters and "rope_theta" not in parameters:
        parameters = parameters.get("full_attention") or next(iter(parameters.values()), {})
    theta = parameters.get("rope_theta", getattr(text_config, "rope_theta", None))
    return float(theta) if theta is not None else None


def target_dtype(name: str, device: torch.device) -> torch.dtype:
    """`target.dtype`: "auto" is bfloat16 on CUDA and float32 on the CPU, else the named dtype."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokenizer's end-of-turn token and the model's generation-config end tokens."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return sorted(i for i in ids if i is not None)


def prepare_checkpoint(path: str, cache_dir: str) -> Path:
    """The checkpoint directory for `target.path`: a directory as is, a `.gguf` file converted
    once into `cache_dir`, or the embedded tiny target built there."""
    from dflash.extract.gguf import converted_dir, is_gguf
    from dflash.extract.tiny_target import EMBEDDED_TARGET, build_tiny_target

    if path == EMBEDDED_TARGET:
        return build_tiny_target(Path(cache_dir) / "target-tiny")
    if is_gguf(path):
        return converted_dir(path, cache_dir)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"target.path: checkpoint directory not found: {path}")
    return Path(path)


def prepare_checkpoint_in_order(path: str, cache_dir: str, dist) -> Path:
    """`prepare_checkpoint` on every rank of `dist` (a DistState), rank 0 first: it converts a GGUF
    or builds the embedded target once, the other ranks then find it in the cache."""
    prepared = prepare_checkpoint(path, cache_dir) if dist.is_main else None
    dist.barrier()
    return prepared if dist.is_main else prepare_checkpoint(path, cache_dir)


def find_decoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """Return `(owner, attribute, layers)`: the base model that owns the decoder layer list."""
    for dotted in DECODER_LAYER_PATHS:
        *owner_path, attribute = dotted.split(".")
        owner = model
        for name in owner_path:
            owner = getattr(owner, name, None)
            if owner is None:
                break
        layers = getattr(owner, attribute, None) if owner is not None else None
        if isinstance(layers, nn.ModuleList):
            return owner, attribute, layers
    raise ValueError(
        f"target: cannot find the decoder layers of {type(model).__name__}; "
        f"looked for {', '.join(DECODER_LAYER_PATHS)}"
    )


def checkpoint_files(path: str) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"target: no *.safetensors files in {path}")
    return files


def text_model_key(name: str) -> str:
    for prefix, replacement in TEXT_PREFIX_REMAP:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def load_remapped_text_weights(model: nn.Module, path: str) -> None:
    """Fill `model` from a vision-language checkpoint, mapping `model.language_model.*` -> `model.*`.

    Only used when transformers did not map the keys itself (older releases); vision and
    multi-token-prediction weights are not part of the text model and are skipped.
    """
    own_state = model.state_dict()
    filled = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                own_name = text_model_key(name)
                if own_name not in own_state:
                    continue
                tensor = handle.get_tensor(name)
                if tensor.shape != own_state[own_name].shape:
                    raise ValueError(f"target: {name} in {file} has shape {tuple(tensor.shape)}, "
                                     f"model expects {tuple(own_state[own_name].shape)}")
                with torch.no_grad():
                    own_state[own_name].copy_(tensor)
                filled.add(own_name)
    # A tied head shares the embedding's storage and appears under both names.
    embedding_ptr = model.get_input_embeddings().weight.data_ptr()
    tied = {name for name, tensor in own_state.items() if tensor.data_ptr() == embedding_ptr}
    missing = sorted(set(own_state) - filled - (tied if tied & filled else set()))
    if missing:
        raise ValueError(f"target: checkpoint {path} lacks weights for {missing[:5]} ({len(missing)} in all)")


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Load a causal LM in eval mode without gradients, with its checkpoint weights.

    With accelerate installed the weights go straight to `device`; without it transformers
    refuses a device map, so they load on the CPU and the caller moves the kept part.
    """
    device_kwargs = {"device_map": {"": device}} if importlib.util.find_spec("accelerate") else {}
    model, loading_info = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", output_loading_info=True, **device_kwargs
    )
    if loading_info["missing_keys"]:
        # e.g. a Qwen3_5ForConditionalGeneration checkpoint on a transformers release that
        # does not strip `language_model.` itself: the weights would be random otherwise.
        load_remapped_text_weights(model, path)
    report_linear_attention_path(model, torch.device(device))
    return model.eval().requires_grad_(False)


def report_linear_attention_path(model: nn.Module, device: torch.device) -> None:
    """One line on how a hybrid target's linear-attention layers run, instead of transformers'
    per-kernel "falling back ... not installed" warnings (on a CPU they are not missing: their
    kernels need CUDA, and the PyTorch path is the right one there)."""
    from transformers.utils import logging as transformers_logging

    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    if "linear_attention" not in layer_types:
        return
    transformers_logging.get_logger("transformers.integrations.hub_kernels").setLevel(transformers_logging.ERROR)
    if device.type != "cuda":
        print("target: linear-attention layers run on transformers' PyTorch path (flash-linear-attention's "
              "kernels need CUDA)")
    elif importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None:
        print("target: linear-attention layers run on transformers' slow PyTorch path: install "
              "flash-linear-attention and triton (pip install -e '.[gpu]') for their kernels")


LABEL_ROWS = 8192  # rows of the final hidden state per LM-head chunk in greedy_tokens
LABEL_VOCAB = 32768  # vocabulary entries per chunk: 8192 x 32768 bf16 logits are 512 MiB


def greedy_tokens(hidden_RH: torch.Tensor, lm_head_VH: torch.Tensor, rows: int = LABEL_ROWS,
                  vocab: int = LABEL_VOCAB) -> torch.Tensor:
    """`argmax(hidden_RH @ lm_head_VH.T, -1)` as int32, `rows x vocab` logits at a time.

    No full logits tensor exists at any moment; ties go to the lowest id, as `torch.argmax`
    does on the whole row (a later chunk must be strictly larger to win). Logit soft-capping
    and scaling, where a model has them, are monotonic and leave the argmax unchanged.
    """
    out_R = torch.empty(hidden_RH.shape[0], dtype=torch.int32, device=hidden_RH.device)
    for start in range(0, hidden_RH.shape[0], rows):
        chunk_rH = hidden_RH[start:start + rows]
        best_r = torch.full((chunk_rH.shape[0],), -torch.inf, dtype=torch.float32, device=hidden_RH.device)
        best_id_r = torch.zeros(chunk_rH.shape[0], dtype=torch.int64, device=hidden_RH.device)
        for first in range(0, lm_head_VH.shape[0], vocab):
            value_r, index_r = (chunk_rH @ lm_head_VH[first:first + vocab].T).max(dim=-1)
            better_r = value_r.float() > best_r
            best_r = torch.where(better_r, value_r.float(), best_r)
            best_id_r = torch.where(better_r, index_r + first, best_id_r)
        out_R[start:start + rows] = best_id_r.to(torch.int32)
    return out_R


def topk_distribution(hidden_RH: torch.Tensor, lm_head_VH: torch.Tensor, k: int, rows: int = LABEL_ROWS,
                      vocab: int = LABEL_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of `softmax(hidden_RH @ lm_head_VH.T)` (temperature 1) and their
    probabilities: `(ids (R, k) int32, probs (R, k) float32)`, most likely first.

    Like `greedy_tokens`, `rows x vocab` logits at a time: per vocabulary chunk the running top k
    is merged with the chunk's own and the running log-sum-exp updated (float32), so only k
    values a row ever leave the device. Logit soft-capping, where a model has it, is not applied
    (the families dflash targets have none).
    """
    device = hidden_RH.device
    ids_Rk = torch.empty(hidden_RH.shape[0], k, dtype=torch.int32, device=device)
    probs_Rk = torch.empty(hidden_RH.shape[0], k, dtype=torch.float32, device=device)
    for start in range(0, hidden_RH.shape[0], rows):
        chunk_rH = hidden_RH[start:start + rows]
        best_rk = torch.full((chunk_rH.shape[0], k), -torch.inf, dtype=torch.float32, device=device)
        best_id_rk = torch.zeros(chunk_rH.shape[0], k, dtype=torch.int64, device=device)
        lse_r = torch.full((chunk_rH.shape[0],), -torch.inf, dtype=torch.float32, device=device)
        for first in range(0, lm_head_VH.shape[0], vocab):
            logits_rv = (chunk_rH @ lm_head_VH[first:first + vocab].T).float()
            lse_r = torch.logaddexp(lse_r, torch.logsumexp(logits_rv, dim=-1))
            value_rk, index_rk = logits_rv.topk(min(k, logits_rv.shape[1]), dim=-1)
            merged_r2k = torch.cat([best_rk, value_rk], dim=1)
            merged_id_r2k = torch.cat([best_id_rk, index_rk + first], dim=1)
            best_rk, order_rk = merged_r2k.topk(k, dim=-1)
            best_id_rk = merged_id_r2k.gather(1, order_rk)
        ids_Rk[start:start + rows] = best_id_rk.to(torch.int32)
        probs_Rk[start:start + rows] = (best_rk - lse_r[:, None]).exp()
    return ids_Rk, probs_Rk


class TargetModel:
    """A frozen causal LM cut after its last needed decoder layer, capturing those layers' outputs."""

    def __init__(self, model: nn.Module, layer_ids: list[int], config_hash: str, model_type: str,
                 predict_labels: bool = False, topk: int = 0):
        base_model, layers_attribute, layers = find_decoder_layers(model)
        self.num_layers = len(layers)
        validate_layer_ids(layer_ids, self.num_layers)
        self.layer_ids = list(layer_ids)
        self.config_hash = config_hash
        self.model_type = model_type
        self.predict_labels = predict_labels
        self.topk = topk  # soft targets: the k most likely next tokens per position (`capture_head`)
        if model.get_output_embeddings() is None:
            raise ValueError(f"target: {type(model).__name__} has no LM head (output embeddings)")
        self.vocab_size, self.hidden_size = model.get_input_embeddings().weight.shape
        # Without labels, layers after the last needed id never run and, once dropped, hold no
        # memory; labels need every layer, the final norm and the LM head.
        kept_layers = layers if self.runs_head else nn.ModuleList(layers[: self.layer_ids[-1] + 1])
        setattr(base_model, layers_attribute, kept_layers)
        self.model = model
        self.base_model = base_model
        self._capture_BTnH: torch.Tensor | None = None
        self._filled_slots: set[int] = set()
        for slot, layer_id in enumerate(self.layer_ids):
            kept_layers[layer_id].register_forward_hook(self._make_hook(slot))

    @property
    def runs_head(self) -> bool:
        """Whether captures also run the final norm and LM head (target labels or soft targets)."""
        return self.predict_labels or self.topk > 0

    @property
    def device(self) -> torch.device:
        return self.embedding_weight().device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight().dtype

    def embedding_weight(self) -> torch.Tensor:
        """The input embedding `(V, H)`, frozen, on the model's device (cutting layers keeps it)."""
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head `(V, H)`; the embedding tensor itself when the checkpoint ties them."""
        return self.model.get_output_embeddings().weight

    def _make_hook(self, slot: int):
        def write_layer_output(module, args, output):
            if self._capture_BTnH is None:
                return  # a forward outside `capture`; nothing to record
            hidden_BTH = output[0] if isinstance(output, tuple) else output
            self._capture_BTnH[:, :, slot].copy_(hidden_BTH)
            self._filled_slots.add(slot)

        return write_layer_output

    @torch.inference_mode()
    def capture(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        """Outputs of the `layer_ids` layers for a right-padded batch: `(B, T, n, H)` in the model dtype."""
        return self._forward(input_ids_BT, attention_mask_BT)[0]

    @torch.inference_mode()
    def capture_with_labels(self, input_ids_BT: torch.Tensor,
                            attention_mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`capture`'s features and the target's labels `(B, T)` int32 from the same forward
        (`capture_head` without soft targets)."""
        if not self.predict_labels:
            raise ValueError("capture_with_labels: the target was loaded without predict_labels")
        captured_BTnH, head = self.capture_head(input_ids_BT, attention_mask_BT)
        return captured_BTnH, head["labels"]

    @torch.inference_mode()
    def capture_head(self, input_ids_BT: torch.Tensor,
                     attention_mask_BT: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`capture`'s features and what the LM head says, aligned as labels are: row p describes
        the target's next token after reading the tokens before p (the logits at position p - 1).

        `labels (B, T)` int32 with `predict_labels`: the greedy (argmax) token; row 0 has no
        prediction and keeps its own token. `topk_ids (B, T, k)` int32 and `topk_probs (B, T, k)`
        float32 with `topk`: the k most likely tokens at temperature 1 and their probabilities;
        row 0 holds zeros. Everything stays on the device (no host sync).
        """
        if not self.runs_head:
            raise ValueError("capture_head: the target was loaded without predict_labels or topk")
        captured_BTnH, last_BTH = self._forward(input_ids_BT, attention_mask_BT)
        batch_size, seq_len = last_BTH.shape[:2]
        # Every row through the head (the last one's prediction is not needed: one row in T) rather
        # than copying the (B, T-1, H) slice into a contiguous buffer first.
        last_RH = last_BTH.reshape(-1, self.hidden_size)
        head = {}
        if self.predict_labels:
            next_BT = greedy_tokens(last_RH, self.lm_head_weight()).view(batch_size, seq_len)
            head["labels"] = torch.empty_like(next_BT)
            head["labels"][:, 0] = input_ids_BT[:, 0].to(next_BT.device, non_blocking=True)
            head["labels"][:, 1:] = next_BT[:, :-1]
        if self.topk:
            ids_Rk, probs_Rk = topk_distribution(last_RH, self.lm_head_weight(), self.topk)
            for name, values_Rk in (("topk_ids", ids_Rk), ("topk_probs", probs_Rk)):
                shifted_BTk = torch.zeros((batch_size, seq_len, self.topk), dtype=values_Rk.dtype,
                                          device=values_Rk.device)
                shifted_BTk[:, 1:] = values_Rk.view(batch_size, seq_len, self.topk)[:, :-1]
                head[name] = shifted_BTk
        return captured_BTnH, head

    def _forward(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor):
        """`(features (B, T, n, H), final normed hidden (B, T, H) or None)` for a right-padded batch.

        Rows at padded positions hold whatever the model computed there; callers keep only
        the first `attention_mask_BT[b].sum()` rows of each sequence.

        The model runs without the mask. In a causal LM a position only sees the positions
        before it, so right padding cannot change a real row (tests compare every row with the
        same sequence run alone, Qwen3.5 and Llama). The mask would only change the padded
        rows. Passing it costs host-device syncs in transformers: for Qwen3.5, 3 per forward (the
        `padding_mask.all()` checks of masking_utils and of the linear-attention layers) instead
        of the one left without it (its packed-sequence check of the position ids). Each sync
        idles the GPU until this thread launches again. The mask also keeps SDPA off its
        causal kernels.
        """
        if input_ids_BT.ndim != 2 or input_ids_BT.shape != attention_mask_BT.shape:
            raise ValueError(f"capture: input_ids {tuple(input_ids_BT.shape)} and attention_mask "
                             f"{tuple(attention_mask_BT.shape)} must be the same (B, T) shape")
        # sync: once per batch, negligible next to the target forward. A left-padded or holed
        # mask would silently shift every state the store receives.
        if bool((attention_mask_BT[:, 1:] > attention_mask_BT[:, :-1]).any()):
            raise ValueError("capture: attention_mask is not right-padded (a 0 is followed by a 1)")
        batch_size, seq_len = input_ids_BT.shape
        self._capture_BTnH = torch.empty(
            batch_size, seq_len, len(self.layer_ids), self.hidden_size, dtype=self.dtype, device=self.device
        )
        self._filled_slots = set()
        try:
            output = self.base_model(input_ids=input_ids_BT.to(self.device, non_blocking=True), use_cache=False)
            captured_BTnH = self._capture_BTnH
        finally:
            self._capture_BTnH = None
        if len(self._filled_slots) != len(self.layer_ids):
            missed = [self.layer_ids[s] for s in range(len(self.layer_ids)) if s not in self._filled_slots]
            raise RuntimeError(f"capture: decoder layers {missed} did not run in {type(self.base_model).__name__}")
        # The base model's last_hidden_state has been through the final norm (what the LM head reads).
        return captured_BTnH, (output.last_hidden_state if self.runs_head else None)


def compile_decoder_layers(target: "TargetModel") -> int:
    """Regional compile: every kept decoder layer's `forward` through `torch.compile` (CUDA).

    Only the forward is wrapped, so the capture hooks stay eager around it. With parameters as
    graph inputs (inline_inbuilt_nn_modules, the default) the layers of one type share their
    graph; the second distinct (batch, length) shape compiles a shape-generic one. It fuses the
    layers' elementwise work (norms, rotary, gates, SwiGLU) that the eager forward runs as
    separate kernels. Returns the number of layers wrapped.
    """
    _, _, layers = find_decoder_layers(target.model)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return len(layers)


def load_target(
    path: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    layer_ids: list[int] | None = None,
    predict_labels: bool = False,
    topk: int = 0,
) -> TargetModel:
    """Load a causal LM checkpoint directory as a frozen `TargetModel` on `device`.

    `layer_ids=None` picks `default_layer_ids(num_layers)`. Qwen3.5/3.6 vision-language
    checkpoints load as their text model. flash-linear-attention is used by transformers
    itself when it is importable. `predict_labels` keeps the whole model for
    `capture_with_labels`; `topk` (soft targets) keeps it for `capture_head`.
    """
    device = torch.device(device)
    config_hash, config_dict = read_config_hash(path)
    model = load_causal_lm(path, dtype, device)
    if layer_ids is None:
        _, _, layers = find_decoder_layers(model)
        layer_ids = default_layer_ids(len(layers))
    target = TargetModel(model, layer_ids, config_hash, config_dict.get("model_type", model.config.model_type),
                         predict_labels=predict_labels, topk=topk)
    # Move only after the cut, so dropped layers never reach the device.
    target.model.to(device)
    return target
