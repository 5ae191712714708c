#!/usr/bin/env bash
# First contact with a GPU (H100 80 GB or H200): install grpo without deps, run the GPU tests, time one
# GRPO step on a random-weight Qwen2.5-0.5B-architecture model for grpo (native engine, bf16) and TRL 1.16.
#
# On the GPU machine, from the repo root, with the wheels in .whl/ (kept current with the code here; first
# written as ../shared/gpu/first-contact.sh):
#     bash benchmarks/gpu/first-contact.sh       (allow 9 minutes)
# .whl/ holds the wheels the GPU image lacks (see ../shared/reviews/performance-gpu-2026-11-27.md, B2: datasets, dill, multiprocess, trl, math-verify,
# latex2sympy2_extended, antlr4-python3-runtime; ~2.2 MB). Budget: <= 8 min on an H100; every stage has its own
# `timeout`, and the TRL stage is skipped when less than 100 s of the 470 s plan are left.
# Results land in $OUT (gpu.txt, pytest.log, bench-*.log; RESULT lines are JSON).
set -u -o pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
OUT=${OUT:-/tmp/gfc-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false TORCHINDUCTOR_CACHE_DIR=/tmp/gfc-inductor
PY=python3; T0=$SECONDS; PLAN=470
say() { echo "== [$((SECONDS - T0)) s] $*"; }
left() { echo $((PLAN - (SECONDS - T0))); }

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c 'import sys,torch,transformers,triton;print(sys.version.split()[0],torch.__version__,
torch.version.cuda,transformers.__version__,triton.__version__,torch.cuda.get_device_name())' | tee -a "$OUT/gpu.txt"

say "carried wheels into the interpreter's site-packages (subprocess tests reset PYTHONPATH)"
SITE=$($PY -c 'import site;print(site.getsitepackages()[0])')
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || {
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/gfc-site .whl/*.whl &&
      echo /tmp/gfc-site >"$SITE/zz-gfc-site.pth"; }
fi
TRL_OK=1
if ! $PY -c 'import datasets' 2>"$OUT/datasets.err"; then
  # grpo only calls datasets.disable_progress_bars() at start-up (run/assemble.py setup_logging); TRL needs the real one.
  mkdir -p /tmp/gfc-stub/datasets && echo 'def disable_progress_bars(): pass' >/tmp/gfc-stub/datasets/__init__.py
  echo "import sys; sys.path.insert(0, '/tmp/gfc-stub')" >"$SITE/aa-gfc-stub.pth"; TRL_OK=0
  say "datasets does not import (see datasets.err): stubbed for grpo, TRL skipped"
fi
$PY -c 'import trl' 2>>"$OUT/datasets.err" || TRL_OK=0

say "grpo from the working tree, --no-deps"
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>"$OUT/pip-grpo.err" || {
  echo "$PWD/src" >"$SITE/zz-gfc-grpo.pth"; say "editable install failed (pip-grpo.err): src/ put on sys.path"; }
$PY -c 'import grpo.train, grpo.cli, grpo.rollout.native; print("import grpo: ok")' || exit 1

say "pytest tests/gpu -x -q (not slow: the real-size builds run single-threaded under conftest; <= 230 s)"
# GFC_PYTEST_ARGS: extra arguments, e.g. a --deselect for a test already known to fail.
timeout -k 10 230 $PY -m pytest tests/gpu -x -q -rs -m "not slow" -p no:cacheprovider --timeout 170 \
  ${GFC_PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
say "pytest exit ${PIPESTATUS[0]} (124 = stopped by the 230 s limit)"

cat >/tmp/gfc_bench.py <<'PYEOF'
"""One GRPO step, grpo vs TRL, on a random Qwen2.5-0.5B-architecture model: 8 prompts x 8 completions,
64-token prompts, 128 new tokens, beta 0.04, temperature 1, no top-k/top-p (the CPU matrix's eos-off cell,
at real size). Prints RESULT {json}. Modes: build | grpo | grpo-compiled | trl."""
import json, os, statistics, sys, tempfile, time
from pathlib import Path
import torch
ROOT = Path.cwd(); sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "benchmarks")]
MODEL, P, G, LP, T, S, BETA = Path("/tmp/gfc-q05"), 8, 8, 64, 128, 4, 0.04
SPEC = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12)]  # bf16 dense

def text_length(prompts, completions, **_):
    return [len(c[-1]["content"] if isinstance(c, list) else c) / 10 for c in completions]

def tokenizer():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL); tok.chat_template = None; tok.padding_side = "left"
    return tok

def rows(tok):
    from common import make_prompts
    return [{"prompt": p} for p in make_prompts(tok, LP, P * S)]

def forward_flops(mean_len, shared=True):
    """One forward over the step's tokens: 2 x GEMM weights per token (LM head on predicted tokens only)
    + attention (QK^T and PV). shared: each prompt once per group (grpo); else once per row (TRL)."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(MODEL); d, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    D = getattr(c, "head_dim", None) or d // c.num_attention_heads
    hq, hkv = c.num_attention_heads * D, c.num_key_value_heads * D
    body = L * (2 * d * hq + 2 * d * hkv + 3 * d * c.intermediate_size)
    R, t = P * G, mean_len; np_ = P if shared else R
    tokens = np_ * LP + R * (t - 1)
    att = 4.0 * hq * L * (np_ * LP * (LP + 1) / 2 + R * ((t - 1) * LP + (t - 1) * t / 2))
    return 2.0 * body * tokens + 2.0 * V * d * R * t + att

def peaks():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
    for _ in range(5): a @ b
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): a @ b
    torch.cuda.synchronize(); measured = 2 * 8192**3 * 20 / (time.perf_counter() - t)
    name = torch.cuda.get_device_name()
    return measured, next((v for k, v in SPEC if k in name), 989e12)

def report(fw, step_s, mean_len, stages, update_s, extra):
    measured, spec = peaks(); R = P * G
    upd = 3 * forward_flops(mean_len)  # the update's required work (forward + backward)
    out = {"framework": fw, "device": torch.cuda.get_device_name(), "s_per_step": round(step_s, 3),
           "completion_tokens_per_s": round(R * mean_len / step_s), "mean_completion_len": mean_len,
           "stages_s": {k: round(v, 3) for k, v in stages.items()},
           "update_tflop_required": round(upd / 1e12, 2),
           "mfu_update_vs_spec": None if not update_s else round(upd / update_s / spec, 4),
           "mfu_update_vs_measured_mm": None if not update_s else round(upd / update_s / measured, 4),
           "bf16_mm_tflops_measured": round(measured / 1e12), "bf16_spec_tflops": round(spec / 1e12),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), **extra}
    print("RESULT " + json.dumps(out), flush=True)

def run_grpo(compile_decode):
    from grpo import GRPOConfig, GRPOTrainer
    import grpo.run.lifecycle as lc
    lc.save_checkpoint = lambda *a, **k: None  # a timing run writes no 2 x 6 GB of checkpoints at the end
    lc.save_final = lambda *a, **k: None
    tok = tokenizer(); out = tempfile.mkdtemp(prefix="gfc-grpo-")
    cfg = GRPOConfig(model=str(MODEL), device="cuda", dtype="bfloat16", output_dir=out, batch_size=P,
                     num_generations=G, max_new_tokens=T, steps=S, beta=BETA, learning_rate=1e-7,
                     warmup_steps=0, temperature=1.0, top_k=0, top_p=1.0, logging_steps=1,
                     progress_bar=False, seed=0, eval_dataset=None, tensorboard=False, save_steps=0,
                     report=False)
    cfg.update({"data.max_prompt_length": 1024, "generation.compile_decode": compile_decode})
    t0 = time.perf_counter()
    GRPOTrainer(config=cfg, tokenizer=tok, train_dataset=rows(tok), reward_funcs=[text_length]).train()
    wall = time.perf_counter() - t0
    steps = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "time/step" in s]
    later = steps[1:] or steps
    med = lambda k: statistics.median(s.get(k, 0.0) for s in later)
    stages = {k[5:]: med(k) for k in later[0] if k.startswith("time/") and k != "time/step"}
    report("grpo native bf16" + (" compile_decode" if compile_decode else ""), med("time/step"),
           med("completion_len/mean"), stages, stages.get("update"),
           {"first_step_s": round(steps[0]["time/step"], 2), "run_wall_s": round(wall, 1),
            "rollout_tokens_per_s": round(P * G * med("completion_len/mean") / max(stages.get("rollout", 1e-9), 1e-9))})

def run_trl():
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Timer(TrainerCallback):
        def __init__(self): self.times, self.lens = [], []
        def on_step_begin(self, *a, **k): torch.cuda.synchronize(); self.t = time.perf_counter()
        def on_step_end(self, *a, **k): torch.cuda.synchronize(); self.times.append(time.perf_counter() - self.t)
        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs: self.lens.append(logs["completions/mean_length"])

    tok = tokenizer(); timer = Timer(); gen = []
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="gfc-trl-"), per_device_train_batch_size=P * G,
                     num_generations=G, gradient_accumulation_steps=1, max_completion_length=T, beta=BETA,
                     temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-7, max_steps=S, report_to="none",
                     save_strategy="no", logging_steps=1, disable_tqdm=True, shuffle_dataset=False, seed=0)
    tr = GRPOTrainer(model=str(MODEL), reward_funcs=text_length, args=cfg,
                     train_dataset=Dataset.from_list(rows(tok)), processing_class=tok, callbacks=[timer])
    inner = getattr(tr, "_generate_and_score_completions", None)  # generation + rewards + reference logps
    if inner is not None:
        def timed(*a, **k):
            torch.cuda.synchronize(); t = time.perf_counter(); r = inner(*a, **k)
            torch.cuda.synchronize(); gen.append(time.perf_counter() - t); return r
        tr._generate_and_score_completions = timed
    tr.train()
    step = statistics.median(timer.times[1:] or timer.times)
    mean_len = statistics.median(timer.lens[1:] or timer.lens) if timer.lens else float(T)
    g = statistics.median(gen[1:] or gen) if gen else None
    stages = {} if g is None else {"generate_score_reference": g, "update": step - g}
    actual = 4 * forward_flops(mean_len, shared=False)  # TRL: prompts per row, checkpointing recompute
    report(f"trl {trl.__version__} (transformers generate, defaults)", step, mean_len, stages,
           stages.get("update"), {"gradient_checkpointing": cfg.gradient_checkpointing, "bf16": cfg.bf16,
           "update_tflop_actual": round(actual / 1e12, 2)})

def probe():
    """Which SDPA kernel the native training attention gets on this GPU, and the LM-head chunk size."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from grpo.model.packed import chunk_rows
    from grpo.model.shared_prompt import attention_route
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    q = torch.randn(8, 14, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(8, 2, 192, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    mask = torch.ones(64, 192, device="cuda", dtype=torch.bool).tril(128)[None, None].expand(8, 1, 64, 192)
    route = attention_route(torch.device("cuda"))  # what grpo's completion attention does on CUDA
    cases = {"prefill/prompt: is_causal, enable_gqa (model/decode.py, shared_prompt.py)": dict(is_causal=True),
             "completion, CPU route: bool attn_mask, enable_gqa": dict(attn_mask=mask),
             f"completion, CUDA route ({route}): bool attn_mask, K/V expanded": dict(attn_mask=mask, expand=True)}
    for name, kw in cases.items():
        kk, vv = (k, v) if "attn_mask" in kw else (k[:, :, :64], v[:, :, :64])
        gqa = not kw.pop("expand", False)
        if not gqa:
            kk, vv = kk.repeat_interleave(7, dim=1), vv.repeat_interleave(7, dim=1)
        try:
            with sdpa_kernel(fused):
                F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa, **kw).sum().backward()
            print(f"PROBE {name}: a fused kernel (flash/efficient/cudnn) runs it")
        except RuntimeError as e:
            print(f"PROBE {name}: NO fused kernel -> math fallback ({str(e).splitlines()[0][:90]})")
    rows = chunk_rows(151936, torch.device("cuda"))
    print(f"PROBE LM-head chunk for a 151,936-row vocabulary: {rows} rows (model/packed.py chunk_rows)")

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "probe":
        probe()
    elif mode == "build":
        from build_real_model import build
        t = time.perf_counter(); build("qwen2.5-0.5b", MODEL)
        print(f"built {MODEL} in {time.perf_counter() - t:.0f} s")
    elif mode in ("grpo", "grpo-compiled"):
        run_grpo(mode == "grpo-compiled")
    else:
        run_trl()
PYEOF

say "probe: SDPA kernels of the native training attention, LM-head chunking"
timeout -k 5 60 $PY /tmp/gfc_bench.py probe 2>&1 | tee "$OUT/probe.log" | grep PROBE
say "build the random Qwen2.5-0.5B-architecture model"
timeout -k 10 120 $PY /tmp/gfc_bench.py build 2>&1 | tail -3 || exit 1
say "grpo step (native engine, bf16 compute, fp32 masters)"
timeout -k 10 120 $PY /tmp/gfc_bench.py grpo 2>&1 | tee "$OUT/bench-grpo.log" | grep -v '^\s*$' | tail -25
if [ "$TRL_OK" = 1 ] && [ "$(left)" -gt 100 ]; then
  say "TRL step (1.16, defaults: transformers generate, bf16, gradient checkpointing)"
  timeout -k 10 $(( $(left) - 10 )) $PY /tmp/gfc_bench.py trl 2>&1 | tee "$OUT/bench-trl.log" | tail -25
else
  say "TRL skipped (TRL_OK=$TRL_OK, $(left) s left of the plan)"
fi
if [ "${GFC_COMPILE:-0}" = 1 ]; then  # optional: compiled decode step (a 24-layer graph compiles for minutes)
  timeout -k 10 240 $PY /tmp/gfc_bench.py grpo-compiled 2>&1 | tee "$OUT/bench-grpo-compiled.log" | tail -5
fi
say "summary"
grep -h '^RESULT' "$OUT"/bench-*.log 2>/dev/null | tee "$OUT/results.jsonl"
grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -2
