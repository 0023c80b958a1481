"""Fetch vLLM's own ``toy_proxy_server.py`` for the test that routes a lease token through it.

vLLM keeps that proxy in its tests (``tests/v1/kv_connector/nixl_integration/``), which the wheels
do not ship but the source distribution does. This script asks the package index pip uses (the
``PIP_INDEX_URL`` environment variable, else pip's default) for the sdist of one vLLM release,
checks its SHA-256 against the one pinned below (and the index's), and writes only the proxy's
file into ``--out``. CI runs it before the test command and points ``LLM_DATADIST_TOY_PROXY`` at
the file::

    python tools/fetch_vllm_proxy.py --out /tmp/vllm-tests
    LLM_DATADIST_TOY_PROXY=/tmp/vllm-tests/toy_proxy_server.py python -m pytest tests/integrations

Exit status 0 with the file's path on stdout; 1 with one line on stderr saying what failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

#: The sdists whose proxy this project has read, by release, with their SHA-256.
PINNED = {
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
}
MEMBER = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
NAME = "toy_proxy_server.py"


def index_url() -> str:
    named = os.environ.get("PIP_INDEX_URL")
    if named:
        return named.rstrip("/")
    from pip._internal.models.index import PyPI  # the index pip itself uses by default

    return PyPI.simple_url.rstrip("/")


def sdist_link(version: str) -> tuple:
    """``(url, sha256 the index gives)`` of vLLM's sdist ``version``, from the index's JSON page."""
    request = urllib.request.Request(f"{index_url()}/vllm/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        page = json.load(answer)
    filename = f"vllm-{version}.tar.gz"
    for entry in page.get("files", ()):
        if entry.get("filename") == filename:
            return entry["url"], entry.get("hashes", {}).get("sha256")
    raise LookupError(f"the index lists no {filename}")


def fetch(version: str, out: Path) -> Path:
    pinned = PINNED.get(version)
    if pinned is None:
        raise LookupError(f"no SHA-256 pinned for vLLM {version} (pinned: {', '.join(sorted(PINNED))})")
    target = out / NAME
    stamp = out / f"{NAME}.sha256"
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == pinned:
        return target  # taken from this very sdist before
    url, listed = sdist_link(version)
    if listed is not None and listed != pinned:
        raise ValueError(f"the index's SHA-256 of vllm-{version}.tar.gz is {listed}, not the pinned {pinned}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=300) as answer, archive.open("wb") as sink:
            while chunk := answer.read(1 << 20):
                digest.update(chunk)
                sink.write(chunk)
        if digest.hexdigest() != pinned:
            raise ValueError(f"vllm-{version}.tar.gz has SHA-256 {digest.hexdigest()}, not the pinned {pinned}")
        with tarfile.open(archive) as sdist:
            member = sdist.getmember(f"vllm-{version}/{MEMBER}")
            source = sdist.extractfile(member)
            if source is None:
                raise ValueError(f"{MEMBER} in vllm-{version}.tar.gz is not a file")
            target.write_bytes(source.read())
    stamp.write_text(pinned + "\n")
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.32.0", help="vLLM release (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write toy_proxy_server.py into")
    args = parser.parse_args(argv)
    try:
        print(fetch(args.version, args.out))
    except (OSError, LookupError, ValueError, KeyError, tarfile.TarError) as exc:
        print(f"fetch_vllm_proxy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
