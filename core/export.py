"""``python -m core.export --checkpoint DIR --format safetensors|hf --out DIR [--dtype bf16]``

Writes a committed plait checkpoint's model weights as plait's own
safetensors file (plait names, tied weights once, the model section in the
metadata) or in Hugging Face's Llama layout (``config.json`` plus safetensors
shards) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
Needs no process group and no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.errors import CheckpointError, PlaitError, exit_bad_input


def main(argv: list[str] | None = None) -> int:
    from core.weights import DTYPES

    p = argparse.ArgumentParser(prog="python -m core.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="a committed checkpoint folder (step_XXXXXXXXX)")
    p.add_argument("--format", required=True, choices=["safetensors", "hf"])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: as saved, fp32)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="hf: largest shard in GB")
    args = p.parse_args(argv)
    try:
        from core.weights import checkpoint_model, save_hf, save_safetensors

        spec, config, model = checkpoint_model(args.checkpoint)
        sd = model.state_dict()
        dtype = DTYPES[args.dtype] if args.dtype else None
        if args.format == "safetensors":
            paths = [save_safetensors(sd, args.out, config["model"], dtype)]
        else:
            if not hasattr(spec, "to_hf_state_dict"):
                raise CheckpointError(f"model {config['model']['name']!r} does not support hf export")
            paths = save_hf(spec, sd, args.out, dtype, int(args.shard_gb * 1e9))
    except PlaitError as e:
        exit_bad_input(e)
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
