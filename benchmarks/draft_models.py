"""A draft model for speculative decoding made from the target itself: some of its decoder layers, with the
final norm and the LM head (layer skipping, as LayerSkip's self-speculation drafts, without its training).

No smaller model with SmolLM2's tokenizer is on the machine (the hub is not reachable), so
``benchmarks.spec_decode --draft-model`` can draft with such a copy; it shares the target's tokenizer and
vocabulary by construction. What it is worth for SmolLM2-135M-Instruct (greedy, the spec_decode tasks, 3
drafts; 2026-11-26): all 30 layers 100% accepted, layers 0-28 44%, 0-11 + 24-29 5.4%, the first 16 3.7%,
every second layer 0.1%. Skipping layers of an untrained model does not draft well.

    python -m benchmarks.draft_models --layers 0-28    # prints the folder it wrote (under ~/.cache/pagedray)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

CACHE = Path.home() / ".cache" / "pagedray"
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def layers_copy(model_path: str | Path, keep: list[int], out_dir: str | Path | None = None) -> Path:
    """A model folder with the decoder layers ``keep`` of ``model_path``, renumbered in order (written once,
    then reused)."""
    from safetensors.torch import load_file, save_file

    source = Path(model_path)
    config = json.loads((source / "config.json").read_text())
    if not keep or sorted(set(keep)) != keep or not 0 <= keep[0] <= keep[-1] < config["num_hidden_layers"]:
        raise ValueError(f"keep: ascending layer indices in [0, {config['num_hidden_layers']}), got {keep}")
    tag = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in _runs(keep))
    out = Path(out_dir) if out_dir is not None else CACHE / f"{source.name}-layers-{tag}"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    renumber = {old: new for new, old in enumerate(keep)}
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(shard)).items():
            match = LAYER.match(name)
            if match is None:
                tensors[name] = tensor.contiguous()
            elif int(match.group(1)) in renumber:
                tensors[f"model.layers.{renumber[int(match.group(1))]}.{name[match.end():]}"] = tensor.contiguous()
    layers = len(keep)
    for extra in source.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and not extra.name.endswith(".index.json"):
            shutil.copy(extra, out / extra.name)
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][i] for i in keep]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--layers", default="0-28", help="the layers kept, e.g. '0-11,24-29'")
    args = parser.parse_args(argv)
    from pagedray.workers.weights.default_model import resolve_model_path

    print(layers_copy(resolve_model_path(args.model), parse_layers(args.layers)))


def _runs(keep: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    runs: list[tuple[int, int]] = []
    for i in keep:
        runs = runs[:-1] + [(runs[-1][0], i)] if runs and runs[-1][1] == i - 1 else runs + [(i, i)]
    return runs


def parse_layers(text: str) -> list[int]:
    """'0-11,24-29' -> [0, ..., 11, 24, ..., 29]."""
    keep = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        keep += range(int(first), int(last or first) + 1)
    return keep


if __name__ == "__main__":
    main()
