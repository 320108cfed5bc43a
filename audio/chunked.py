"""ChunkedAudioDataset: fixed windows of long recordings, read by seeking, never whole files.

Use when: training on windows (e.g. 4 s) of long recordings (minutes to hours). Loading a
whole 30-minute file to keep 4 seconds of it reads, decodes and holds 450x more samples than
needed; this dataset seeks to the window and decodes only its frames.
Cost: the index reads file headers only (`soundfile.info`, ~0.1 ms a file) plus a tail read to
catch truncated files; an item is one seek + one read of the window (FLAC seeks by its seek
table or bisection) and, when `sample_rate` differs, one resample with a cached kernel.
Memory per item is proportional to the window, not the file.
Adapt here: `_windows` for other chunking rules; `mono` averaging.
Trade-off: windows are resampled independently, so a resampled window's first and last few
samples see zero padding instead of their neighbours (under 1 ms at 16 kHz).

Boundaries (`last_chunk`): a final partial window that holds frames no earlier window covers
(and a file shorter than one window) is zero-padded to the window with its valid frame count
reported ("pad", so a loss can mask), returned shorter ("keep"), or dropped ("drop").
Copy with: common/caches/packed_strings.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.common.caches.packed_strings import PackedStrings, resolve_index

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".oga", ".aiff", ".aif")
_OPEN_FILES = 16  # per process
# Header sanity bounds: what a real recording can claim (a corrupt header claims anything).
MIN_RATE = 1_000
MAX_RATE = 768_000
MAX_CHANNELS = 256
MAX_SECONDS = 7 * 24 * 3600
MAX_RESAMPLE_TAPS = 4_000_000  # 16 MiB of float32 kernel


class AudioDecodeError(ValueError):
    """An audio file that cannot be read; the message names the file."""


class ChunkedAudioDataset(Dataset):
    """Windows (or whole files) of audio as `(float32 [C, T] waveform, info)`.

    Args:
        files: audio file paths, or one folder searched recursively for audio files.
        chunk_seconds: window length; None gives one item per file (utterance mode).
        hop_seconds: window step; `chunk_seconds` (no overlap) by default.
        sample_rate: output rate; None keeps the files' rate (which must agree).
        mono: average channels to one.
        last_chunk: "pad", "keep" or "drop" the final partial window (see module docstring).

    `info` is `{"file": file index, "start": start second, "frames": valid frames}`; C = 1
    when `mono`; T is the window at the output rate (or the valid frames with "keep").

    Raises:
        AudioDecodeError: an unreadable, empty, truncated or non-audio file (at construction).
        ValueError: invalid arguments, no files, or differing rates with `sample_rate=None`.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike] | str | os.PathLike,
        *,
        chunk_seconds: float | None = None,
        hop_seconds: float | None = None,
        sample_rate: int | None = None,
        mono: bool = True,
        last_chunk: Literal["pad", "keep", "drop"] = "pad",
    ):
        for name, value in (
            ("chunk_seconds", chunk_seconds),
            ("hop_seconds", hop_seconds),
            ("sample_rate", sample_rate),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")
        if hop_seconds is not None and chunk_seconds is None:
            raise ValueError("`hop_seconds` needs `chunk_seconds`.")
        if last_chunk not in ("pad", "keep", "drop"):
            raise ValueError(
                f"`last_chunk` must be 'pad', 'keep' or 'drop', but is {last_chunk!r} instead."
            )
        self.files = PackedStrings(_list_files(files))
        self.chunk_seconds = chunk_seconds
        self.hop_seconds = hop_seconds
        if hop_seconds is None:
            self.hop_seconds = chunk_seconds
        self.mono = mono
        self.last_chunk = last_chunk
        self.file_frames, self.file_rates, self.file_channels = _read_headers(self.files)
        self.sample_rate = sample_rate
        if sample_rate is None:
            self.sample_rate = _common_rate(self.files, self.file_rates)
        for rate in np.unique(self.file_rates).tolist():
            if rate != self.sample_rate:
                f = int(np.flatnonzero(self.file_rates == rate)[0])
                check_resampling(self.files[f], int(rate), self.sample_rate)
        self.item_file, self.item_start, self.item_frames = self._windows()
        self._handles: OrderedDict | None = None
        self._handles_pid: int | None = None
        self._resamplers: dict = {}

    # ---- the index ---------------------------------------------------------------------
    def _windows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(file, start frame, valid frames) per item, in source frames, as numpy arrays."""
        if self.chunk_seconds is None:  # utterances: one item per non-empty file
            keep = np.flatnonzero(self.file_frames > 0)
            return (
                keep.astype(np.int32),
                np.zeros(len(keep), np.int64),
                self.file_frames[keep].copy(),
            )
        files = []
        starts = []
        frames = []
        for f, (total, rate) in enumerate(
            zip(self.file_frames.tolist(), self.file_rates.tolist(), strict=True)
        ):
            if total == 0:
                continue
            chunk = max(1, round(self.chunk_seconds * rate))
            hop = max(1, round(self.hop_seconds * rate))
            full = 0 if total < chunk else 1 + (total - chunk) // hop
            file_starts = np.arange(full, dtype=np.int64) * hop
            file_frames = np.full(full, chunk, dtype=np.int64)
            covered = (full - 1) * hop + chunk if full else 0
            if covered < total and self.last_chunk != "drop":  # frames no full window holds
                file_starts = np.append(file_starts, full * hop)
                file_frames = np.append(file_frames, total - full * hop)
            files.append(np.full(len(file_starts), f, dtype=np.int32))
            starts.append(file_starts)
            frames.append(file_frames)
        if not files:
            return np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(files), np.concatenate(starts), np.concatenate(frames)

    def __len__(self) -> int:
        return len(self.item_file)

    @property
    def lengths(self) -> np.ndarray:
        """Valid frames of every item at the output rate (for `LengthBucketSampler`)."""
        rates = self.file_rates[self.item_file]
        return np.round(self.item_frames * (self.sample_rate / rates)).astype(np.int64)

    # ---- reading -----------------------------------------------------------------------
    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict]:
        i = resolve_index(index, len(self), f"the {len(self)} audio items")
        f = int(self.item_file[i])
        start = int(self.item_start[i])
        valid = int(self.item_frames[i])
        rate = int(self.file_rates[f])
        wave = self._read(f, start, valid, i)
        if rate != self.sample_rate:
            wave = self._resampler(rate)(wave)
        out_valid = wave.shape[-1]
        if self.chunk_seconds is not None and self.last_chunk == "pad":
            target = max(1, round(self.chunk_seconds * self.sample_rate))
            if wave.shape[-1] < target:
                wave = torch.nn.functional.pad(wave, (0, target - wave.shape[-1]))
            wave = wave[..., :target]
            out_valid = min(out_valid, target)
        return wave, {"file": f, "start": start / rate, "frames": out_valid}

    def _read(self, f: int, start: int, frames: int, index: int) -> torch.Tensor:
        import soundfile as sf

        where = f"audio file {self.files[f]!r} (item {index})"
        try:
            handle = self._handle(f)
            handle.seek(start)
            data = handle.read(frames, dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, OSError) as error:
            self._forget(f)
            raise AudioDecodeError(
                f"{where}: reading frames {start}-{start + frames} failed ({error}); the file "
                "may have been removed, truncated or changed since indexing."
            ) from None
        if len(data) != frames:
            raise AudioDecodeError(
                f"{where}: {len(data)} of {frames} frames at {start} could be read; the file "
                "is truncated or changed since indexing."
            )
        wave = torch.from_numpy(data.T.copy())  # [C, T]
        if self.mono and wave.shape[0] > 1:
            return wave.mean(dim=0, keepdim=True)
        return wave

    def _handle(self, f: int):
        """An open `SoundFile` per file, at most `_OPEN_FILES` per process (LRU)."""
        import soundfile as sf

        if self._handles_pid != os.getpid():
            self._handles = OrderedDict()
            self._handles_pid = os.getpid()
        handles = self._handles
        if f in handles:
            handles.move_to_end(f)
            return handles[f]
        if len(handles) >= _OPEN_FILES:
            handles.popitem(last=False)[1].close()
        handles[f] = sf.SoundFile(self.files[f])
        return handles[f]

    def _forget(self, f: int) -> None:
        """Drops a failed file's handle, so a later read reopens it."""
        if self._handles is not None and f in self._handles:
            with contextlib.suppress(Exception):
                self._handles.pop(f).close()

    def _resampler(self, rate: int):
        """One `torchaudio.transforms.Resample` (kernel computed once) per rate pair."""
        if rate not in self._resamplers:
            import torchaudio

            self._resamplers[rate] = torchaudio.transforms.Resample(rate, self.sample_rate)
        return self._resamplers[rate]

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_handles=None, _handles_pid=None, _resamplers={})
        return state

    def __repr__(self) -> str:
        mode = "utterances"
        if self.chunk_seconds is not None:
            mode = f"{self.chunk_seconds}s windows"
        return (
            f"ChunkedAudioDataset({len(self.files)} files, {len(self)} items, {mode}, "
            f"{self.sample_rate} Hz)"
        )


def _list_files(files) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        root = Path(files)
        if not root.is_dir():
            raise ValueError(
                f"{root} is not a folder; pass a folder of audio files or a list of paths."
            )
        found = sorted(
            str(p) for p in root.rglob("*") if p.suffix.lower() in AUDIO_EXTENSIONS and p.is_file()
        )
        if not found:
            raise ValueError(
                f"No audio files under {root} (searched for {', '.join(AUDIO_EXTENSIONS)})."
            )
        return found
    found = [os.fspath(p) for p in files]
    if not found:
        raise ValueError("`files` is empty; pass at least one audio file.")
    return found


def _read_headers(files: PackedStrings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import soundfile as sf

    frames = np.zeros(len(files), np.int64)
    rates = np.zeros(len(files), np.int64)
    channels = np.zeros(len(files), np.int32)
    for i, path in enumerate(files):
        if not os.path.exists(path):
            raise AudioDecodeError(f"audio file {path!r} does not exist.")
        if os.path.getsize(path) == 0:
            raise AudioDecodeError(f"audio file {path!r} is empty (0 bytes).")
        try:
            info = sf.info(path)
        except (sf.LibsndfileError, RuntimeError) as error:
            raise AudioDecodeError(
                f"audio file {path!r} cannot be read ({error}); is it audio (WAV, FLAC, OGG)?"
            ) from None
        frames[i] = info.frames
        rates[i] = info.samplerate
        channels[i] = info.channels
        _check_header(path, info)
        _check_complete(path, info)
        if info.frames == 0:
            warnings.warn(
                f"audio file {path!r} has no frames; it contributes no items.", stacklevel=3
            )
    return frames, rates, channels


def _check_header(path: str, info) -> None:
    """Header fields a corrupt file can claim and a reader would trust: a sample rate of
    16 MHz once made the resampler ask for 519 GB (issue #10)."""
    if not MIN_RATE <= info.samplerate <= MAX_RATE:
        raise AudioDecodeError(
            f"audio file {path!r} claims a sample rate of {info.samplerate:,} Hz, outside "
            f"{MIN_RATE:,}-{MAX_RATE:,} Hz: its header is corrupt."
        )
    if not 1 <= info.channels <= MAX_CHANNELS:
        raise AudioDecodeError(
            f"audio file {path!r} claims {info.channels} channels (1-{MAX_CHANNELS} expected): "
            "its header is corrupt."
        )
    if info.frames < 0 or info.frames > MAX_SECONDS * info.samplerate:
        raise AudioDecodeError(
            f"audio file {path!r} claims {info.frames:,} frames "
            f"({info.frames / info.samplerate:,.0f} s, over {MAX_SECONDS // 3600} hours): its "
            "header is corrupt."
        )


def check_resampling(path: str, rate: int, target: int) -> None:
    """Refuses a rate pair whose resampling kernel (`rate/g x target/g` taps, g = gcd) would not
    fit in memory: 44,101 -> 16,000 Hz already needs 2.8 GB."""
    g = math.gcd(rate, target)
    taps = (rate // g) * (target // g)
    if taps > MAX_RESAMPLE_TAPS:
        raise AudioDecodeError(
            f"audio file {path!r}: resampling {rate:,} Hz to {target:,} Hz needs a "
            f"{taps * 4 / 2**20:,.0f} MiB kernel; the rate is unusual or corrupt. Resample the "
            "file offline (e.g. with sox) or pass sample_rate=None."
        )


def _check_complete(path: str, info) -> None:
    """Truncation: a WAV whose data chunk claims more bytes than the file has, or any file
    whose last frames cannot be read."""
    import soundfile as sf

    if info.format == "WAV":
        declared, available = _wav_data_sizes(path)
        if declared is not None and declared > available:
            raise AudioDecodeError(
                f"audio file {path!r} is truncated: its header declares {declared} bytes of "
                f"samples, the file holds {available}."
            )
    if info.frames == 0:
        return
    try:
        with sf.SoundFile(path) as f:
            tail = min(info.frames, 64)
            f.seek(info.frames - tail)
            if len(f.read(tail, dtype="float32")) != tail:
                raise AudioDecodeError(
                    f"audio file {path!r} is truncated: its last frames cannot be read."
                )
    except (sf.LibsndfileError, RuntimeError) as error:
        raise AudioDecodeError(
            f"audio file {path!r} is truncated or corrupt: reading its last frames "
            f"failed ({error})."
        ) from None


def _wav_data_sizes(path: str) -> tuple[int | None, int]:
    """(declared, available) bytes of a RIFF/WAVE `data` chunk; declared None when unknown."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(12)[8:12] != b"WAVE":
            return None, size
        while True:
            head = f.read(8)
            if len(head) < 8:
                return None, size
            chunk_id = head[:4]
            chunk_size = struct.unpack("<I", head[4:])[0]
            if chunk_id == b"data":
                declared = chunk_size
                if chunk_size in (0, 0xFFFFFFFF):  # streaming writers
                    declared = None
                return declared, size - f.tell()
            f.seek(chunk_size + (chunk_size & 1), os.SEEK_CUR)


def _common_rate(files: PackedStrings, rates: np.ndarray) -> int:
    distinct = np.unique(rates)
    if len(distinct) > 1:
        examples = ", ".join(
            f"{files[int(np.flatnonzero(rates == r)[0])]!r} at {int(r)} Hz" for r in distinct[:3]
        )
        raise ValueError(
            f"The files have different sample rates ({examples}); pass sample_rate= to resample "
            "them all to one rate."
        )
    return int(distinct[0])
