"""Write a small "pretrained" GPT-2 as a HuggingFace `save_pretrained` folder, for the
fine-tuning example `examples/finetune.toml` (no downloads: it trains the `hf-causal-lm` test
model for a few steps on the synthetic corpus and saves it).

    python examples/make_pretrained.py examples/pretrained-gpt2
    ovt job create examples/finetune.toml     # S_0 from that folder (init_from)

Needs the hf extra (pip install -e '.[hf]').
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import PreTrainedModel

from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to write (model.safetensors, config.json)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    args = parser.parse_args()
    ex = Executor(load_program("hf-causal-lm", preset="test"), seed=5, policy=PrecisionPolicy(),
                  profile=Profile("pretrain"), mode="plain")
    ex.init_state(5)
    for _ in range(args.steps):
        ex.step()
    model = ex.model
    if not isinstance(model, PreTrainedModel):  # hf-causal-lm builds a transformers model
        raise TypeError(f"hf-causal-lm built a {type(model).__name__}, not a PreTrainedModel")
    model.save_pretrained(args.out)
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters()):,} parameters)")


if __name__ == "__main__":
    main()
