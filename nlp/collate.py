"""Dynamic padding: pad each batch to its own longest sample (rounded up), not a global max.

Use when: batching variable-length token sequences; with `LengthBucketSampler` the longest
sample of a batch is close to the rest, so little padding remains.
Cost: one `[B, T]` allocation and B row copies per batch.
Adapt here: `pad_to_multiple_of` (8 suits tensor cores), `padding_side`, labels.
Trade-off: every batch has a different T; compile-heavy models may prefer fixed buckets of T.
Copy with: nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.utils.data import get_worker_info


class PadCollate:
    """Pads `{"input_ids": LongTensor[L]}` items (or bare tensors) into a batch.

    Returns a dict with `input_ids [B, T]` (int64), `attention_mask [B, T]` (1 on real
    tokens), `lengths [B]` and, with `return_labels`, `labels [B, T]` (a copy of
    `input_ids` with `label_pad_id` on padding). T is the longest item rounded up to
    `pad_to_multiple_of`. B: batch, T: tokens.

    Args:
        pad_id: the tokenizer's pad token id.
        pad_to_multiple_of: round T up to a multiple of this.
        padding_side: "right" or "left" (left for decoder-only generation).
        return_labels: add `labels` for language modelling.
        label_pad_id: the label on padding (-100 is ignored by `cross_entropy`).
    """

    def __init__(
        self,
        pad_id: int,
        *,
        pad_to_multiple_of: int = 8,
        padding_side: str = "right",
        return_labels: bool = False,
        label_pad_id: int = -100,
    ):
        if pad_to_multiple_of <= 0:
            raise ValueError(
                f"`pad_to_multiple_of` must be positive, but is {pad_to_multiple_of!r} instead."
            )
        if padding_side not in ("right", "left"):
            raise ValueError(
                f"`padding_side` must be 'right' or 'left', but is {padding_side!r} instead."
            )
        self.pad_id = int(pad_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_side = padding_side
        self.return_labels = return_labels
        self.label_pad_id = label_pad_id

    def __call__(self, batch: Sequence) -> dict[str, torch.Tensor]:
        if not batch:
            raise ValueError("PadCollate got an empty batch.")
        rows = [self._ids(item, position) for position, item in enumerate(batch)]
        count = len(rows)
        lengths_list = [len(r) for r in rows]
        m = self.pad_to_multiple_of
        width = -(-max(lengths_list) // m) * m
        planes = 3 if self.return_labels else 2
        # One buffer for every output (shared memory inside a worker): a single segment
        # crosses to the main process instead of one per tensor.
        buffer = _new_int64(planes * count * width + count)
        input_ids = buffer[: count * width].view(count, width)
        attention_mask = buffer[count * width : 2 * count * width].view(count, width)
        lengths = buffer[planes * count * width :]
        lengths.copy_(torch.tensor(lengths_list, dtype=torch.int64))
        positions = torch.arange(width)
        if self.padding_side == "right":
            real = positions < lengths[:, None]
        else:
            real = positions >= (width - lengths)[:, None]
        attention_mask.copy_(real)
        input_ids.fill_(self.pad_id)
        input_ids[real] = torch.cat(rows) if count > 1 else rows[0]  # row-major order = item order
        out = {"input_ids": input_ids, "attention_mask": attention_mask, "lengths": lengths}
        if self.return_labels:
            labels = buffer[2 * count * width : 3 * count * width].view(count, width)
            labels.copy_(input_ids.masked_fill(~real, self.label_pad_id))
            out["labels"] = labels
        return out

    @staticmethod
    def _ids(item, position: int) -> torch.Tensor:
        ids = item["input_ids"] if isinstance(item, Mapping) else item
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids, dtype=torch.int64)
            except (TypeError, ValueError):
                raise TypeError(
                    f"PadCollate: item {position} has input_ids of type "
                    f"{type(ids).__name__}; expected a 1-D sequence of ints."
                ) from None
        if ids.dim() != 1:
            raise TypeError(
                f"PadCollate: item {position} has input_ids of shape {tuple(ids.shape)}; expected "
                "1-D."
            )
        return ids.long()


def _new_int64(numel: int) -> torch.Tensor:
    if get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(numel * 8, device="cpu")
        return torch.empty(0, dtype=torch.int64).set_(storage)
    return torch.empty(numel, dtype=torch.int64)
