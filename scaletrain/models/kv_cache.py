"""Key/value cache for incremental decoding: per-layer buffers sized for the longest sequence, filled by the model's
forward when one is passed (`model(tokens, cache=cache)`). Training never passes one, so its path is unchanged.
"""

from __future__ import annotations

import torch

from scaletrain.models.attention import attention_masks


class LayerCache:
    """One layer's keys and values, [batch, kv_heads, max_len, head_dim] (MLA: its latent and rotary key),
    allocated at the first update with the dtype and device of the keys (so a bf16 autocast forward caches bf16)."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values ([batch, kv_heads, new, head_dim]) after the cached ones;
        return the keys and values of every position so far."""
        start, new = self.owner.pos, k.shape[2]
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.owner.max_len, k.shape[3])
            self.k = k.new_zeros(shape)
            # MLA caches its latent as k and its rotary key, narrower, as v.
            self.v = v.new_zeros((*shape[:3], v.shape[3]))
        self.k[:, :, start : start + new] = k
        self.v[:, :, start : start + new] = v
        if start == 0:
            # The prompt: attend over the fresh tensors, exactly as the uncached forward does.
            return k, v
        return self.k[:, :, : start + new], self.v[:, :, : start + new]


class KVCache:
    """Keys and values of the layers 0..n_layers-1 for sequences of up to `max_len` tokens (at most the model's
    max_seq_len); `pos` counts the tokens already in it. The first forward (pos 0) runs the model's own causal
    path; later ones attend from the new positions to every cached one, through a boolean mask offset by `pos`
    (and each layer's sliding window)."""

    def __init__(self, n_layers: int, max_len: int):
        if max_len < 1:
            raise ValueError(f"cache length {max_len} must be >= 1")
        self.max_len, self.pos = max_len, 0
        self.layers = {str(i): LayerCache(self) for i in range(n_layers)}

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """The RoPE positions of `new` tokens appended to the cache."""
        if self.pos + new > self.max_len:
            raise ValueError(f"{self.pos} cached + {new} new tokens exceed the cache's {self.max_len}")
        return torch.arange(self.pos, self.pos + new, device=device)

    def masks(
        self, backend: str, windows: set[int], new: int, device: torch.device
    ) -> dict[int, object] | None:
        """The attention mask of each window for `new` tokens appended to the cache (`attention_masks`'s
        convention: None where plainly causal)."""
        if self.pos == 0:
            return attention_masks(backend, windows, None, new, device)
        i = torch.arange(self.pos, self.pos + new, device=device)[:, None]  # absolute query positions
        j = torch.arange(self.pos + new, device=device)[None, :]
        out: dict[int, object] = {}
        for w in windows:
            keep = j <= i
            if w > 0:
                keep = keep & (i - w < j)
            out[w] = keep[None, None]
        return out

    def advance(self, new: int) -> None:
        self.pos += new
