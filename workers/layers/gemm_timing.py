"""Which product (``packed_gemm.PRODUCTS``) each linear weight shape of a CPU model runs at each row bucket,
chosen by timing every product that can run it on this model's own weights, on this CPU, at load.

How it is timed (``plan_table``):
- Decode buckets (up to ``COLD_ROWS`` rows) are memory-bound: what counts is how fast a product streams a
  weight that is not in cache. So they are timed in passes over the model's packable modules in model
  order (the first layers' modules, at least ``COLD_BYTES`` of weights, more than a server CPU's last-level
  cache, then one module of every shape not yet seen, such as the LM head), each call timed on its own:
  as in a real decode step, each weight comes from memory.
- Prefill buckets are compute-bound: one module of each shape, back to back.
- ``REPEATS`` rounds after a warm-up round (prefill buckets: ``2 * REPEATS + 1``), the products in a rotated
  order each round; the median of the rounds. Prefill buckets get more rounds because they are cheap (0.6 s
  more in bf16, 1.3 s in fp32, at a first start here) and because one noisy stretch there decided a shape for
  good: a plan timed at a server start in the middle of a serving benchmark gave the C GEMM 25.6 ms against
  oneDNN's 18.4 ms for 3072x576 at 2,048 rows, and so sent that shape's prefill to oneDNN, while alternating
  calls measured the C GEMM 1.01-1.19x faster at every row count from 998 to 2,048 (2-core AMD EPYC,
  2026-11-30).
  The fastest product takes a bucket, but another product must be more than ``C_MARGIN`` times faster to
  take it from the fastest tile product (the C GEMM or the AMX product, which the one-call decode path can
  run too): products a few percent apart swap places between timings on the same machine (576x576 at 2,048
  rows on the 2-core AMD EPYC: oneDNN ahead 5.11 vs 5.39 ms on 2026-11-29 and 3.57 vs 3.69 on 2026-11-30,
  the C GEMM ahead 3.21 vs 3.51 an hour before that), so such a difference is no reason to leave the C GEMM.
- A close call is timed again: where, after every bucket is timed, the fastest tile product and the fastest
  other product of a prefill bucket are within ``CLOSE`` of each other, that shape gets ``CLOSE_ROUNDS`` more
  rounds at that bucket, and the decision takes the median of both records. Seven rounds at a start were not
  enough there: fp32, 576x576 at 2,048 rows, a plan timed as ``benchmarks.cpu_gemm`` starts saw the C GEMM
  0.95-0.98x oneDNN's time and kept it, and the benchmark's rounds then measured it 1.14-1.16x oneDNN's (two
  of five runs on 2026-12-01, 2-core AMD EPYC); four plans timed in a row in one process put the same ratio
  at 1.03, 1.15, 1.17 and 1.17. With the extra rounds, four in a row gave 1.15-1.18, and oneDNN took the
  bucket each time. On a CPU with AMX, oneDNN is 3-11x faster than the C GEMM there (#59); the AMX product
  competes with it. A shape is timed only up to the rows it can see (the LM head: ``max_num_seqs``); the
  buckets above take the decision of the largest timed one.
- A merged gate/up projection that SiLU * up follows (``silu_after``, set by the decoder's MLP) is timed with
  the activation: the tile products as their fused passes (``cpu_gemm.silu_mul_linear``,
  ``cpu_amx.silu_mul_linear``, which never write the [rows, 2 * inter] product), the others as their product
  then ``kernels.silu_and_mul``, since that is what each costs the layer. Its plan is its own (key
  ``(out, in, "silu")``, "+silu" in the log), apart from any plain weight of that shape.
- Between two timed prefill buckets the product that wins can change: a crossover. ``REFINED_ROWS`` (64, 256,
  1,024: the geometric midpoints of 32 / 128 / 512 / 2,048) are buckets of their own, timed (like a prefill
  bucket, close calls again) for the shapes whose buckets either side chose different products, and
  elsewhere given the decision both sides share. Without them a call of 64 or 1,024 rows took a neighbour's
  decision across a crossover: on the 2-core Intel Xeon with AMX (2026-12-01, ``benchmarks.cpu_gemm``),
  576x1536 at 1,024 rows ran oneDNN (the 2,048-row winner) at 1.23x the AMX product's time, 960x576 at
  1.19x, and fp32 gate/up + SiLU at 64 rows oneDNN (the 128-row winner) at 1.39x the C GEMM's: three of the
  four misses of more than 10% in those runs. Where no crossover exists (the C GEMM everywhere on the AMD
  EPYC), they cost no time.
- The decisions (and the times behind them) are cached on disk (``kernels.cpu_choice.ChoiceCache``), per
  dtype, shape, thread count and row limit, so a restart on the same CPU, torch and kernels times nothing.

A forced product (``cpu_gemm`` option or ``PAGEDRAY_CPU_GEMM``) is used for every shape without timing; a
product that cannot run some weight here is a ValueError naming the option.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedray import kernels
from pagedray.kernels.cpu import cpu_amx, cpu_choice, cpu_gemm
from pagedray.kernels.cpu.cpu_choice import ROW_BUCKETS
from torch import nn

from .packed_gemm import TILE_PRODUCTS, candidates, packable_modules

log = logging.getLogger(__name__)

COLD_ROWS = 32
COLD_BYTES = 96 * 2**20
REPEATS = 3
C_MARGIN = 1.05     # a tile product keeps a bucket unless another product is faster by more than this (module doc)
CLOSE = 1.15        # a prefill bucket where the best tile product and the best other are within this factor ...
CLOSE_ROUNDS = 2 * REPEATS + 1   # ... gets this many more rounds, after every bucket (module doc)
# buckets timed for a shape only where the buckets either side disagree (module doc); each must sit between two
# buckets that are always timed (time_products compares a refined bucket's two neighbours)
REFINED_ROWS = (64, 256, 1024)
SILU = "silu"
Shape = tuple   # a weight's (out, in), or (out, in, SILU) for a gate/up projection timed with its activation


def plan_key(module: nn.Module) -> Shape:
    """The key of ``module``'s plan: its weight's shape, with ``SILU`` when SiLU * up follows it and the C GEMM
    can fuse the two (``cpu_gemm.fuses_silu_mul``: the halves start on a tile; no LoRA slots, whose delta goes
    between the product and the activation: ``ColumnParallelLinear.forward_silu_and_mul``)."""
    shape = tuple(module.weight.shape)
    fused = getattr(module, "silu_after", False) and getattr(module, "lora", None) is None
    return (*shape, SILU) if fused and cpu_gemm.fuses_silu_mul(shape[0]) else shape


def shape_name(key: Shape) -> str:
    return f"{key[0]}x{key[1]}" + ("+silu" if SILU in key else "")


@dataclass(frozen=True)
class ShapePlan:
    times: dict[str, tuple[float, ...]]     # product -> median ms per call per bucket (inf: not timed)
    plan: tuple[str, ...]                   # the product of each bucket


@dataclass(frozen=True)
class PlanTable:
    """The plan of every weight shape of one model on this CPU, and where it came from."""

    dtype: torch.dtype
    threads: int
    shapes: dict[Shape, ShapePlan]
    source: str        # "timed", "cached" or "forced by ..."

    def plan(self, module: nn.Module) -> tuple[str, ...]:
        return self.shapes[plan_key(module)].plan

    def format(self) -> str:
        """The table for the start-up log: per shape and bucket the product chosen and, where timed,
        the next best product's time over the chosen one's."""
        lines = [f"linear products ({self.source}; {cpu_choice.cpu_model()}, {self.threads} threads, "
                 f"{str(self.dtype).removeprefix('torch.')}), rows: " + " ".join(f"{r:>13}" for r in ROW_BUCKETS)]
        for key, entry in self.shapes.items():
            cells = []
            for i, product in enumerate(entry.plan):
                others = [t[i] for name, t in entry.times.items() if name != product and math.isfinite(t[i])]
                mine = entry.times.get(product, (math.inf,) * len(ROW_BUCKETS))[i]
                cells.append(product if not others or not math.isfinite(mine) or mine <= 0
                             else f"{product} {min(others) / mine:.2f}x")
            lines.append(f"  {shape_name(key)}: " + " ".join(f"{c:>13}" for c in cells))
        return "\n".join(lines)


def _groups(modules: list[nn.Module]) -> dict[Shape, list[nn.Module]]:
    groups: dict[Shape, list[nn.Module]] = {}
    for module in modules:
        groups.setdefault(plan_key(module), []).append(module)
    return groups


def _forced(groups: dict[Shape, list[nn.Module]], product: str, origin: str) -> dict[Shape, ShapePlan]:
    out = {}
    for shape, modules in groups.items():
        usable = candidates(modules[0].weight)
        if product not in usable:
            raise ValueError(f"{origin}: {product!r} cannot run a {modules[0].weight.dtype} {list(shape[:2])} weight "
                             f"on this CPU (products here: {', '.join(usable)})")
        out[shape] = ShapePlan({}, (product,) * len(ROW_BUCKETS))
    return out


def _operand_kind(product: str) -> str:
    """Products that read the same copy of a weight share it (the tile products: the tile-packed one)."""
    return "tile" if product in TILE_PRODUCTS else product


def _operand(product: str, weight: torch.Tensor):
    if product in TILE_PRODUCTS:
        return cpu_gemm.pack(weight)
    if product == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    return weight


def run_product(product: str, x: torch.Tensor, operand, silu: bool = False) -> torch.Tensor:
    """x [rows, in] times one product's operand (``_operand``) -> [rows, out]; ``silu``: then SiLU * up of the
    two halves -> [rows, out / 2] (the C GEMM fused, the others followed by ``kernels.silu_and_mul``)."""
    if product in TILE_PRODUCTS:
        kernel = cpu_gemm if product == "c" else cpu_amx
        return kernel.silu_mul_linear(x, operand) if silu else kernel.linear(x, operand)
    if product == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(x, operand, None, "none", [], "")
    else:
        y = F.linear(x, operand)
    return kernels.silu_and_mul(y) if silu else y


def _passes(modules: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the decode pass's modules, the prefill pass's modules) of ``modules`` (in model order): module doc."""
    cold, covered = [], 0
    for module in modules:
        if covered >= COLD_BYTES:
            break
        cold.append(module)
        covered += module.weight.numel() * module.weight.element_size()
    groups = _groups(modules)
    seen = {plan_key(m) for m in cold}
    cold += [ms[0] for shape, ms in groups.items() if shape not in seen]
    return cold, [ms[0] for ms in groups.values()]


def _best_tile(times: dict) -> str | None:
    """The tile product (``TILE_PRODUCTS``) with the least time in ``times`` (product -> ms), or None when
    ``times`` has none."""
    tiles = [p for p in TILE_PRODUCTS if p in times]
    return min(tiles, key=lambda p: times[p]) if tiles else None


def _is_close(times: dict[str, float]) -> bool:
    """True when the fastest tile product and the fastest other product are within ``CLOSE`` of each other
    (ms per call)."""
    tile = _best_tile(times)
    others = [t for p, t in times.items() if p not in TILE_PRODUCTS]
    return tile is not None and bool(others) and 1 / CLOSE <= times[tile] / min(others) <= CLOSE


def time_products(modules: list[nn.Module], row_caps: dict[Shape, int], repeats: int = REPEATS,
                  timer: Callable[[], float] = time.perf_counter) -> dict[Shape, dict[str, tuple[float, ...]]]:
    """Median ms per call of every product that can run each shape of ``modules`` (in model order), per
    bucket (inf above the shape's cap in ``row_caps``, and at a ``REFINED_ROWS`` bucket whose neighbours agree);
    close prefill calls get ``CLOSE_ROUNDS`` more rounds, after every bucket (module doc)."""
    groups = _groups(modules)
    cold, hot = _passes(modules)
    products = {shape: candidates(ms[0].weight) for shape, ms in groups.items()}
    operands = {(id(m), _operand_kind(p)): _operand(p, m.weight) for m in {id(m): m for m in cold + hot}.values()
                for p in products[plan_key(m)]}
    widths = {shape[1] for shape in groups}
    dtype = next(iter(groups.values()))[0].weight.dtype
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(ROW_BUCKETS[-1], k, generator=gen).to(dtype) for k in widths}   # [rows, in]
    names = sorted({p for ps in products.values() for p in ps})
    samples = {(shape, p, b): [] for shape in groups for p in products[shape] for b in range(len(ROW_BUCKETS))}

    def time_rounds(b: int, modules: list[nn.Module], rounds: int, warm_up: bool) -> None:
        """``rounds`` rounds of every product over ``modules`` at bucket b (after one untimed when ``warm_up``),
        the products in a rotated order each round; each shape's mean ms per call of a round is one sample."""
        rows = ROW_BUCKETS[b]
        for round_ in range(rounds + warm_up):
            for product in names[round_ % len(names):] + names[:round_ % len(names)]:
                totals: dict[Shape, list[float]] = {}
                for module in modules:
                    shape = plan_key(module)
                    if product not in products[shape] or rows > row_caps[shape]:
                        continue
                    x = inputs[shape[1]][:rows]
                    start = timer()
                    run_product(product, x, operands[(id(module), _operand_kind(product))], SILU in shape)
                    totals.setdefault(shape, []).append((timer() - start) * 1e3)
                if round_ or not warm_up:
                    for shape, calls in totals.items():
                        samples[(shape, product, b)].append(sum(calls) / len(calls))

    def medians(shape: Shape, b: int) -> dict[str, float]:
        return {p: statistics.median(samples[(shape, p, b)]) for p in products[shape] if samples[(shape, p, b)]}

    def times_of(shape: Shape) -> dict[str, tuple[float, ...]]:
        return {p: tuple(medians(shape, b).get(p, math.inf) for b in range(len(ROW_BUCKETS))) for p in products[shape]}

    def retime_close(buckets: list[int]) -> None:
        for b in buckets:
            close = [m for m in hot if ROW_BUCKETS[b] > COLD_ROWS and _is_close(medians(plan_key(m), b))]
            if close:
                time_rounds(b, close, CLOSE_ROUNDS, False)

    base = [b for b, rows in enumerate(ROW_BUCKETS) if rows not in REFINED_ROWS]
    for b in base:
        rows = ROW_BUCKETS[b]
        time_rounds(b, cold if rows <= COLD_ROWS else hot, repeats if rows <= COLD_ROWS else 2 * repeats + 1, True)
    retime_close(base)
    refined = [b for b, rows in enumerate(ROW_BUCKETS) if rows in REFINED_ROWS]
    plans = {shape: _plan(times_of(shape)) for shape in groups}
    for b in refined:      # a bucket between two timed ones: timed for the shapes whose two neighbours disagree
        split = [m for m in hot if plans[plan_key(m)][b - 1] != plans[plan_key(m)][b + 1]]
        if split:
            time_rounds(b, split, 2 * repeats + 1, True)
    retime_close(refined)
    return {shape: times_of(shape) for shape in groups}


def _plan(times: dict[str, tuple[float, ...]]) -> tuple[str, ...]:
    """The fastest product per bucket, the fastest tile product (the C GEMM, the AMX product) unless another is
    faster by more than ``C_MARGIN``; a bucket no product was timed at takes the largest timed bucket's."""
    plan = list(cpu_choice.pick(times))
    for b, fastest in enumerate(plan):
        tile = _best_tile({p: t[b] for p, t in times.items()})
        if tile is not None and times[tile][b] <= C_MARGIN * times[fastest][b]:
            plan[b] = tile
    timed = [b for b in range(len(ROW_BUCKETS)) if any(math.isfinite(t[b]) for t in times.values())]
    for b in range(len(ROW_BUCKETS)):
        if b not in timed:
            plan[b] = plan[max((t for t in timed if t < b), default=min(timed))]
    return tuple(plan)


def _entry_name(dtype: torch.dtype, shape: Shape, threads: int, cap: int) -> str:
    return f"linear {str(dtype).removeprefix('torch.')} {shape_name(shape)} threads={threads} rows<={cap}"


def plan_table(model: nn.Module, option: str, max_num_seqs: int, cache: cpu_choice.ChoiceCache | None = None,
               timer: Callable[[], float] = time.perf_counter, repeats: int = REPEATS) -> PlanTable:
    """The plan of every packable weight shape of ``model`` (weights loaded) for ``option`` (the ``cpu_gemm``
    option: auto | c | onednn | mkl); ``max_num_seqs`` caps the LM head's rows."""
    modules = packable_modules(model)
    groups = _groups(modules)
    threads = torch.get_num_threads()
    if not groups:
        return PlanTable(torch.float32, threads, {}, "nothing to pack")
    dtype = modules[0].weight.dtype
    forced = cpu_choice.forced_product(option)
    if forced is not None:
        origin = "cpu_gemm" if option != "auto" else cpu_choice.PRODUCT_ENV
        return PlanTable(dtype, threads, _forced(groups, forced, origin), f"forced by {origin}={forced}")
    lm_head = getattr(model, "lm_head", None)
    lm_shape = None if lm_head is None or lm_head.weight is None else tuple(lm_head.weight.shape)
    caps = {shape: max_num_seqs if shape == lm_shape else ROW_BUCKETS[-1] for shape in groups}
    cache = cpu_choice.ChoiceCache() if cache is None else cache
    names = {shape: _entry_name(dtype, shape, threads, caps[shape]) for shape in groups}
    stored = cache.entries()
    if all(isinstance(stored.get(name), dict) for name in names.values()):
        try:
            shapes = {shape: ShapePlan({p: tuple(t) for p, t in stored[names[shape]]["times"].items()},
                                       tuple(stored[names[shape]]["plan"])) for shape in groups}
            if all(set(s.plan) <= set(candidates(groups[shape][0].weight)) for shape, s in shapes.items()):
                return PlanTable(dtype, threads, shapes, "cached")
        except (KeyError, TypeError, ValueError):
            pass   # an unreadable entry is timed again
    started = time.perf_counter()
    times = time_products(modules, caps, repeats, timer)
    shapes = {shape: ShapePlan(times[shape], _plan(times[shape])) for shape in groups}
    cache.put({names[shape]: {"times": {p: list(t) for p, t in s.times.items()},
                              "plan": list(s.plan)} for shape, s in shapes.items()})
    return PlanTable(dtype, threads, shapes, f"timed in {time.perf_counter() - started:.1f} s")
