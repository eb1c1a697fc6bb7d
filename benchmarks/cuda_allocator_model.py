"""A model of CUDA's caching allocator, checked against what it did on a GPU (runs anywhere, no GPU needed).

A plan counts the bytes tensors ask for; `torch.cuda.max_memory_allocated` counts the blocks the caching allocator
hands out. The two differ where a large block is handed out whole because the part that would be left over is
1 MiB or less. On the first CUDA runs that was 1.3-1.4% of full fine-tuning's peak, the one Trainer class planned
more than 1% under the allocated peak.

`CachingAllocator` below follows PyTorch's CUDACachingAllocator with its default settings (no
`PYTORCH_CUDA_ALLOC_CONF`, as on Colab): sizes rounded up to 512 B; a small pool (1 MiB and less) and a large one;
best fit by (size, address); a new segment of 2 MiB, 20 MiB, or the size rounded up to 2 MiB; a block split only
where the rest is at least 512 B (small pool) or more than 1 MiB (large pool); freed blocks merged with free
neighbours of their segment. Sources: c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size,
get_free_block, should_split, free_block), https://github.com/pytorch/pytorch.

The check replays `results/cuda/.../allocator_replay.json.gz` (written on the GPU by cuda_allocator_replay.py): from the
blocks the allocator held when a Trainer class's measured step began, every allocation of the step is placed by the
model and compared with the address CUDA gave it; the model's allocated and requested peaks are compared with
`torch.cuda.memory_stats`. Then it asks what a plan could know without the history: the same class's parameters and
AdamW state allocated alone, in order, against the whole-block bytes CUDA held at the step's start.

    python benchmarks/cuda_allocator_model.py [--replay PATH] [--out build/allocator_model.json]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the small pool's largest request; a large block's smallest split-off rest is more
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a segment for requests of 1-10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
RUN3 = Path(__file__).parent / "results" / "cuda" / "h200-emulating-t4-2026-11-28-run3"
REPLAY = RUN3 / "allocator_replay.json.gz"  # the measured step alone
HISTORY = RUN3 / "allocator_history.json.gz"  # from before the model's load to the end of the measured step


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Block:
    __slots__ = ("free", "next", "prev", "ptr", "requested", "size", "small")

    def __init__(self, ptr: int, size: int, small: bool) -> None:
        self.ptr, self.size, self.small = ptr, size, small
        self.requested, self.free, self.prev, self.next = 0, True, None, None


class CachingAllocator:
    """One stream of PyTorch's CUDA caching allocator at its defaults: where each block goes, and what it counts."""

    def __init__(self) -> None:
        self.pools: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # free (size, ptr), sorted
        self.blocks: dict[int, Block] = {}
        self.allocated = self.requested = self.reserved = 0
        self.peak_allocated = self.peak_requested = 0
        self._next_segment = 1 << 40
        self.segment_sizes: list[int] = []

    def _pool_add(self, b: Block) -> None:
        bisect.insort(self.pools[b.small], (b.size, b.ptr))

    def _pool_remove(self, b: Block) -> None:
        pool = self.pools[b.small]
        pool.pop(bisect.bisect_left(pool, (b.size, b.ptr)))

    def adopt_segment(self, blocks: list[list[Any]], small: bool) -> None:
        """Take over one segment as a snapshot lists it: [address, size, requested size, state] per block."""
        prev = None
        for ptr, size, requested, state in blocks:
            b = Block(ptr, size, small)
            b.prev = prev
            if prev is not None:
                prev.next = b
            self.blocks[ptr] = prev = b
            self.reserved += size
            if state == "active_allocated":
                b.free, b.requested = False, requested
                self.allocated += size
                self.requested += requested
            else:
                self._pool_add(b)
        self.peak_allocated, self.peak_requested = self.allocated, self.requested

    def malloc(self, nbytes: int, segment_ptr: int | None = None) -> Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            b = self.blocks[pool.pop(i)[1]]
        else:
            seg = segment_size(size)
            ptr = self._next_segment if segment_ptr is None else segment_ptr
            self._next_segment = max(self._next_segment, ptr + seg) + (1 << 30)
            b = self.blocks[ptr] = Block(ptr, seg, small)
            self.reserved += seg
            self.segment_sizes.append(seg)
        rest = b.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            r = self.blocks[b.ptr + size] = Block(b.ptr + size, rest, small)
            r.prev, r.next = b, b.next
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, size
            self._pool_add(r)
        b.free, b.requested = False, nbytes
        self.allocated += b.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return b

    def free(self, ptr: int) -> None:
        b = self.blocks[ptr]
        self.allocated -= b.size
        self.requested -= b.requested
        b.free, b.requested = True, 0
        for other in (b.prev, b.next):
            if other is None or not other.free:
                continue
            self._pool_remove(other)
            first, second = (other, b) if other is b.prev else (b, other)
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            del self.blocks[second.ptr]
            b = first
        self._pool_add(b)


def replay(case: dict[str, Any], before_alloc: Callable[[CachingAllocator, int], None] | None = None) -> dict[str, Any]:
    """Place every allocation of a record with the model, from the blocks held where it starts (`before_alloc`: called
    with the model and the bytes asked for before each allocation is placed)."""
    model = CachingAllocator()
    for segment in case.get("history_start") or case["start"]:  # a --history record starts before the load
        model.adopt_segment(segment["blocks"], segment["segment_type"] == "small")
    new_segments = [e for e in case["events"] if e[0] == "segment_alloc"]
    allocs = same_address = 0
    for action, addr, nbytes, _stream in case["events"]:
        if action == "alloc":
            if before_alloc is not None:
                before_alloc(model, nbytes)
            allocs += 1
            made = len(model.segment_sizes)
            segment_ptr = new_segments[made][1] if made < len(new_segments) else None
            same_address += model.malloc(nbytes, segment_ptr).ptr == addr
        elif action == "free_completed":
            model.free(addr)
    real = case["end_stats"]
    return {"allocations": allocs, "same_address": same_address,
            "segments_made": {"model": model.segment_sizes, "cuda": [e[2] for e in new_segments]},
            "peak_allocated": {"model": model.peak_allocated, "cuda": real["allocated_bytes.all.peak"]},
            "peak_requested": {"model": model.peak_requested, "cuda": real["requested_bytes.all.peak"]}}


def whole_blocks_by_step(case: dict[str, Any]) -> dict[int, int]:
    """In a --history record: the whole-block bytes (allocated less requested, rounded) held as each step begins."""
    found: dict[int, int] = {}

    def at_step_mark(model: CachingAllocator, nbytes: int) -> None:
        if STEP_MARK < nbytes <= STEP_MARK + 8 and nbytes - STEP_MARK not in found:
            live = [b for b in model.blocks.values() if not b.free]
            found[nbytes - STEP_MARK] = sum(b.size - round_size(b.requested) for b in live)

    replay(case, at_step_mark)
    return found


STEP_MARK = 1000  # cuda_allocator_replay.py --history: an allocation of STEP_MARK + n bytes marks step n's start


def persistent_only(case: dict[str, Any]) -> dict[str, Any]:
    """The whole-block bytes of the parameters and AdamW state allocated alone, against CUDA's at the step's start."""
    start_blocks = [b for s in case["start"] for b in s["blocks"] if b[3] == "active_allocated"]
    cuda_whole = sum(b[1] - round_size(b[2]) for b in start_blocks)
    sizes = [b[2] for s in sorted(case["start"], key=lambda s: s["address"]) for b in s["blocks"]
             if b[3] == "active_allocated" and b[2] > SMALL_SIZE]
    model = CachingAllocator()
    for nbytes in sizes:
        model.malloc(nbytes)
    modelled = model.allocated - sum(round_size(n) for n in sizes)
    return {"cuda_whole_block_bytes_at_start": cuda_whole, "model_from_the_sizes_alone": modelled,
            "large_blocks": len(sizes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", default=str(REPLAY))
    parser.add_argument("--history", default=str(HISTORY))
    parser.add_argument("--out", default="build/allocator_model.json")
    args = parser.parse_args(argv)
    with gzip.open(args.replay, "rt") as f:
        recorded = json.load(f)
    results = {"recorded_on": recorded["device"], "torch": recorded["torch"], "cases": {}}
    exact = True
    for case in recorded["cases"]:
        r = replay(case)
        r["persistent_only"] = persistent_only(case)
        results["cases"][case["klass"]] = r
        same = r["same_address"] == r["allocations"] and r["peak_allocated"]["model"] == r["peak_allocated"]["cuda"]
        exact &= same
        p = r["persistent_only"]
        print(f"{case['klass']}: {r['same_address']:,d} of {r['allocations']:,d} allocations at CUDA's address; "
              f"allocated peak {r['peak_allocated']['model']:,d} (CUDA {r['peak_allocated']['cuda']:,d}); "
              f"whole blocks at the start {p['cuda_whole_block_bytes_at_start']:,d} B, "
              f"from the sizes alone {p['model_from_the_sizes_alone']:,d} B")
    with gzip.open(args.history, "rt") as f:
        histories = json.load(f)
    results["histories"] = {}
    for case in histories["cases"]:
        r = replay(case)
        r["whole_block_bytes_at_step_start"] = whole_blocks_by_step(case)
        results["histories"][case["klass"]] = r
        exact &= r["same_address"] == r["allocations"] and r["peak_allocated"]["model"] == r["peak_allocated"]["cuda"]
        print(f"{case['klass']}, from before its load: {r['same_address']:,d} of {r['allocations']:,d} allocations at "
              f"CUDA's address; whole-block bytes as each step begins: {r['whole_block_bytes_at_step_start']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"the model {'places every allocation as CUDA did' if exact else 'differs from CUDA (above)'}; wrote {out}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
