"""Real-size architectures (random weights) on this CPU: `grpo train` vs TRL's GRPOTrainer, interleaved.

    PYTHONPATH=src .venv/bin/python benchmarks/real_size.py --models qwen2.5-0.5b --frameworks grpo,trl
    PYTHONPATH=src .venv/bin/python benchmarks/real_size.py --models all --frameworks grpo
    PYTHONPATH=src .venv/bin/python benchmarks/real_size.py --frameworks grpo \
        --grpo-extra="--gradient-accumulation-steps 1"      # an A/B of one setting

Settings (both sides): float32 on the CPU, β 0.04, 4 prompts × 4 completions, 64 new tokens, 2 steps,
temperature 1, the bundled tiny_math prompts through the chat template, evaluation off. Llama-3.2-1B
trains LoRA adapters (peft's defaults for the architecture, r 8, alpha 16) on both sides: its full float32
weights, gradients and AdamW state with a reference (≈ 24.7 GB) do not fit this machine; with LoRA the
reference is the base model with the adapters off, on both sides. Each run is a
fresh process; a sampler reads its /proc status every 0.2 s for the RSS timeline and the high-water mark
(VmHWM, the peak RSS). Step times: grpo's metrics.jsonl `time/step`, TRL's trainer step callback.
Writes benchmarks/results/real_size.json (appended per run) and prints a markdown table.
Build the models first (scripts/build_real_model.py); TRL runs in benchmarks/.venv-trl
(benchmarks/setup_trl_venv.sh makes it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "scripts"))
from build_real_model import ARCHITECTURES, PARAMS, build  # noqa: E402 (scripts/ on the path first)

PROMPTS, GENERATIONS, NEW_TOKENS, BETA, STEPS = 4, 4, 64, 0.04, 2
LORA = {"llama-3.2-1b"}  # models trained through LoRA adapters (see above)
RESULTS = HERE / "results" / "real_size.json"
TRL_PYTHON = HERE / ".venv-trl" / "bin" / "python"


def grpo_command(model: Path, out: Path, lora: bool) -> list[str]:
    return [
        sys.executable,
        "-m",
        "grpo",
        "train",
        f"model.name_or_path={model}",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--beta",
        str(BETA),
        "--prompts-per-step",
        str(PROMPTS),
        "--num-generations",
        str(GENERATIONS),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--steps",
        str(STEPS),
        "--learning-rate",
        "1e-6",
        "algorithm.reward_funcs=[common:text_length]",
        "algorithm.reward_weights=[1.0]",
        "--eval-dataset",
        "none",
        "--eval-before",
        "false",
        "--eval-after",
        "false",
        "--save-steps",
        "0",
        "--logging-steps",
        "1",
        "--num-threads",
        "2",
        "--output-dir",
        str(out),
        *(["lora.enabled=true"] if lora else []),
    ]


def trl_command(model: Path, out: Path, lora: bool) -> list[str]:
    return [
        str(TRL_PYTHON),
        str(HERE / "trl_real_step.py"),
        "--model",
        str(model),
        "--prompts",
        str(PROMPTS),
        "--generations",
        str(GENERATIONS),
        "--new-tokens",
        str(NEW_TOKENS),
        "--beta",
        str(BETA),
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        *(["--lora"] if lora else []),
    ]


class RssSampler(threading.Thread):
    """Polls a process's VmRSS/VmHWM (kB) until it exits."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.timeline, self.hwm_kb, self.t0 = pid, [], 0, time.perf_counter()
        self.cpu_s = 0.0

    def run(self) -> None:
        while True:
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if "VmRSS" not in fields:  # a zombie: exited
                return
            rss = int(fields["VmRSS"].split()[0])
            try:  # utime + stime (clock ticks): CPU time, less sensitive than wall time to other jobs
                stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
                self.cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError):
                pass
            self.hwm_kb = max(self.hwm_kb, int(fields["VmHWM"].split()[0]))
            self.timeline.append((round(time.perf_counter() - self.t0, 1), rss // 1024))
            time.sleep(0.2)


def run_one(framework: str, name: str, model: Path, grpo_extra: list[str] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        make = grpo_command if framework == "grpo" else trl_command
        cmd = make(model, out, name in LORA)
        if framework == "grpo":
            cmd += grpo_extra or []
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{HERE}", OMP_NUM_THREADS="2")
        log = Path(tmp) / "log.txt"
        start = time.perf_counter()
        with log.open("w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            sampler = RssSampler(proc.pid)
            sampler.start()
            rc = proc.wait()
            sampler.join()
        wall = time.perf_counter() - start
        text = log.read_text()
        if rc != 0:
            raise SystemExit(f"{framework} on {name} failed (exit {rc}):\n{text[-4000:]}")
        if framework == "grpo":
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in rows if "time/step" in r]
            step_times = [r["time/step"] for r in steps]
            stages = {k: [r[k] for r in steps] for k in steps[0] if k.startswith("time/")}
        else:
            result = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:])
            step_times, stages = result["step_times"], {}
    return {
        "framework": framework,
        "model": name,
        "params": PARAMS[name],
        "lora": name in LORA,
        "step_times_s": step_times,
        "stage_times_s": stages,
        "peak_rss_mb": round(sampler.hwm_kb / 1024),
        "wall_s": round(wall, 1),
        "cpu_s": round(sampler.cpu_s, 1),
        "rss_timeline_mb": sampler.timeline[::5],
        "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", default="qwen2.5-0.5b", help=f"comma list or 'all' ({', '.join(ARCHITECTURES)})"
    )
    ap.add_argument(
        "--frameworks", default="grpo,trl", help="comma list: grpo, trl (run alternately per model)"
    )
    ap.add_argument("--label", default="", help="stored with each result (e.g. the commit)")
    ap.add_argument(
        "--grpo-extra",
        default="",
        help="more `grpo train` arguments in one string, for an A/B: '--gradient-accumulation-steps 1'",
    )
    args = ap.parse_args()
    names = list(ARCHITECTURES) if args.models == "all" else args.models.split(",")
    results = []
    for name in names:
        model = build(name)
        for framework in args.frameworks.split(","):
            r = run_one(framework, name, model, args.grpo_extra.split())
            r["label"], r["grpo_extra"] = args.label, args.grpo_extra
            results.append(r)
            RESULTS.parent.mkdir(exist_ok=True)
            with RESULTS.open("a") as fh:
                fh.write(json.dumps(r) + "\n")
            print(
                f"{framework} {name}: steps {r['step_times_s']} s, peak RSS {r['peak_rss_mb']} MB", flush=True
            )
    print(
        "\n| model | framework | step 1 (s) | step 2 (s) | process CPU (s) | peak RSS (GiB) |"
        "\n|---|---|---|---|---|---|"
    )
    for r in results:
        t = r["step_times_s"] + [float("nan")] * 2
        print(
            f"| {r['model']} | {r['framework']} | {t[0]:.0f} | {t[1]:.0f} | {r['cpu_s']:.0f} | "
            f"{r['peak_rss_mb'] / 1024:.2f} |"
        )


if __name__ == "__main__":
    main()
