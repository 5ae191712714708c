"""What mixed precision costs on the bundled model (CPU here; `--device cuda` on a GPU).

1. The per-generate cast: the native engine converts the float32 masters to the compute dtype once per
   `generate` call (`decode_weights`); compared with the same preparation in float32 and with a whole
   rollout step.
2. Training forward + backward, two ways to compute in bf16 from float32 masters: autocast / casts as read
   (what the learner does) against a bf16 working copy (a second module, whose bf16 gradients would then
   be copied to the masters: that copy is not timed here).

    PYTHONPATH=src python benchmarks/precision.py [--device cuda] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.model.forward import PolicyForward
from grpo.model.loading import bundled_model_path
from grpo.records import SamplingParams
from grpo.rollout import build_engine
from tests.unit.test_precision import bundled_batch


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev, bf16 = args.device, torch.bfloat16
    path = bundled_model_path()
    masters = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).train()
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    out: dict[str, float] = {"params_M": sum(p.numel() for p in masters.parameters()) / 1e6}

    fuse = dev == "cpu"
    native16 = build_engine("native", masters, tok, compute_dtype=bf16)
    native32 = build_engine("native", masters, tok)
    out["decode_weights_fp32_s"] = timed(
        lambda: native32.decoder.decode_weights(fuse=fuse), args.repeats, dev
    )
    out["decode_weights_bf16_cast_s"] = timed(
        lambda: native16.decoder.decode_weights(fuse=fuse), args.repeats, dev
    )
    out["plain_cast_all_params_s"] = timed(
        lambda: [p.detach().to(bf16) for p in masters.parameters()], args.repeats, dev
    )
    prompts = [tok(f"What is {i} + {i + 3}?")["input_ids"] for i in range(4)]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    out["rollout_4x4x16_bf16_s"] = timed(lambda: native16.generate(prompts, 4, sampling), args.repeats, dev)
    out["rollout_4x4x16_fp32_s"] = timed(lambda: native32.generate(prompts, 4, sampling), args.repeats, dev)

    batch = bundled_batch()
    copy16 = copy.deepcopy(masters).to(bf16)

    def step(fn):
        def run():
            logp, _ = fn(batch, 1.0)
            logp.sum().backward()

        return run

    for engine, native in (("native", True), ("transformers", False)):
        out[f"train_{engine}_fp32_s"] = timed(step(PolicyForward(masters, native=native)), args.repeats, dev)
        out[f"train_{engine}_masters_bf16_compute_s"] = timed(
            step(PolicyForward(masters, native=native, compute_dtype=bf16)), args.repeats, dev
        )
        out[f"train_{engine}_bf16_working_copy_s"] = timed(
            step(PolicyForward(copy16, native=native)), args.repeats, dev
        )
    out["torch"] = torch.__version__
    out["device"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
