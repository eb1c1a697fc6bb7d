"""Semiseparable matrices: a dense N x N operator stored as tridiagonal + low rank, H ~ T + U V^T.

Notebook 13 measures what this structure saves and what it costs. The module holds:
- `SemiseparableMatrix`: factorize, matvec/matmul in O(N r), storage, mixed precision;
- `HierarchicalSemiseparable`: off-diagonal blocks low rank, diagonal blocks recursing;
- `partition_rows` and `distributed_matvec`: the low-rank factors split by rows over ranks
  (torch.distributed, gloo on loopback), the "ZeRO partitioner for low-rank factors";
- `OffloadedSemiseparable`: the factors kept in host memory by `offload.OffloadManager` and
  streamed to the device in row chunks, with its transfer statistics;
- `causal_semiseparable_mixing`: a causal sequence-mixing layer whose mixing matrix is semiseparable
  (row-normalised tril(phi(Q) phi(K)^T), as in linear attention), the reference model's
  `attention="semiseparable"`.
Plain torch ops throughout, so the layer traces under FakeTensorMode.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from colab_memopt.core import ranks
from colab_memopt.techniques.offload import OffloadManager

LOWRANK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_rank(n: int) -> int:
    """Return the default rank ceil(log2 n) (at least 1)."""
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    return max(1, math.ceil(math.log2(n)))


def _check_square(H: torch.Tensor) -> int:
    if not isinstance(H, torch.Tensor):
        raise TypeError(f"H must be a torch.Tensor, got {type(H).__name__}")
    if H.dim() != 2 or H.shape[0] != H.shape[1] or H.shape[0] < 2:
        raise ValueError(f"H must be a square matrix of size >= 2, got shape {tuple(H.shape)}")
    return H.shape[0]


def _lowrank(R: torch.Tensor, rank: int, method: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (U, V) with U V^T the rank-`rank` truncated SVD of R (U carries the singular values)."""
    if method == "svd":
        Us, S, Vh = torch.linalg.svd(R, full_matrices=False)
        return Us[:, :rank] * S[:rank], Vh[:rank].T
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Us, S, V = torch.svd_lowrank(R, q=min(rank + 8, min(R.shape)), niter=3)
    return Us[:, :rank] * S[:rank], V[:, :rank]


def _band_of_product(U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the diagonal, sub- and super-diagonal of U V^T without forming it."""
    diag = (U * V).sum(1)
    sub = (U[1:] * V[:-1]).sum(1)  # (UV^T)[i+1, i]
    sup = (U[:-1] * V[1:]).sum(1)  # (UV^T)[i, i+1]
    return diag, sub, sup


@dataclass
class SemiseparableMatrix:
    """H ~ T + U V^T: tridiagonal T (diag, sub, sup) and rank-r factors U, V of shape (N, r)."""

    diag: torch.Tensor  # (N,)
    sub: torch.Tensor  # (N-1,)  H[i+1, i]
    sup: torch.Tensor  # (N-1,)  H[i, i+1]
    U: torch.Tensor  # (N, r)
    V: torch.Tensor  # (N, r)

    @classmethod
    def factorize(
        cls,
        H: torch.Tensor,
        rank: int | None = None,
        *,
        method: str = "auto",
        lowrank_dtype: torch.dtype = torch.float32,
        band_dtype: torch.dtype = torch.float32,
        refine_iters: int = 8,
        seed: int = 0,
    ) -> SemiseparableMatrix:
        """Factorize a dense square matrix as tridiagonal + rank `rank` (default ceil(log2 N)).

        The band is kept exactly. The low-rank part fits the entries off the band: it starts from
        H with the band zeroed and, `refine_iters` times, fills the band with the current low-rank
        fit's band and refits, so a matrix that truly is tridiagonal + rank r is recovered exactly
        (to rounding). `method` is 'svd', 'randomized' (torch.svd_lowrank) or 'auto' (svd up to
        N = 128). Low-rank factors are stored in `lowrank_dtype`, the band in `band_dtype`.

        Example:
            >>> S = SemiseparableMatrix.factorize(H)        # rank ceil(log2 N)
            >>> y = S.matvec(x); S.reduction_vs_dense()
        """
        n = _check_square(H)
        rank = default_rank(n) if rank is None else rank
        if not isinstance(rank, int) or not 1 <= rank <= n:
            raise ValueError(f"rank must be an integer in [1, {n}], got {rank!r}")
        if method not in ("auto", "svd", "randomized"):
            raise ValueError(f"method must be 'auto', 'svd' or 'randomized', got {method!r}")
        for name, dt in (("lowrank_dtype", lowrank_dtype), ("band_dtype", band_dtype)):
            if dt not in LOWRANK_DTYPES:
                raise ValueError(f"{name} must be one of {LOWRANK_DTYPES}, got {dt}")
        if refine_iters < 0:
            raise ValueError(f"refine_iters must be >= 0, got {refine_iters}")
        method = ("svd" if n <= 128 else "randomized") if method == "auto" else method
        H = H.detach().to(torch.float64 if H.dtype == torch.float64 else torch.float32)
        idx = torch.arange(n, device=H.device)
        d0, s0, u0 = H.diagonal(), H.diagonal(-1), H.diagonal(1)
        R = H.clone()
        R[idx, idx] = 0
        R[idx[1:], idx[:-1]] = 0
        R[idx[:-1], idx[1:]] = 0
        U, V = _lowrank(R, rank, method, seed)
        for _ in range(refine_iters):
            bd, bs, bu = _band_of_product(U, V)
            R[idx, idx], R[idx[1:], idx[:-1]], R[idx[:-1], idx[1:]] = bd, bs, bu
            U, V = _lowrank(R, rank, method, seed)
        bd, bs, bu = _band_of_product(U, V)
        return cls(
            diag=(d0 - bd).to(band_dtype),
            sub=(s0 - bs).to(band_dtype),
            sup=(u0 - bu).to(band_dtype),
            U=U.to(lowrank_dtype).contiguous(),
            V=V.to(lowrank_dtype).contiguous(),
        )

    @property
    def n(self) -> int:
        """Return N."""
        return self.diag.shape[0]

    @property
    def rank(self) -> int:
        """Return r."""
        return self.U.shape[1]

    def matmul(self, X: torch.Tensor) -> torch.Tensor:
        """Return H X for X of shape (N,) or (N, k), in O(N r k), in the band's dtype."""
        vec = X.dim() == 1
        X = X[:, None] if vec else X
        if X.shape[0] != self.n:
            raise ValueError(f"X must have {self.n} rows, got shape {tuple(X.shape)}")
        X = X.to(self.diag.dtype)
        Y = self.diag[:, None] * X
        Y[1:] += self.sub[:, None] * X[:-1]
        Y[:-1] += self.sup[:, None] * X[1:]
        Z = self.V.T @ X.to(self.V.dtype)  # (r, k)
        Y += (self.U @ Z).to(Y.dtype)
        return Y[:, 0] if vec else Y

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """Return H x for a vector x of shape (N,)."""
        if x.dim() != 1:
            raise ValueError(f"x must be a vector of shape ({self.n},), got {tuple(x.shape)}")
        return self.matmul(x)

    def to_dense(self) -> torch.Tensor:
        """Return the dense N x N matrix (fp32 or the band's dtype)."""
        dense = (self.U.float() @ self.V.float().T).to(self.diag.dtype)
        return dense + torch.diag(self.diag) + torch.diag(self.sub, -1) + torch.diag(self.sup, 1)

    def tensors(self) -> list[torch.Tensor]:
        """Return the stored tensors."""
        return [self.diag, self.sub, self.sup, self.U, self.V]

    def memory_bytes(self) -> int:
        """Return the bytes the structure stores."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reduction_vs_dense(self, dense_bytes_per_value: int = 4) -> float:
        """Return 1 - stored bytes / bytes of the dense fp32 N x N matrix."""
        return 1.0 - self.memory_bytes() / (self.n * self.n * dense_bytes_per_value)

    def relative_error(self, H: torch.Tensor) -> float:
        """Return ||H - to_dense()||_F / ||H||_F."""
        return float(torch.linalg.norm(H.float() - self.to_dense().float()) / torch.linalg.norm(H.float()))

    def to(self, device: str | torch.device) -> SemiseparableMatrix:
        """Return a copy on `device`."""
        return SemiseparableMatrix(*(t.to(device) for t in self.tensors()))


@dataclass
class HierarchicalSemiseparable:
    """A multi-level (HODLR) form: off-diagonal blocks low rank, diagonal blocks recursing.

    A node holds either a leaf `SemiseparableMatrix` or two children plus the factors of its two
    off-diagonal blocks: H = [[A, U1 V1^T], [U2 V2^T, B]].
    """

    n: int
    leaf: SemiseparableMatrix | None = None
    children: tuple[HierarchicalSemiseparable, HierarchicalSemiseparable] | None = None
    upper: tuple[torch.Tensor, torch.Tensor] | None = None  # H[:m, m:] ~ U V^T
    lower: tuple[torch.Tensor, torch.Tensor] | None = None  # H[m:, :m] ~ U V^T

    @classmethod
    def factorize(
        cls,
        H: torch.Tensor,
        rank: int | None = None,
        *,
        num_levels: int = 2,
        lowrank_dtype: torch.dtype = torch.float32,
        refine_iters: int = 8,
    ) -> HierarchicalSemiseparable:
        """Factorize H with `num_levels` levels of splitting; leaves are tridiagonal + low rank.

        `rank` (default ceil(log2 N) of the whole matrix) is used for every block; `refine_iters` is
        passed to the leaves' `SemiseparableMatrix.factorize`.
        """
        n = _check_square(H)
        rank = default_rank(n) if rank is None else rank
        if not isinstance(num_levels, int) or num_levels < 0:
            raise ValueError(f"num_levels must be an integer >= 0, got {num_levels!r}")
        if n >> num_levels < 2:
            raise ValueError(f"N={n} is too small for {num_levels} levels (leaves need >= 2 rows)")
        return cls._build(H.float(), rank, num_levels, lowrank_dtype, refine_iters)

    @classmethod
    def _build(cls, H: torch.Tensor, rank: int, levels: int, dtype: torch.dtype, iters: int) -> HierarchicalSemiseparable:
        n = H.shape[0]
        if levels == 0:
            leaf = SemiseparableMatrix.factorize(H, min(rank, n), lowrank_dtype=dtype, refine_iters=iters)
            return cls(n=n, leaf=leaf)
        m = n // 2
        r = min(rank, m, n - m)
        up, lo = _lowrank(H[:m, m:], r, "randomized", 0), _lowrank(H[m:, :m], r, "randomized", 1)
        return cls(
            n=n,
            children=(cls._build(H[:m, :m], rank, levels - 1, dtype, iters), cls._build(H[m:, m:], rank, levels - 1, dtype, iters)),
            upper=tuple(t.to(dtype).contiguous() for t in up),
            lower=tuple(t.to(dtype).contiguous() for t in lo),
        )

    def matmul(self, X: torch.Tensor) -> torch.Tensor:
        """Return H X for X of shape (N,) or (N, k)."""
        vec = X.dim() == 1
        X = X[:, None] if vec else X
        if X.shape[0] != self.n:
            raise ValueError(f"X must have {self.n} rows, got shape {tuple(X.shape)}")
        Y = self._matmul(X.float())
        return Y[:, 0] if vec else Y

    def _matmul(self, X: torch.Tensor) -> torch.Tensor:
        if self.leaf is not None:
            return self.leaf.matmul(X)
        m = self.children[0].n
        (Uu, Vu), (Ul, Vl) = self.upper, self.lower
        top = self.children[0]._matmul(X[:m]) + (Uu @ (Vu.T @ X[m:].to(Vu.dtype))).float()
        bottom = self.children[1]._matmul(X[m:]) + (Ul @ (Vl.T @ X[:m].to(Vl.dtype))).float()
        return torch.cat([top, bottom])

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """Return H x."""
        return self.matmul(x)

    def tensors(self) -> list[torch.Tensor]:
        """Return every stored tensor."""
        if self.leaf is not None:
            return self.leaf.tensors()
        return [*self.upper, *self.lower, *self.children[0].tensors(), *self.children[1].tensors()]

    def memory_bytes(self) -> int:
        """Return the bytes stored at all levels."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def matvec_flops(self) -> int:
        """Return the multiply-adds of one matvec: one per stored low-rank value, three per band row."""
        return sum(t.numel() for t in self.tensors())

    def to_dense(self) -> torch.Tensor:
        """Return the dense matrix, on the device of the stored tensors."""
        return self.matmul(torch.eye(self.n, device=self.tensors()[0].device))

    def relative_error(self, H: torch.Tensor) -> float:
        """Return ||H - to_dense()||_F / ||H||_F."""
        return float(torch.linalg.norm(H.float() - self.to_dense()) / torch.linalg.norm(H.float()))


def smooth_kernel_plus_band(n: int, *, length_scale: float = 0.3, band: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Return a matrix that has the structure: a Gaussian kernel on sorted points plus a random band."""
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(0, 1, n)
    K = torch.exp(-((x[:, None] - x[None, :]) ** 2) / (2 * length_scale**2))
    return K + band * (torch.diag(torch.randn(n, generator=g)) + torch.diag(torch.randn(n - 1, generator=g), 1)
                       + torch.diag(torch.randn(n - 1, generator=g), -1))


# -- the "ZeRO partitioner for low-rank factors": rows split over ranks ---------------------------------


def partition_rows(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return the [start, stop) rows of rank `rank` when N rows are split as evenly as possible."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def local_matvec(S: SemiseparableMatrix, x: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (this rank's partial V^T x over its rows, its rows of T x), the two local halves of a matvec."""
    z = S.V[start:stop].T.float() @ x[start:stop].float()  # (r,)
    rows = torch.arange(start, stop)
    y = S.diag[start:stop].float() * x[start:stop]
    lo = rows[rows > 0]
    y[lo - start] += S.sub[lo - 1].float() * x[lo - 1]
    hi = rows[rows < S.n - 1]
    y[hi - start] += S.sup[hi].float() * x[hi + 1]
    return z, y


def _matvec_worker(rank: int, world_size: int, port: int, workdir: str, timeout_s: float) -> None:
    """Run on each rank: keep only this rank's rows of U and V, all-reduce V^T x, gather y."""
    import torch.distributed as dist

    ranks.redirect_output(workdir, rank)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://{ranks.LOOPBACK}:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        full = torch.load(Path(workdir, "input.pt"))
        S, x = SemiseparableMatrix(*full["tensors"]), full["x"]
        start, stop = partition_rows(S.n, world_size, rank)
        # This rank's shard: its rows of the factors (the band is O(N) and stays whole).
        local = SemiseparableMatrix(S.diag, S.sub, S.sup, S.U[start:stop].clone(), S.V[start:stop].clone())
        del full, S
        shard_bytes = local.U.numel() * local.U.element_size() + local.V.numel() * local.V.element_size()
        band_bytes = sum(t.numel() * t.element_size() for t in (local.diag, local.sub, local.sup))
        z = local.V.T.float() @ x[start:stop].float()
        dist.all_reduce(z)  # V^T x summed over ranks, (r,)
        _, y_band = local_matvec(
            SemiseparableMatrix(local.diag, local.sub, local.sup, torch.zeros(local.n, 1), torch.zeros(local.n, 1)),
            x, start, stop,
        )
        y_local = y_band + local.U.float() @ z
        spans = [partition_rows(local.n, world_size, i) for i in range(world_size)]
        width = max(b - a for a, b in spans)  # gloo gathers equal sizes: pad, then trim
        pieces = [torch.zeros(width) for _ in spans]
        dist.all_gather(pieces, F.pad(y_local, (0, width - y_local.numel())))
        y = torch.cat([piece[: b - a] for piece, (a, b) in zip(pieces, spans)])
        result = {"y": y, "factor_bytes": shard_bytes, "band_bytes": band_bytes}
        ranks.write_result(Path(workdir, f"rank{rank}.pt"), lambda path: torch.save(result, path))
    finally:
        dist.destroy_process_group()


@dataclass
class DistributedResult:
    """What `distributed_matvec` returns."""

    y: torch.Tensor
    factor_bytes_per_rank: list[int]
    band_bytes_per_rank: list[int]
    seconds: float


def distributed_matvec(S: SemiseparableMatrix, x: torch.Tensor, *, world_size: int = 2, timeout_s: float = 60.0) -> DistributedResult:
    """Compute S x on `world_size` processes (gloo, 127.0.0.1) that each hold their rows of U and V.

    Each rank computes its partial V^T x, all-reduces it, applies its rows of U and of the band,
    and all-gathers y. The workers are spawned and always end: after `timeout_s` they are
    terminated and a TimeoutError is raised.
    """
    if world_size < 1 or world_size > S.n:
        raise ValueError(f"world_size must be in [1, {S.n}], got {world_size}")
    start_time = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        inputs = {"tensors": [t.cpu() for t in S.tensors()], "x": x.detach().cpu().float()}
        ranks.write_result(Path(workdir, "input.pt"), lambda path: torch.save(inputs, path))  # whole before a rank reads it
        ranks.launch(_matvec_worker, world_size, (ranks.free_port(), workdir, timeout_s), workdir=workdir,
                     result_file="rank{rank}.pt", timeout_s=timeout_s, what="distributed matvec ranks",
                     threads_per_rank=max(1, torch.get_num_threads() // world_size))
        outs = [torch.load(Path(workdir, f"rank{r}.pt")) for r in range(world_size)]
    return DistributedResult(
        y=outs[0]["y"],
        factor_bytes_per_rank=[o["factor_bytes"] for o in outs],
        band_bytes_per_rank=[o["band_bytes"] for o in outs],
        seconds=time.perf_counter() - start_time,
    )


# -- offloading the factors to host memory -----------------------------------------------------------


class OffloadedSemiseparable:
    """A semiseparable matrix whose factors live in host memory, streamed to the device by row chunks.

    The factors go through an `offload.OffloadManager` (pinned host memory on CUDA; its statistics
    count every transfer). Only the band, x and y and one chunk of U or V are on the device during
    `matvec`.

    Example:
        >>> manager = OffloadManager()
        >>> off = OffloadedSemiseparable(S, manager, device="cuda", chunk_rows=256)
        >>> y = off.matvec(x); manager.get_statistics().to_device
    """

    def __init__(self, S: SemiseparableMatrix, manager: OffloadManager, *, device: str | torch.device | None = None,
                 chunk_rows: int = 256) -> None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be an integer >= 1, got {chunk_rows!r}")
        self.n, self.manager, self.chunk_rows = S.n, manager, chunk_rows
        self.device = torch.device(device) if device is not None else S.diag.device
        self.band = SemiseparableMatrix(S.diag.to(self.device), S.sub.to(self.device), S.sup.to(self.device),
                                        S.U[:0], S.V[:0])
        self.chunks = [(a, min(a + chunk_rows, S.n)) for a in range(0, S.n, chunk_rows)]
        for a, b in self.chunks:
            manager.offload(f"U:{a}", S.U[a:b])
            manager.offload(f"V:{a}", S.V[a:b])

    def device_tensors(self) -> list[torch.Tensor]:
        """Return what stays on the device between matvecs (the band)."""
        return [self.band.diag, self.band.sub, self.band.sup]

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """Return H x, streaming the factors chunk by chunk."""
        band = self.band
        y = band.diag.float() * x
        y[1:] += band.sub.float() * x[:-1]
        y[:-1] += band.sup.float() * x[1:]
        z = None
        for a, b in self.chunks:
            Vc = self.manager.load(f"V:{a}", self.device)
            part = Vc.T.float() @ x[a:b]
            z = part if z is None else z + part
            del Vc
        for a, b in self.chunks:
            Uc = self.manager.load(f"U:{a}", self.device)
            y[a:b] += Uc.float() @ z
            del Uc
        return y


# -- the causal semiseparable sequence-mixing layer ----------------------------------------------------


def causal_semiseparable_mixing(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int = 64, eps: float = 1e-6
) -> torch.Tensor:
    """Mix a sequence causally with a semiseparable matrix: y = M v, M = rownorm(tril(phi(Q) phi(K)^T)).

    q, k, v: (B, heads, T, d). phi(t) = elu(t) + 1 keeps M positive, and each row is divided by its
    sum, so M is a causal averaging operator like softmax attention's, but every block below the
    diagonal has rank <= d: a semiseparable matrix of rank d. It is computed by chunks of
    `chunk_size` tokens without forming the T x T matrix: a dense c x c lower triangle inside each
    chunk, and a (d x d) running state across chunks. Memory kept for backward grows as
    T * (chunk_size + d) per head instead of T^2 (Katharopoulos et al. 2020's linear attention in
    chunked form, as in Mamba-2's state-space duality).
    """
    if q.shape != k.shape or q.shape[:-1] != v.shape[:-1] or q.dim() != 4:
        raise ValueError(f"q, k must be (B, heads, T, d) and v (B, heads, T, dv); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, H, T, D = q.shape
    c = min(chunk_size, T)
    pad = (-T) % c
    q, k = F.elu(q) + 1, F.elu(k) + 1
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # padded keys are 0: they add nothing
    n = (T + pad) // c
    qc, kc, vc = (t.reshape(B, H, n, c, t.shape[-1]) for t in (q, k, v))
    mask = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    scores = (qc @ kc.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, H, n, c, c)
    kv = kc.transpose(-1, -2) @ vc  # (B, H, n, D, Dv): each chunk's sum of k v^T
    state = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1].cumsum(2)], dim=2)  # before each chunk
    ksum = kc.sum(3)  # (B, H, n, D)
    zstate = torch.cat([torch.zeros_like(ksum[:, :, :1]), ksum[:, :, :-1].cumsum(2)], dim=2)
    num = scores @ vc + qc @ state  # (B, H, n, c, Dv)
    den = scores.sum(-1) + (qc * zstate.unsqueeze(3)).sum(-1)  # (B, H, n, c)
    y = num / (den.unsqueeze(-1) + eps)
    return y.reshape(B, H, n * c, -1)[:, :, :T]


def causal_semiseparable_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Return the same mixing with the T x T matrix formed (the reference for tests)."""
    q, k = F.elu(q) + 1, F.elu(k) + 1
    T = q.shape[-2]
    M = (q @ k.transpose(-1, -2)).tril()
    return (M @ v) / (M.sum(-1, keepdim=True) + eps) if T else v
