"""Inductor's choices with flex attention's backward configs on the kernel options' blocks.

A module of its own, imported only when a mask of tiles smaller than `tiles.TILE` compiles
(`masks.backward_configs_follow_options`), so importing dflash never imports inductor. The class lives
at module level because inductor pickles its config, this class included, into every FX graph cache key:
a class defined inside a function cannot be pickled, and every graph then compiled from scratch
(measured 12-06 on an H100: "Failed to pickle cache key" for each graph under 64-key tiles).
"""

import dataclasses

from torch._inductor.choices import InductorChoices


class ChoicesWithOptionsBlocks(InductorChoices):
    """Inductor's choices; flex attention's backward configs take the block sizes of the kernel
    options (`kernel_options(head_dim)`: `masks.flex_kernel_options`, set by `masks` when it hands out
    the class, so this module does not import `masks` back) where those set all four."""

    kernel_options = staticmethod(lambda head_dim: {})

    def get_flex_attention_bwd_configs(self, head_dim, dtype, device_type="cuda"):
        configs = super().get_flex_attention_bwd_configs(head_dim, dtype, device_type)
        options = self.kernel_options(head_dim)
        blocks = {name: options.get(name.upper()) for name in ("block_m1", "block_n1", "block_m2", "block_n2")}
        if None in blocks.values() or not configs:
            return configs
        return [dataclasses.replace(configs[-1], **blocks)]
