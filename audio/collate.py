"""Padded audio batches with lengths: waveforms `[B, C, T_max]` or features `[B, n_mels, F_max]`.

Use when: batching items of different lengths (utterances, kept partial windows). Pair with
`LengthBucketSampler(lengths, max_tokens=...)` where the budget counts padded frames
(`batch * max_frames`), so a batch of long utterances stays within memory.
Cost: one allocation and one copy per item.
Adapt here: `pad_value` (e.g. log(1e-6) for log-mel features), `pad_to_multiple_of`.
Trade-off: none beyond padding itself; `lengths` lets the model mask it.
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class AudioPadCollate:
    """Pads `(tensor [..., T], info)` items along the last axis.

    Returns `{"inputs": [B, ..., T_max], "lengths": [B], "file": [B], "start": [B]}` where
    `lengths` holds each item's valid frames (`info["frames"]`, else its last dimension), so
    zero-padded windows are masked too.

    Args:
        pad_value: the fill for padding.
        pad_to_multiple_of: round T_max up to a multiple of this.
    """

    def __init__(self, pad_value: float = 0.0, *, pad_to_multiple_of: int = 1):
        if pad_to_multiple_of <= 0:
            raise ValueError(
                f"`pad_to_multiple_of` must be positive, but is {pad_to_multiple_of!r} instead."
            )
        self.pad_value = pad_value
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, batch: Sequence) -> dict[str, torch.Tensor]:
        if not batch:
            raise ValueError("AudioPadCollate got an empty batch.")
        tensors, infos = zip(
            *[_split(item, position) for position, item in enumerate(batch)], strict=True
        )
        lead = tensors[0].shape[:-1]
        for position, t in enumerate(tensors):
            if t.shape[:-1] != lead:
                raise TypeError(
                    f"AudioPadCollate: item {position} has shape {tuple(t.shape)}, item 0 has "
                    f"{tuple(tensors[0].shape)}; only the last (time) axis may differ."
                )
        m = self.pad_to_multiple_of
        width = -(-max(t.shape[-1] for t in tensors) // m) * m
        inputs = torch.full((len(tensors), *lead, width), self.pad_value, dtype=tensors[0].dtype)
        for i, t in enumerate(tensors):
            inputs[i, ..., : t.shape[-1]] = t
        lengths = torch.tensor(
            [info.get("frames", t.shape[-1]) for t, info in zip(tensors, infos, strict=True)]
        )
        out = {"inputs": inputs, "lengths": lengths}
        for key in ("file", "start"):
            if all(key in info for info in infos):
                out[key] = torch.tensor([info[key] for info in infos])
        return out


def _split(item, position: int) -> tuple[torch.Tensor, Mapping]:
    if isinstance(item, torch.Tensor):
        return item, {}
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor):
        if isinstance(item[1], Mapping):
            return item[0], item[1]
        return item[0], {}
    raise TypeError(
        f"AudioPadCollate: item {position} is {type(item).__name__}; expected a tensor or "
        "(tensor, info)."
    )


pad_collate = AudioPadCollate()
