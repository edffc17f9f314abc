"""Checksums of arena bytes: one function for host and CUDA arenas, the same value on both.

The scheme ``wsum64v1``: the bytes are read as little-endian int64 words ``w_i``
(a tail shorter than a word is zero-padded) and the checksum is the pair

    A = sum(w_i * (2*i + 1)) mod 2**64     (position-dependent: a word moved or swapped changes it)
    B = sum(w_i)             mod 2**64

written as ``wsum64v1:`` and 32 hex digits. Every odd weight is invertible
mod 2**64, so any change of a single word changes A; a swap of two words at
``i`` and ``j`` changes A by ``2*(w_j - w_i)*(i - j)``, zero only when that
product is a multiple of 2**64. It catches corruption and bytes that do not
belong to a manifest; it is not a cryptographic hash and does not stop a sender
who forges both the bytes and their checksum.

Both sums are exact in int64 arithmetic, which wraps mod 2**64 in torch on the
CPU and on CUDA, and neither depends on the order of the additions: the CPU and
a GPU compute the same value. Each chunk of ``ROWS x COLUMNS`` words is viewed
as a matrix and reduced twice (row sums ``R_r``, and column sums ``C_c`` on CUDA or
each row's product with the odd numbers on a CPU), so no temporary larger than a
row or column vector is made and the data is only read:

    sum(w[r, c] * (2*(r*COLUMNS + c) + 1)) = sum((2*c + 1) * C_c) + 2*COLUMNS * sum(r * R_r)

and a chunk starting at word ``i0`` adds ``2 * i0 * sum(w)`` to that. On a GPU
the work runs on the arena's own device (a device guard: nothing is created on
cuda:0 for another GPU) and is memory-bound.
"""

from __future__ import annotations

import contextlib
import re
import typing

from weightcache.core.errors import ChecksumMismatch

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.arena.base import Arena, ArenaSpec
    from weightcache.core.identity.digests import ProgressLike

SCHEME: typing.Final = "wsum64v1"
"""The name every checksum text starts with; a later scheme gets a new name, so it never compares equal to this one."""
COLUMNS: typing.Final = 4096
"""Words per row of a chunk's matrix view (32 KiB)."""
CHUNK_WORDS: typing.Final = 32 << 20
"""Words per chunk (256 MiB): the row-sum vector of a chunk stays at 64 KiB."""

_TEXT = re.compile(rf"{SCHEME}:[0-9a-f]{{32}}")
_MASK = (1 << 64) - 1


def is_checksum(text: object) -> bool:
    """Whether ``text`` is a checksum of this scheme (``wsum64v1:`` and 32 lower-case hex digits)."""
    return isinstance(text, str) and _TEXT.fullmatch(text) is not None


def checksum(data: "torch.Tensor") -> str:
    """The checksum of ``data``, a flat uint8 tensor (an arena's ``bytes_view()``) on the CPU or a GPU."""
    import torch

    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"checksum takes a flat uint8 tensor, not {data.dtype} of shape {tuple(data.shape)}")
    guard = torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext()
    with guard, torch.no_grad():
        weighted, plain = _sums(data, columns=data.is_cuda)
        values = torch.stack([weighted, plain]).cpu().tolist()  # the one synchronisation
    a, b = (value & _MASK for value in values)
    return f"{SCHEME}:{a:016x}{b:016x}"


def check_copy(declared: "typing.Sequence[ArenaSpec]", copies: "typing.Sequence[ArenaSpec]", source: str) -> None:
    """Raise ChecksumMismatch for the first copy whose size or checksum differs from what its source ``declared``.

    ``copies`` are the specs of sealed arenas that received the bytes (their checksums computed from those bytes);
    a declared spec without a checksum is a mismatch too: bytes from elsewhere are never published unchecked.
    """
    if len(declared) != len(copies):
        raise ValueError(f"{source} declared {len(declared)} arenas, {len(copies)} were filled")
    for index, (want, got) in enumerate(zip(declared, copies, strict=True)):
        if got.checksum is None:
            raise ValueError(f"arena {index} was not sealed: its checksum is unknown")
        if want.size != got.size:
            actual = f"{got.checksum} over {got.size} bytes where {want.size} were declared"
            raise ChecksumMismatch(index, source, want.checksum, actual)
        if want.checksum != got.checksum:
            raise ChecksumMismatch(index, source, want.checksum, got.checksum)


def mismatched(arenas: "typing.Sequence[Arena]", progress: "ProgressLike | None" = None) -> list[tuple[int, str]]:
    """``(index, checksum of its bytes)`` of each mapped arena whose bytes do not match its spec's checksum.

    Each arena is checksummed where it lives (a GPU's on that GPU); ``progress`` counts the bytes.
    """
    found = []
    for index, arena in enumerate(arenas):
        actual = checksum(arena.bytes_view())
        if actual != arena.spec.checksum:
            found.append((index, actual))
        if progress is not None:
            progress.update(arena.spec.size)
    return found


def check_mapped(arenas: "typing.Sequence[Arena]", source: str, fix: str = "") -> None:
    """Raise ChecksumMismatch for the first mapped arena whose bytes do not match its spec's checksum."""
    for index, actual in mismatched(arenas):
        raise ChecksumMismatch(index, source, arenas[index].spec.checksum, actual, fix)


def _sums(data: "torch.Tensor", columns: bool) -> "tuple[torch.Tensor, torch.Tensor]":
    """(A, B) as int64 scalars on ``data``'s device (``columns``: see ``_chunk_sums``)."""
    import torch

    whole = data.numel() // 8 * 8
    words = _as_words(data[:whole])
    weighted = torch.zeros((), dtype=torch.int64, device=data.device)
    plain = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk_weighted, chunk_plain = _chunk_sums(words[start : start + CHUNK_WORDS], columns)
        weighted += chunk_weighted + chunk_plain * (2 * start)  # wraps mod 2**64
        plain += chunk_plain
    tail = data[whole:]
    if tail.numel():  # the last word, zero-padded
        padded = torch.zeros(8, dtype=torch.uint8, device=data.device)
        padded[: tail.numel()] = tail
        last = padded.view(torch.int64)[0]
        weighted += last * (2 * words.numel() + 1)
        plain += last
    return weighted, plain


def _as_words(data: "torch.Tensor") -> "torch.Tensor":
    """``data`` (a multiple of 8 bytes) as int64 words, without a copy where the address is aligned."""
    import torch

    if data.numel() and data.data_ptr() % 8:
        data = data.clone()
    return data.view(torch.int64)


def _chunk_sums(words: "torch.Tensor", columns: bool) -> "tuple[torch.Tensor, torch.Tensor]":
    """(sum(w_j * (2j+1)), sum(w_j)) of one chunk, j counted from the chunk's first word.

    ``columns``: weigh the column sums (what CUDA can do: it has no int64 matrix-vector product);
    otherwise each row's weighted sum comes from ``torch.mv`` (twice as fast as column sums on a CPU).
    Both give the same value.
    """
    import torch

    rows = words.numel() // COLUMNS
    body = words[: rows * COLUMNS].view(rows, COLUMNS)
    rest = words[rows * COLUMNS :]
    device = words.device
    odd = torch.arange(1, 2 * COLUMNS, 2, dtype=torch.int64, device=device)
    row_sums = body.sum(dim=1)
    within_rows = (body.sum(dim=0) * odd).sum() if columns else torch.mv(body, odd).sum()
    weighted = within_rows + (row_sums * torch.arange(rows, dtype=torch.int64, device=device)).sum() * (2 * COLUMNS)
    plain = row_sums.sum()
    if rest.numel():
        base = rows * COLUMNS
        positions = torch.arange(2 * base + 1, 2 * (base + rest.numel()), 2, dtype=torch.int64, device=device)
        weighted = weighted + (rest * positions).sum()
        plain = plain + rest.sum()
    return weighted, plain
