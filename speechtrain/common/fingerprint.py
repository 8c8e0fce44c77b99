"""Content fingerprints of data files, for the keys of caches built from them (tokenizers, n-gram LMs, codecs): a
file edited in place, even to the same size, gets a new key and the cache is rebuilt."""

import hashlib
import os
from pathlib import Path

# Files up to this size are hashed whole (a 64 MiB manifest hashes in a fraction of a second).
FULL_HASH_BYTES = 64 * 2**20
# Larger ones: their size, modification time and this many blocks spread over the file, the first and last included.
SAMPLED_BLOCKS = 64
BLOCK_BYTES = 64 * 2**10


def file_fingerprint(path: str | os.PathLike) -> str:
    """A hex digest that changes when the file's content does: the SHA-256 of the whole file up to
    :data:`FULL_HASH_BYTES`; beyond, of its size, ``mtime_ns`` and :data:`SAMPLED_BLOCKS` blocks of
    :data:`BLOCK_BYTES` spread evenly over it (an in-place edit changes the modification time)."""
    path = Path(path)
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if stat.st_size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(2**20), b""):
                digest.update(block)
            return digest.hexdigest()
        digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
        last = stat.st_size - BLOCK_BYTES
        for index in range(SAMPLED_BLOCKS):
            f.seek(last * index // (SAMPLED_BLOCKS - 1))
            digest.update(f.read(BLOCK_BYTES))
    return digest.hexdigest()
