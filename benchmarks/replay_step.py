"""Replay (model/replay.py) A/B: a matrix cell's rollout, reference pass and update, with the update's
forward recomputed (off) or replayed from the rollout's recording (on), interleaved in one process.

    PYTHONPATH=src python benchmarks/replay_step.py --cell eos-off --repeats 4 --threads 1 --cpu-time

Each repeat runs both variants in alternating order from the same weights (learning rate 1e-7, as the
matrix) and the same RNG state, so both sample the same tokens: the rollout (off: eager, no recording; on:
eager, recording), the reference pass, and the update. Prints the medians of each stage and of the
pairwise ratios, and how far the two variants' log-probs and updated weights are apart. The update runs
eager on both sides (a short run's default) unless --compile-training puts the off side's on the compiled
block (a run of ≥ 200 steps); `--update-only` times the update alone, many pairs on one recorded batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import matrix_learner

from grpo.model.replay import ReplayTape
from grpo.records import PromptBatch, SamplingParams
from grpo.rollout.native import NativeEngine
from grpo.stages import build_train_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="eos-off")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true", help="process CPU time (use with --threads 1)")
    ap.add_argument(
        "--update-only",
        action="store_true",
        help="one recorded rollout, then --repeats interleaved pairs of the update alone on its batch",
    )
    ap.add_argument(
        "--compile-training",
        action="store_true",
        help="the off side's update (and both reference passes) on the compiled block, as a run of ≥ 200 "
        "steps gets by default; replay's update runs eager either way. Default: eager, as a short run",
    )
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    cell, tok, prompts, policy, learner = matrix_learner(args.cell, compile_training=args.compile_training)
    engine = NativeEngine(policy, tok, compile_decode=False)
    tape = ReplayTape()
    sampling = SamplingParams(max_new_tokens=cell["completion"], temperature=1.0)
    start_weights = {k: v.clone() for k, v in policy.state_dict().items()}
    start_optim = learner.optimizer.state_dict()

    def run(replay: bool, seed: int):
        with torch.no_grad():
            for k, v in policy.state_dict().items():
                v.copy_(start_weights[k])
        learner.optimizer.load_state_dict(start_optim)
        engine.tape = learner.replay_tape = tape if replay else None
        if replay:  # the off side leaves the tape alone: its storage is reused as from step to step in a run
            tape.arm()
        torch.manual_seed(seed)
        t0 = clock()
        rollouts = engine.generate(prompts, cell["G"], sampling)
        t1 = clock()
        pb = PromptBatch(prompts=[""] * len(prompts), prompt_token_ids=prompts)
        adv = torch.randn(len(rollouts.group_ids), generator=torch.Generator().manual_seed(seed))
        batch = build_train_batch(
            pb, rollouts, adv, tok.pad_token_id, old_logprobs=rollouts.sampling_logprobs
        )
        batch.ref_logprobs = learner.reference_logprobs(batch)
        t2 = clock()
        stats = learner.train_step(batch)
        t3 = clock()
        weights = {k: v.clone() for k, v in policy.state_dict().items()}
        return (t1 - t0, t2 - t1, t3 - t2), stats, weights, rollouts

    n = len(prompts) * cell["G"]
    print(
        f"cell {args.cell}: {n} rows × ≤ {cell['completion']} tokens; threads {torch.get_num_threads()}, "
        f"{'CPU' if args.cpu_time else 'wall'} time"
    )
    run(True, 0)  # warm-up
    if args.update_only:
        update_only(
            args, learner, engine, tape, prompts, cell, sampling, tok, clock, start_weights, start_optim
        )
        return
    times = {False: [], True: []}
    for r in range(args.repeats):
        out = {}
        for replay in (False, True) if r % 2 == 0 else (True, False):
            out[replay] = run(replay, 100 + r)
            times[replay].append(out[replay][0])
        (_, s0, w0, r0), (_, s1, w1, r1) = out[False], out[True]
        same = torch.equal(r0.completion_ids, r1.completion_ids)
        moved = max((w0[k] - start_weights[k]).abs().max().item() for k in w0)
        apart = max((w0[k] - w1[k]).abs().max().item() for k in w0)
        print(
            f"repeat {r}: same tokens {same}; loss {s0.loss:.6f} / {s1.loss:.6f}; grad norm "
            f"{s0.grad_norm:.6f} / {s1.grad_norm:.6f}; weights moved ≤ {moved:.2e}, apart ≤ {apart:.2e}"
        )
        print(f"  off {[round(x, 3) for x in out[False][0]]} on {[round(x, 3) for x in out[True][0]]}")
    for replay, values in times.items():
        med = [statistics.median(v[i] for v in values) for i in range(3)]
        low = [min(v[i] for v in values) for i in range(3)]
        print(
            f"| replay {'on' if replay else 'off'} | rollout {med[0]:.3f} s | reference {med[1]:.3f} s | "
            f"update {med[2]:.3f} s | total {sum(med):.3f} s | minima {[round(x, 3) for x in low]} |"
        )
    pairs = list(zip(times[False], times[True], strict=True))
    for i, name in enumerate(("rollout", "reference", "update")):
        print(f"pairwise on/off, {name}: ×{statistics.median(b[i] / a[i] for a, b in pairs):.3f}")
    print(f"pairwise on/off, total: ×{statistics.median(sum(b) / sum(a) for a, b in pairs):.3f}")


def update_only(args, learner, engine, tape, prompts, cell, sampling, tok, clock, start_weights, start_optim):
    policy = learner.policy
    engine.tape = tape
    tape.arm()
    torch.manual_seed(1)
    rollouts = engine.generate(prompts, cell["G"], sampling)
    recording = tape.take()
    pb = PromptBatch(prompts=[""] * len(prompts), prompt_token_ids=prompts)
    adv = torch.randn(len(rollouts.group_ids), generator=torch.Generator().manual_seed(1))
    batch = build_train_batch(pb, rollouts, adv, tok.pad_token_id, old_logprobs=rollouts.sampling_logprobs)
    batch.ref_logprobs = learner.reference_logprobs(batch)
    times = {False: [], True: []}
    for r in range(args.repeats):
        for replay in (False, True) if r % 2 == 0 else (True, False):
            with torch.no_grad():
                for k, v in policy.state_dict().items():
                    v.copy_(start_weights[k])
            learner.optimizer.load_state_dict(start_optim)
            learner.replay_tape = tape if replay else None
            tape.armed, tape.calls, tape.recording = True, 1, recording
            t0 = clock()
            learner.train_step(batch)
            times[replay].append(clock() - t0)
    assert recording.missed == 0 and recording.replayed > 0
    for replay, values in times.items():
        print(
            f"| update, replay {'on' if replay else 'off'} | median {statistics.median(values):.3f} s | "
            f"min {min(values):.3f} s | {[round(v, 3) for v in values]} |"
        )
    pairs = zip(times[False], times[True], strict=True)
    print(f"pairwise on/off, update: ×{statistics.median(b / a for a, b in pairs):.3f}")


if __name__ == "__main__":
    main()
