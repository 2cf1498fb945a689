"""A V4.1-shaped stack of upstream Engram lookups for tests and bench_engram_prefetch.py: real
EngramEmbedding modules (device tables, TP1) built outside a server, and the same lookups
from a shared host table (pinned host memory read through UVA, as
SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE's shared layout does)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

FP8_BLOCK = 32


def _tp1(monkeypatch=None):
    import sglang.srt.layers.engram as engram_mod

    tp1 = lambda: SimpleNamespace(
        tp_size=1, tp_rank=0, attn_dp_size=1, tp_group=None
    )  # noqa: E731
    # The published server arguments' offload section, Engram row store off (no server here).
    offload = SimpleNamespace(
        engram_row_store_dir=None, engram_row_store_cache_gib=None
    )
    exec_ns = lambda: SimpleNamespace(offload=offload)  # noqa: E731
    for name, stub in (("get_parallel", tp1), ("get_exec", exec_ns)):
        if monkeypatch is not None:
            monkeypatch.setattr(engram_mod, name, stub, raising=False)
        else:
            setattr(engram_mod, name, stub)
    return engram_mod


def random_table(
    rows: int, dim: int, device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 rows (every finite code equally likely) and e8m0 scale bytes 2**-17..2**2,
    generated on ``device`` in slices (no float copy of the table is ever held)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.empty(rows, dim, dtype=torch.uint8, device=device)
    s = torch.empty(rows, dim // FP8_BLOCK, dtype=torch.uint8, device=device)
    step = max(1, (1 << 26) // dim)
    for r in range(0, rows, step):
        chunk = w[r : r + step]
        chunk.random_(0, 256, generator=gen)
        chunk[(chunk & 0x7F) == 0x7F] = 0  # no NaN codes
        s[r : r + step].random_(110, 130, generator=gen)
    return w.view(torch.float8_e4m3fn), s


def device_embedding(rows: int, dim: int, device, seed: int, monkeypatch=None):
    """An upstream EngramEmbedding (TP1, device table) with random fp8 rows and e8m0 scales."""
    engram_mod = _tp1(monkeypatch)
    embed = engram_mod.EngramEmbedding(
        rows, dim, layer_id=seed, column_bounds=(0, rows)
    )
    w, s = random_table(rows, dim, device, seed)
    embed.weight.data = w
    embed.scale.data = s.view(torch.float8_e8m0fnu)
    return embed


class HostEmbedding:
    """The shared-host-table lookup of EngramEmbedding (every row in pinned host memory, read
    by the gather kernel through UVA) without the memfd plumbing: the members the lookup and
    the prefetch read, and upstream's own forward."""

    peer = None
    tp_size = 1
    _sort_host_reads = False
    _shared = True
    staged_by_scheduler = False

    def __init__(self, rows: int, dim: int, seed: int, device="cuda"):
        self.dim, self.rows, self.row_start = dim, rows, 0
        self.host_table = SimpleNamespace(layout="shared")
        w, s = random_table(rows, dim, device, seed)
        self.weight = torch.empty(w.shape, dtype=w.dtype, pin_memory=True)
        self.scale = torch.empty(s.shape, dtype=s.dtype, pin_memory=True)
        self.weight.copy_(w)
        self.scale.copy_(s)
        del w, s

    def _table_ptrs(self):
        return self.weight.data_ptr(), self.scale.data_ptr()

    def new_rows(self, indices):
        return torch.empty(
            *indices.shape, self.dim, dtype=torch.bfloat16, device=indices.device
        )

    def _owned_rows(
        self, indices
    ):  # pragma: no cover - the shared layout never reaches it
        raise AssertionError("shared host tables gather through engram_gather")

    def _reduce_owned_rows(self, values):  # pragma: no cover
        raise AssertionError("a shared host table needs no reduce")

    def __call__(self, indices, forward_batch=None, *, cp_all_tokens=False):
        import sglang.srt.layers.engram as engram_mod

        return engram_mod.EngramEmbedding.forward(
            self, indices, forward_batch, cp_all_tokens=cp_all_tokens
        )


class EngramLookup:
    """What the prefetch reads of upstream's Engram module: its embedding, its column of the
    hash ids and the synchronous lookup (Engram.embed_rows)."""

    def __init__(self, embed, layer_hash_index: int):
        self.embed, self.layer_hash_index = embed, layer_hash_index

    def embed_rows(self, hash_ids, forward_batch, cp_all_tokens):
        return self.embed(hash_ids, forward_batch, cp_all_tokens=cp_all_tokens)


def decode_batch(staged=None):
    mode = SimpleNamespace(is_decode=lambda: True, is_target_verify=lambda: False)
    return SimpleNamespace(forward_mode=mode, engram_staged_rows=staged)


def hash_ids(tokens: int, layers: int, cols: int, rows: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, rows, (tokens, layers, cols), generator=gen).to(device)
