"""The drafter's arguments for a store: sized from the target that wrote it (`drafter.size =
"auto"`), a named size or an export (`drafter.init_from`), checked against what the store holds
(target layer ids, hidden size, vocabulary, labels), with a mask token inside the vocabulary.
"""

from dflash.config import Config, ConfigError
from dflash.data.tokenizer import TOKENIZER_NAME
from dflash.model.drafter import AUTO_SIZE, DrafterArgs, auto_drafter_args, drafter_args
from dflash.model.export import load_exported
from dflash.recipe import MASK_TOKEN_ID
from dflash.store.schema import StoreMismatchError


def check_labels(config: Config, attrs: dict) -> None:
    """The labels stage two trains against are the store's; a config that asks for others is refused."""
    stored = attrs.get("labels", "data")
    if stored != config.store.labels:
        raise StoreMismatchError(f"store.labels: the store at {config.store.path} holds {stored} labels, the config "
                            f"asks for {config.store.labels}; run stage one with store.labels = "
                            f"{config.store.labels} (into another store.path) or set store.labels = {stored}")


def build_drafter_args(config: Config, attrs: dict) -> DrafterArgs:
    """The drafter's sizes (auto from the store's target, a named size, or an export), checked
    against the store (layer ids, hidden, vocab) and with a mask token inside the vocabulary."""
    if config.drafter.init_from:
        args, _ = load_exported(config.drafter.init_from)
    else:
        args = resolve_drafter_args(config, attrs)
    store_vocab = attrs["target"]["vocab_size"]
    expected = {
        "target_layer_ids": (list(args.target_layer_ids), list(attrs["target_layer_ids"])),
        "hidden_size": (args.hidden_size, attrs["hidden_size"]),
        "vocab_size": (args.vocab_size, store_vocab),
    }
    differing = {key: pair for key, pair in expected.items() if pair[0] != pair[1]}
    if differing:
        lines = [f"  {key}: drafter {mine!r} vs store {theirs!r}" for key, (mine, theirs) in differing.items()]
        raise StoreMismatchError(f"store {config.store.path} does not match drafter size {config.drafter.size!r}:\n"
                            + "\n".join(lines))
    if not 0 <= args.mask_token_id < store_vocab:
        raise StoreMismatchError(f"drafter.mask_token_id {args.mask_token_id} is outside the store vocabulary ({store_vocab})")
    return args


def resolve_drafter_args(config: Config, attrs: dict) -> DrafterArgs:
    drafter = config.drafter
    overrides = {key: value for key, value in {
        "num_layers": drafter.num_layers, "layer_types": drafter.layer_types,
        "sliding_window": drafter.sliding_window, "intermediate_size": drafter.intermediate_size}.items() if value}
    overrides.update(block_size=drafter.block_size, mask_token_id=store_mask_token(config, attrs),
                     num_target_layers=attrs["target"].get("num_hidden_layers", 0))
    try:
        if drafter.size == AUTO_SIZE:
            return auto_drafter_args(target_text_config(attrs), attrs["target_layer_ids"], **overrides)
        return drafter_args(drafter.size, **overrides)
    except ValueError as err:
        raise ConfigError(f"drafter.size = {drafter.size!r}: {err}") from None


def store_mask_token(config: Config, attrs: dict) -> int:
    """drafter.mask_token_id, or (-1) the unused special token stage one chose for this store."""
    if config.drafter.mask_token_id >= 0:
        return config.drafter.mask_token_id
    # Stores from before stage one chose one: the Qwen3.5/3.6 tokenizer's DFlash mask token.
    qwen = attrs.get("tokenizer", {}).get("name_or_path") == TOKENIZER_NAME
    chosen = attrs.get("mask_token_id", MASK_TOKEN_ID if qwen else None)
    if chosen is None:
        raise ConfigError(f"store {config.store.path}: the target's tokenizer has no special token unused by the "
                          f"data and its chat template; set drafter.mask_token_id to a token id the data never holds")
    return int(chosen)


def target_text_config(attrs: dict) -> dict:
    """The target's sizes from the store, or (stores older than `target_text_config`) its checkpoint."""
    if "target_text_config" in attrs:
        return attrs["target_text_config"]
    from transformers import AutoConfig

    from dflash.extract.target import text_config_summary

    path = attrs["target"]["path"]
    try:
        return text_config_summary(AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"drafter.size = 'auto' needs the target's config: the store predates "
                          f"target_text_config and {path} cannot be read ({err}); rerun stage one or set "
                          f"drafter.size") from None
