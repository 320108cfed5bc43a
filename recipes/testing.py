"""Builders of small, realistic data for tests and the default benchmarks.

Use when: a test or benchmark needs images, audio, text or a tokenizer without downloading
anything. Everything is generated from a seed, so runs are reproducible.
Cost: about 5 ms per 500x375 JPEG, 30 ms per minute of 16 kHz FLAC, a second or two to
train a 2k-token BPE tokenizer on a few thousand lines.
Adapt here: sizes, counts and distributions are keyword arguments.
Trade-off: synthetic content compresses like photos (multi-octave noise, edges) but is not a
photo; decode-speed ratios carry over, absolute accuracy numbers do not.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

# Lowercase syllables composed into a Zipf-distributed vocabulary of made-up words.
_SYLLABLES = "ka lo mi ne ru sa ti vo bel dan fer gon hul jis kor lum mar nes pol quin rast".split()


def natural_image(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """A BGR uint8 image with photo-like statistics: 1/f noise octaves, shapes with soft edges,
    textured regions (foliage, fur, fabric) beside smooth ones, and sensor grain.

    At 500x375 and JPEG quality 90 it compresses to about 50-70 KB.
    """
    import cv2

    image = np.zeros((height, width, 3), np.float32)
    for octave in range(1, 9):
        cells = 2**octave
        grid = rng.normal(0.0, 1.0, (cells, cells * width // height + 1, 3)).astype(np.float32)
        image += cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC) * (60.0 / octave)
    image += 128.0
    for _ in range(rng.integers(3, 8)):
        center = (int(rng.integers(0, width)), int(rng.integers(0, height)))
        color = tuple(float(c) for c in rng.integers(0, 256, 3))
        radius = int(rng.integers(min(height, width) // 12, min(height, width) // 3))
        cv2.circle(image, center, radius, color, thickness=-1, lineType=cv2.LINE_AA)
    mask = cv2.resize(rng.random((4, 5)).astype(np.float32), (width, height), interpolation=cv2.INTER_CUBIC)
    mask = np.clip((mask - 0.4) * 3.0, 0.0, 1.0)[..., None]
    texture = rng.normal(0.0, 18.0, (height // 2 + 1, width // 2 + 1)).astype(np.float32)
    image += mask * cv2.resize(texture, (width, height), interpolation=cv2.INTER_LINEAR)[..., None]
    image += rng.normal(0.0, 2.0, image.shape).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def make_image_folder(
    root: str | Path,
    *,
    classes: int = 3,
    per_class: int = 8,
    size: tuple[int, int] = (500, 375),
    quality: int = 90,
    seed: int = 0,
    jitter: float = 0.2,
) -> Path:
    """Writes `root/class_XX/img_YYYY.jpg` JPEGs like ImageNet's (about 500x375, quality 90).

    Args:
        root: the folder to fill (created).
        classes: number of class folders.
        per_class: images per class.
        size: (width, height) of a typical image; each varies by +-`jitter` and half are
            portrait, as in ImageNet.
        quality: JPEG quality.
        seed: the generator seed.
        jitter: relative size variation.

    Returns:
        `root` as a Path.
    """
    import cv2

    root = Path(root)
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = (int(s * rng.uniform(1 - jitter, 1 + jitter)) for s in size)
            if rng.random() < 0.3:
                w, h = h, w
            image = natural_image(h, w, rng)
            path = folder / f"img_{i:04d}.jpg"
            if not cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, quality]):
                raise OSError(f"OpenCV could not write {path}")
    return root


def make_int_shards(folder: str | Path, sizes: list[int]) -> list[str]:
    """Writes text shards of consecutive integers (shard k holds the next `sizes[k]` numbers,
    space-separated): sample identities for exactly-once tests of sharded readers.

    Returns:
        The shard paths, in order.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for k, size in enumerate(sizes):
        path = folder / f"s{k}.txt"
        path.write_text(" ".join(str(i) for i in range(start, start + size)))
        paths.append(str(path))
        start += size
    return paths


def make_audio_files(
    root: str | Path,
    *,
    count: int = 3,
    seconds: float | list[float] = 2.0,
    sample_rate: int = 16000,
    channels: int = 1,
    format: str = "FLAC",
    subtype: str | None = None,
    seed: int = 0,
) -> list[Path]:
    """Writes speech-like audio files (gliding harmonics, syllable envelope, noise).

    Args:
        root: the folder to fill (created).
        count: number of files.
        seconds: duration of every file, or one duration per file.
        sample_rate: frames per second.
        channels: 1 for mono, 2 for stereo.
        format: a soundfile format, `FLAC`, `WAV` or `OGG`.
        subtype: a soundfile subtype (e.g. `PCM_16`, `FLOAT`); the format's default when None.
        seed: the generator seed.

    Returns:
        The written paths, in order.
    """
    import soundfile as sf

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    durations = seconds if isinstance(seconds, list) else [seconds] * count
    suffix = {"FLAC": ".flac", "WAV": ".wav", "OGG": ".ogg"}[format.upper()]
    paths = []
    for i, duration in enumerate(durations):
        frames = int(round(duration * sample_rate))
        wave = np.stack([_speech_like(frames, sample_rate, rng) for _ in range(channels)], axis=1)
        path = root / f"audio_{i:04d}{suffix}"
        sf.write(path, wave, sample_rate, format=format, subtype=subtype)
        paths.append(path)
    return paths


def _speech_like(frames: int, sample_rate: int, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(frames, dtype=np.float64) / sample_rate
    pitch = 120.0 + 40.0 * np.sin(2 * np.pi * rng.uniform(0.1, 0.5) * t)
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(2.0, 5.0) * t)) ** 2
    noise = rng.normal(0.0, 0.02, frames)
    return (0.2 * voice * envelope + noise).astype(np.float32)


def make_text_corpus(count: int = 1000, *, median_words: int = 40, seed: int = 0) -> list[str]:
    """Sentences with a long-tailed (log-normal) length distribution and Zipfian words.

    Most samples are short and a few are 20x longer, as in chat, web or speech transcripts,
    which is what makes random batching waste padding.
    """
    rng = np.random.default_rng(seed)
    vocab = [
        "".join(rng.choice(_SYLLABLES, size=rng.integers(1, 4))) for _ in range(3000)
    ]
    ranks = np.arange(1, len(vocab) + 1)
    probs = (1.0 / ranks) / np.sum(1.0 / ranks)
    lengths = np.clip(rng.lognormal(np.log(median_words), 0.9, count), 1, 50 * median_words)
    texts = []
    for n in lengths.astype(int):
        words = rng.choice(len(vocab), size=n, p=probs)
        texts.append(" ".join(vocab[w] for w in words).capitalize() + ".")
    return texts


def train_tokenizer(texts: list[str], *, vocab_size: int = 2000, special_tokens=None):
    """A BPE `PreTrainedTokenizerFast` trained on `texts` with `[CLS] ... [SEP]` framing.

    Args:
        texts: the training corpus.
        vocab_size: target vocabulary size.
        special_tokens: mapping of role to token; defaults to pad/unk/cls/sep/mask.

    Returns:
        A `transformers.PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
        **(special_tokens or {}),
    }
    tokenizer = Tokenizer(models.BPE(unk_token=special["unk_token"]))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special.values()), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    cls, sep = special["cls_token"], special["sep_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B {sep}",
        special_tokens=[(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


class LocalHTTPServer:
    """A threaded HTTP server on 127.0.0.1 serving the files under `root`, with faults.

    For tests and benchmarks of remote (fsspec) reads against a real server: GET (with single
    byte ranges) and HEAD, plus switches a test can change at any time:

    Args:
        root: the folder served.
        latency: seconds slept before every response (object-store first-byte latency).
        bandwidth: bytes per second per connection (None: unlimited).
        fail_first: the first K GETs of each path answer 503.
        truncate_first: the first K full GETs of each path announce the full length but send half.

    `gets[path]` and `heads[path]` count the requests per path (path as in the URL), and
    `range_gets[(path, start)]` the ranged GETs per range start. Per range start, a test can
    set `fail_range[start] = K` (the first K answer 503), `short_range[start] = K` (the first K
    announce the range's length and send half) and `delay_range[start] = seconds`.

    Example:
        >>> with LocalHTTPServer(tmp_path, latency=0.02) as server:
        ...     fsspec.open(server.url("shard-0.bin")).open().read()
    """

    def __init__(self, root: str | Path, *, latency: float = 0.0, bandwidth: float | None = None,
                 fail_first: int = 0, truncate_first: int = 0):
        import collections
        import threading

        self.root = Path(root)
        self.latency, self.bandwidth = latency, bandwidth
        self.fail_first, self.truncate_first = fail_first, truncate_first
        self.gets: collections.Counter = collections.Counter()
        self.range_gets: collections.Counter = collections.Counter()
        self.fail_range: dict[int, int] = {}
        self.short_range: dict[int, int] = {}
        self.delay_range: dict[int, float] = {}
        self.heads: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self._server = None
        self._thread = None

    def __enter__(self) -> LocalHTTPServer:
        import http.server
        import threading

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def url(self, name: str = "") -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/{name}"

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler_for(server: LocalHTTPServer):
    import http.server
    import re
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def _file(self):
            rel = self.path.split("?")[0].lstrip("/")
            path = (server.root / rel).resolve()
            if server.root.resolve() not in path.parents or not path.is_file():
                return rel, None
            return rel, path

        def do_HEAD(self):
            rel, path = self._file()
            with server.lock:
                server.heads[rel] += 1
            time.sleep(server.latency)
            if path is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self):
            rel, path = self._file()
            with server.lock:
                server.gets[rel] += 1
                count = server.gets[rel]
            time.sleep(server.latency)
            if path is None:
                self.send_error(404)
                return
            if count <= server.fail_first:
                self.send_error(503, "Slow Down")
                return
            data = path.read_bytes()
            match = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            short = False
            if match:
                start = int(match.group(1))
                with server.lock:
                    server.range_gets[(rel, start)] += 1
                    ranged = server.range_gets[(rel, start)]
                time.sleep(server.delay_range.get(start, 0.0))
                if ranged <= server.fail_range.get(start, 0):
                    self.send_error(503, "Slow Down")
                    return
                short = ranged <= server.fail_range.get(start, 0) + server.short_range.get(start, 0)
                end = min(int(match.group(2)) + 1 if match.group(2) else len(data), len(data))
                body = data[start:end]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            else:
                body = data
                self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if short or (not match and count <= server.fail_first + server.truncate_first):
                body = body[: len(body) // 2]  # announce all, send half, hang up
            self._send(body)

        def _send(self, body: bytes):
            step = 64 * 1024
            for i in range(0, len(body), step):
                chunk = body[i : i + step]
                if server.bandwidth:  # each chunk arrives when the capped link would deliver it
                    time.sleep(len(chunk) / server.bandwidth)
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return

    return Handler


class ThrottlingProxy:
    """A TCP proxy on 127.0.0.1 in front of `target` that makes loopback look like a network
    link to an object store: `latency` seconds before each request is forwarded (first-byte
    latency) and `bandwidth` bytes per second per connection on the way back (stores cap each
    connection, not each client).

    For benchmarks of S3 clients against moto's server, which answers at memory speed.

    Example:
        >>> with MotoS3Server() as s3, ThrottlingProxy(s3.port, latency=0.02, bandwidth=16 * 2**20) as proxy:
        ...     options = s3.storage_options(port=proxy.port)
    """

    def __init__(self, target_port: int, *, latency: float = 0.0, bandwidth: float | None = None,
                 target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.latency, self.bandwidth = latency, bandwidth
        self._listener = None
        self._thread = None

    def __enter__(self) -> ThrottlingProxy:
        import socket
        import threading

        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import socket

        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, upstream, self.latency, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, 0.0, self.bandwidth), daemon=True).start()

    @staticmethod
    def _pump(source, sink, latency: float, bandwidth: float | None) -> None:
        import socket
        import time

        ready = 0.0  # when the link has delivered what was sent so far
        try:
            while True:
                data = source.recv(256 * 1024)
                if not data:
                    break
                if latency:  # requests are small: one delay per request
                    time.sleep(latency)
                if bandwidth:  # pace to the cap; oversleeping is made up within 10 ms
                    now = time.monotonic()
                    ready = max(ready, now - 0.01) + len(data) / bandwidth
                    if ready > now:
                        time.sleep(ready - now)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


class MotoS3Server:
    """moto's standalone S3 server on 127.0.0.1 (a real HTTP server, no mocks in the client),
    with `storage_options()` for s3fs and `client()` for boto3."""

    KEYS = {"key": "testing", "secret": "testing"}

    def __enter__(self) -> MotoS3Server:
        import logging
        import socket

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()

    def storage_options(self, port: int | None = None) -> dict:
        """s3fs options for this server, or for a proxy in front of it on `port`."""
        return {**self.KEYS, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port or self.port}",
                                               "region_name": "us-east-1"}}

    def client(self):
        import boto3

        return boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing",
                            endpoint_url=f"http://127.0.0.1:{self.port}", region_name="us-east-1")


_STORE_SCRIPT = """
import sys, time
from pathlib import Path
from recipes.testing import MotoS3Server, ThrottlingProxy
folder, bucket, latency, bandwidth = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
with MotoS3Server() as store:
    client = store.client()
    client.create_bucket(Bucket=bucket)
    for name in sys.argv[5:]:
        client.put_object(Bucket=bucket, Key=name, Body=(folder / name).read_bytes())
    with ThrottlingProxy(store.port, latency=latency, bandwidth=bandwidth or None) as proxy:
        print(store.port, proxy.port, flush=True)
        sys.stdin.read()  # until the parent closes it
"""


@contextlib.contextmanager
def s3_store_process(folder: str | Path, names: list[str], *, bucket: str, latency: float = 0.0,
                     bandwidth: float | None = None):
    """moto's S3 server holding `folder`'s `names` in `bucket`, behind a `ThrottlingProxy`,
    in a process of its own (so that serving does not take the reader's GIL or CPU time in
    its own process). Yields the s3fs storage options that reach it through the proxy."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _STORE_SCRIPT, str(folder), bucket, str(latency),
                             str(bandwidth or 0), *names], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(f"the S3 store process failed to start (exit code {proc.poll()})")
        yield {**MotoS3Server.KEYS, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{line[1]}",
                                                      "region_name": "us-east-1"}}
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
