"""Where the TP ranks go: one placement-group bundle per rank.

- Outside a placement group, the executor creates one: ``tensor_parallel_size`` bundles of
  ``{"GPU": 1}`` (CUDA) or ``{"CPU": 1}`` (CPU), with ``config.parallel.placement_strategy``
  (PACK by default; SPREAD / STRICT_PACK / STRICT_SPREAD as configured) and removes it at shutdown.
- Inside a placement group (a Ray Serve replica deployed with ``placement_group_bundles``; found with
  ``ray.util.get_current_placement_group()``), the ranks use that group and nothing is created:
  with ``tp + 1`` or more bundles, bundle 0 is left to the replica itself (Serve places the replica
  actor in bundle 0) and rank ``r`` goes to bundle ``r + 1``; with exactly ``tp`` bundles, rank ``r``
  goes to bundle ``r`` (bundle 0 must then hold the replica and rank 0 together). Fewer bundles than
  ranks is a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

PG_READY_TIMEOUT_S = 120.0


@dataclass
class Placement:
    placement_group: object          # ray.util.placement_group.PlacementGroup
    bundle_indices: list[int]        # bundle of rank r = bundle_indices[r]
    created: bool                    # True when the executor created (and must remove) the group
    use_gpu: bool

    def actor_options(self, rank: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=self.bundle_indices[rank],
            placement_group_capture_child_tasks=False,
        )
        resources = {"num_gpus": 1, "num_cpus": 0} if self.use_gpu else {"num_cpus": 1}
        return {"scheduling_strategy": strategy, **resources}

    def remove(self) -> None:
        if self.created:
            from ray.util import remove_placement_group

            remove_placement_group(self.placement_group)
            self.created = False


def bundle_indices_in_existing_group(num_bundles: int, tp_size: int) -> list[int]:
    if num_bundles >= tp_size + 1:
        return [r + 1 for r in range(tp_size)]
    if num_bundles == tp_size:
        return list(range(tp_size))
    raise ValueError(f"tensor_parallel_size: {tp_size} ranks need {tp_size} (or {tp_size + 1}, one for the "
                     f"replica) placement-group bundles, but the current group has {num_bundles}")


def place_ranks(tp_size: int, use_gpu: bool, strategy: str) -> Placement:
    import ray
    from ray.util import get_current_placement_group, placement_group

    current = get_current_placement_group()
    if current is not None:
        indices = bundle_indices_in_existing_group(len(current.bundle_specs), tp_size)
        return Placement(current, indices, created=False, use_gpu=use_gpu)
    bundle = {"GPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(tp_size)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PG_READY_TIMEOUT_S)
    except Exception:
        ray.util.remove_placement_group(group)
        raise
    return Placement(group, list(range(tp_size)), created=True, use_gpu=use_gpu)
