"""A photographic test set: JPEGs with natural statistics, ImageNet's sizes and its file kinds.

Use when: a benchmark or test must see what users have (issue #30): photos of mixed sizes and
encodings, not one size of smooth generated content (`recipes.testing.make_image_folder`).
Cost: about 40 ms of CPU per image over ImageNet's mix of sizes (720 images: 29 CPU-seconds,
~15 s in the two processes of an idle 2-core machine; 115 MB). Content is composed at most
768 px on a side; larger images (6% of the set, 1% up to 4000 px) are upscaled and given
their finer octaves from a periodic 1/f tile.
Adapt here: `plan_photos` (the size distribution and the shares of each file kind) and
`photo_image` (the content).
Trade-off: the content is a model (dead leaves over 1/f noise), not a photo. Its power
spectrum falls as 1/f^2 like a photo's (`spectrum_slope`: median -2.3, 90% within -1.9 to
-2.8); the generated set's noise octaves measure the same, what that set lacks is ImageNet's
sizes, sharp occlusions, textures and file kinds. JPEG sizes and decode times carry over;
objects, and so accuracy, do not.

Sizes follow ImageNet's: most 500 px on the long side (median 500x375), a lognormal spread
from 100 px, a tail to 4000 px; a quarter portrait. Most short sides are under 512, so a
224 px eval crop (resized from 256) rarely gets a 1/2 DCT-scaled decode. Kinds: quality
75-95, chroma 4:2:0 or (20%) 4:4:4, 10% progressive, 3% grayscale (L), 1% CMYK (with black),
5% with an EXIF orientation other than 1 (pixels stored as-is, the tag says how to show them).
Each rare kind appears at least once in a set of 8 or more.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PHOTOS_VERSION = 1  # bump when the set changes: benchmarks key their cached copies by it
_WORK_SIDE = 768  # content is composed at most this large, then upscaled
_SHARES = {"progressive": 0.10, "gray": 0.03, "cmyk": 0.01, "exif": 0.05, "chroma444": 0.20}


@dataclass(frozen=True)
class PhotoSpec:
    """One file of the set: its stored size (EXIF orientation not applied) and encoding."""

    path: str  # relative to the root: class_XX/img_YYYY.jpg
    width: int
    height: int
    mode: str  # "RGB", "L" or "CMYK"
    quality: int
    subsampling: int  # Pillow's: 0 is 4:4:4, 2 is 4:2:0
    progressive: bool
    orientation: int  # EXIF tag 0x0112; 1 means none written


def plan_photos(images: int, *, classes: int = 10, seed: int = 0) -> list[PhotoSpec]:
    """The sizes and encodings of a set of `images` files (`make_photo_folder` writes them).

    Args:
        images: number of files.
        classes: class folders; image i goes to class i % classes.
        seed: the generator seed.
    """
    if images < 1 or classes < 1:
        raise ValueError(
            f"`images` and `classes` must be positive, but are {images} and {classes} instead."
        )
    rng = np.random.default_rng([seed, 30])
    kind = rng.random(images)
    long = np.where(kind < 0.62, 500, np.exp(rng.normal(np.log(400), 0.45, images)))
    big = kind > 0.94  # a tail: 1000-2500 px, and up to 4000 px for 1% of the set
    long = np.where(big, np.exp(rng.uniform(np.log(1000), np.log(2500), images)), long)
    long = np.where(kind > 0.99, rng.uniform(2500, 4000, images), long)
    long = np.clip(long, 100, 4000).round().astype(int)
    aspect = rng.choice([4 / 3, 4 / 3, 4 / 3, 3 / 2, 3 / 2, 1.0, 16 / 9, 1.25], images)
    short = np.maximum(64, (long / aspect).round().astype(int))
    portrait = rng.random(images) < 0.25
    flags = {name: _marked(rng, images, share) for name, share in _SHARES.items()}
    flags["cmyk"] &= ~flags["gray"]
    quality = rng.integers(75, 96, images)
    orientation = rng.integers(2, 9, images)
    width = np.where(portrait, short, long)
    height = np.where(portrait, long, short)
    mode = np.where(flags["gray"], "L", np.where(flags["cmyk"], "CMYK", "RGB"))
    subsampling = np.where(flags["chroma444"], 0, 2)
    orientation = np.where(flags["exif"], orientation, 1)
    return [
        PhotoSpec(
            f"class_{i % classes:02d}/img_{i:04d}.jpg",
            int(width[i]),
            int(height[i]),
            str(mode[i]),
            int(quality[i]),
            int(subsampling[i]),
            bool(flags["progressive"][i]),
            int(orientation[i]),
        )
        for i in range(images)
    ]


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _marked(rng: np.random.Generator, n: int, share: float) -> np.ndarray:
    """A mask of round(share * n) items, at least one once n >= 8, at random places."""
    count = max(int(round(share * n)), int(n >= 8))
    mask = np.zeros(n, bool)
    mask[rng.choice(n, size=min(count, n), replace=False)] = True
    return mask


def make_photo_folder(
    root: str | Path,
    *,
    images: int = 720,
    classes: int = 10,
    seed: int = 0,
    processes: int | None = None,
) -> Path:
    """Writes the photographic set `plan_photos(images, classes=classes, seed=seed)` as an
    ImageFolder tree, `root/class_XX/img_YYYY.jpg`; the same bytes for the same seed.

    Args:
        root: the folder to fill (created).
        images: number of files.
        classes: class folders.
        seed: the generator seed; image i draws from `(seed, i)`, so processes do not change it.
        processes: spawned processes that write images (the work holds the GIL: threads do
            not help); default one per core for 64 images or more, else none.

    Returns:
        `root` as a Path.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    root = Path(root)
    specs = plan_photos(images, classes=classes, seed=seed)
    for folder in sorted({s.path.split("/")[0] for s in specs}):
        (root / folder).mkdir(parents=True, exist_ok=True)
    if processes is None:
        processes = 0
        if images >= 64:
            processes = _usable_cpus()
    jobs = [(root, spec, seed, i) for i, spec in enumerate(specs)]
    if processes <= 1:
        for job in jobs:
            _write_photo(*job)
        return root
    # spawn: a fork of a parent with OpenCV or torch thread pools can hang (pytorch#1355)
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_write_photo, *zip(*jobs, strict=True), chunksize=8))
    return root


def _write_photo(root: Path, spec: PhotoSpec, seed: int, index: int) -> None:
    pixels = photo_image(spec.height, spec.width, np.random.default_rng([seed, index]))
    save_jpeg(pixels, root / spec.path, spec)


def save_jpeg(rgb: np.ndarray, path: str | Path, spec: PhotoSpec) -> None:
    """Writes `rgb` (uint8 [H, W, 3]) as `spec` says: mode, quality, chroma, progressive, EXIF."""
    from PIL import Image

    image = Image.fromarray(rgb)
    if spec.mode == "L":
        image = image.convert("L")
    elif spec.mode == "CMYK":  # with a black plate (under-colour removal), as print workflows write
        k = 255 - rgb.max(axis=2, keepdims=True).astype(np.float32)
        cmy = (255 - rgb - k) / np.maximum(255 - k, 1) * 255
        cmyk = np.concatenate([cmy, k], axis=2).round().astype(np.uint8)
        image = Image.frombytes("CMYK", image.size, cmyk.tobytes())
    options = dict(quality=spec.quality, progressive=spec.progressive)
    if spec.mode == "RGB":
        options["subsampling"] = spec.subsampling
    if spec.orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = spec.orientation
        options["exif"] = exif.tobytes()
    image.save(path, "JPEG", **options)


def photo_image(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """An RGB uint8 `[height, width, 3]` image with natural statistics: a 1/f background with
    correlated colour, occluding shapes (dead leaves) with their own 1/f or oriented textures
    and sharp or defocused edges, sensor noise. Composed at most 1024 px on a side; a larger
    image is upscaled and given the missing fine octaves from a periodic 1/f tile."""
    import cv2

    scale = min(1.0, _WORK_SIDE / max(height, width))
    h = max(8, round(height * scale))
    w = max(8, round(width * scale))
    mean = (rng.uniform(70, 170) + rng.normal(0, 20, 3)).astype(np.float32)
    tint = (1 + rng.normal(0, 0.15, 3)).astype(
        np.float32
    )  # luminance moves all channels: correlated colour
    image = mean + 30 * _pink((h, w), 2.2, rng)[..., None] * tint
    # chroma varies smoothly (opponent red-green and blue-yellow fields): made at 1/4 size
    ch = max(8, h // 4)
    cw = max(8, w // 4)
    opponent = np.array([[1, -1, 0], [0.5, 0.5, -1]], np.float32)
    chroma = np.stack([_pink((ch, cw), 2.6, rng) for _ in range(2)], -1) @ (8 * opponent)
    image += cv2.resize(chroma, (w, h), interpolation=cv2.INTER_LINEAR)
    pool = _texture_pool()
    textures = [pool[k] for k in rng.choice(len(pool), 4, replace=False)]
    for _ in range(int(rng.integers(16, 48))):
        _add_shape(image, textures, mean, rng)
    if rng.random() < 0.15:  # slightly out of focus
        image = cv2.GaussianBlur(image, (0, 0), float(rng.uniform(0.5, 1.2)))
    if scale < 1:
        sigma = float(image.mean(axis=2).std())
        image = cv2.resize(image, (width, height), interpolation=cv2.INTER_CUBIC)
        # 1/f^2 power puts equal variance in every octave: continue the spectrum above the
        # composed image's Nyquist frequency, 0.5 * scale cycles per pixel
        detail = sigma * np.sqrt(np.log(1 / scale) / np.log(0.5 * _WORK_SIDE))
        tile = _pink((512, 512), 2.0, rng, low_cut=0.5 * scale)
        ty = -(-height // 512)
        tx = -(-width // 512)
        image += detail * np.tile(tile, (ty, tx))[:height, :width, None]
    image += np.float32(rng.uniform(1, 4)) * rng.standard_normal(
        (height, width, 1), np.float32
    )  # grain
    return np.clip(image, 0, 255).astype(np.uint8)


def _pink(
    shape: tuple[int, int], exponent: float, rng: np.random.Generator, low_cut: float = 0.0
) -> np.ndarray:
    """A periodic float32 field of unit variance whose power falls as 1/f^`exponent` (zero
    below `low_cut` cycles per pixel)."""
    h, w = shape
    f, log_f = _frequencies(h, w)
    amplitude = np.exp(np.float32(-exponent / 2) * log_f)
    amplitude[0, 0] = 0.0
    if low_cut:
        amplitude[f < low_cut] = 0.0
    spectrum = (
        rng.standard_normal((h, w // 2 + 1, 2), np.float32).view(np.complex64)[..., 0] * amplitude
    )
    field = np.fft.irfft2(spectrum, s=shape).astype(np.float32)
    return field / max(float(field.std()), 1e-6)


@functools.lru_cache(maxsize=1)
def _texture_pool() -> tuple[np.ndarray, ...]:
    """Periodic 256x256 textures every image draws from (fixed, made once per process): 1/f
    noise from fine (foliage, gravel) to coarse (clouds, skin), and oriented (fabric, bark)."""
    rng = np.random.default_rng(30)
    pink = [_pink((256, 256), exponent, rng) for exponent in np.linspace(1.0, 2.4, 12)]
    return tuple(pink + [_stripes(rng) for _ in range(4)])


@functools.lru_cache(maxsize=8)
def _frequencies(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """The radial frequency (cycles per pixel) of each rfft2 coefficient, and its log (0 at DC)."""
    f = np.hypot(
        np.fft.fftfreq(h).astype(np.float32)[:, None], np.fft.rfftfreq(w).astype(np.float32)[None]
    )
    f[0, 0] = 1.0
    return f, np.log(f)


def _stripes(rng: np.random.Generator) -> np.ndarray:
    """A periodic oriented texture (fabric, bark, grass): power along one direction only."""
    h = w = 256
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None]
    angle = rng.uniform(0, np.pi)
    along = np.abs(fx * np.cos(angle) + fy * np.sin(angle))
    across = np.abs(-fx * np.sin(angle) + fy * np.cos(angle))
    amplitude = np.exp(-((across / 0.01) ** 2)) / np.maximum(along, 1 / h)
    amplitude[0, 0] = 0.0
    spectrum = (
        rng.standard_normal(amplitude.shape) + 1j * rng.standard_normal(amplitude.shape)
    ) * amplitude
    field = np.fft.irfft2(spectrum, s=(h, w)).astype(np.float32)
    return field / max(float(field.std()), 1e-6)


def _add_shape(
    image: np.ndarray, textures: list[np.ndarray], mean: np.ndarray, rng: np.random.Generator
) -> None:
    """Paints one occluding shape (ellipse, polygon or rectangle) in place: radius from a power
    law (the dead-leaves model of natural images), a flat colour near the scene's, a texture,
    a shading ramp, and a sharp or (30%) soft edge."""
    import cv2

    h, w = image.shape[:2]
    side = min(h, w)
    # radius density r^-2: many small leaves, a few large
    small = side / 40
    large = side / 1.5
    radius = max(2, int(1 / (1 / small - rng.random() * (1 / small - 1 / large))))
    cy = int(rng.integers(0, h))
    cx = int(rng.integers(0, w))
    y0 = max(0, cy - radius)
    y1 = min(h, cy + radius + 1)
    x0 = max(0, cx - radius)
    x1 = min(w, cx + radius + 1)
    mask = np.zeros((y1 - y0, x1 - x0), np.uint8)
    center = (cx - x0, cy - y0)
    form = rng.integers(0, 3)
    if form == 0:
        axes = (radius, max(1, int(radius * rng.uniform(0.3, 1.0))))
        cv2.ellipse(mask, center, axes, float(rng.uniform(0, 180)), 0, 360, 255, -1, cv2.LINE_AA)
    else:
        if form == 2:
            corners = int(rng.integers(3, 8))
            angles = np.sort(rng.uniform(0, 2 * np.pi, corners))
        else:
            angles = (
                rng.uniform(0, np.pi / 2) + np.arange(4) * np.pi / 2 + rng.uniform(-0.4, 0.4, 4)
            )
        points = np.stack(
            [center[0] + radius * np.cos(angles), center[1] + radius * np.sin(angles)], 1
        )
        cv2.fillPoly(mask, [points.round().astype(np.int32)], 255, cv2.LINE_AA)
    alpha = mask.astype(np.float32) / 255
    if rng.random() < 0.3:
        alpha = cv2.GaussianBlur(alpha, (0, 0), float(rng.uniform(1, 4)))
    texture = textures[int(rng.integers(0, len(textures)))]
    rows = (np.arange(y0, y1) + int(rng.integers(0, 256))) % 256
    cols = (np.arange(x0, x1) + int(rng.integers(0, 256))) % 256
    colour = np.clip(mean * rng.uniform(0.4, 1.6) + rng.normal(0, 30, 3), 10, 245).astype(
        np.float32
    )
    ramp = np.linspace(-1, 1, x1 - x0, dtype=np.float32)[None] * np.float32(rng.normal(0, 0.15))
    paint = (
        colour * (1 + np.float32(rng.uniform(0.1, 0.4)) * texture[rows][:, cols] + ramp)[..., None]
    )
    region = image[y0:y1, x0:x1]
    region += alpha[..., None] * (paint - region)


def spectrum_slope(image: np.ndarray, low: float = 0.01, high: float = 0.3) -> float:
    """The log-log slope of an image's radially averaged power spectrum between `low` and `high`
    cycles per pixel (about -2 for photographs; smooth content falls faster). Grey levels of
    the whole image, Hann-windowed so its borders add no spurious 1/f^2 power."""
    gray = image.astype(np.float64)
    if gray.ndim == 3:
        gray = gray.mean(axis=2)
    h, w = gray.shape
    window = np.hanning(h)[:, None] * np.hanning(w)[None]
    power = np.abs(np.fft.rfft2((gray - gray.mean()) * window)) ** 2
    f = np.hypot(np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None])
    edges = np.geomspace(low, high, 16)
    which = np.digitize(f.ravel(), edges)
    centers = []
    means = []
    for k in range(1, len(edges)):
        in_bin = which == k
        if in_bin.any():
            centers.append(np.sqrt(edges[k - 1] * edges[k]))
            means.append(power.ravel()[in_bin].mean())
    return float(np.polyfit(np.log(centers), np.log(means), 1)[0])
