"""DPO training throughput: ``finetune --objective dpo`` vs TRL's ``DPOTrainer`` + DeepSpeed ZeRO-3,
same model/data/batch, the reference log-probabilities precomputed on both sides.

    .venv/bin/python bench/preference/dpo_throughput.py [--steps 30] [--rounds 3]
                                               [--out bench/results/dpo_throughput.json]

One invocation launches, one after the other, each as 2 ranks through the DeepSpeed launcher:

* ``deepspeed --num_gpus 2 --module finetune --objective dpo ...``        (our CLI, unmodified)
* ``deepspeed --num_gpus 2 bench/train/trl_pref_run.py --objective dpo --precompute_ref ...``
                                                        (TRL 1.16's ``DPOTrainer``, ``deepspeed=``)

in the order finetune, TRL, TRL, finetune, ... (``--rounds`` pairs, alternating which goes first),
and prints a table, the ratio of each pair of launches and their median.

Identical on both sides
-----------------------
As bench/train/train_throughput.py (P1), whose inputs, launcher, quiet-machine wait, CPU-load
accounting and parsing of both tools' timings this script reuses:

* Model: ``finetune/resources/model/config.json`` scaled to ``--hidden_size``/``--num_layers``
  (P1's scaling), built from the config (finetune ``--config_name``, TRL ``from_config``), fp32,
  seed 42, partitioned under ``zero.Init``; the embedded tokenizer.
* Data: ``finetune/resources/data/preference_train.jsonl`` (1000 pairs: ``prompt``, ``chosen``,
  ``rejected``; or its first ``--pairs``), untruncated on both sides (finetune's
  ``--max_seq_length`` is longer than any pair; TRL's ``max_length=None``); no evaluation
  (finetune ``--validation_split_percentage 0``), no saves.
* DPO (sigmoid loss), ``--beta`` 0.1; the reference is the initial model, its log-probabilities
  computed over all the training pairs before the first step: finetune's ``--reference
  precompute`` (its default) into a fresh ``--dataset_cache_dir`` per launch, so that every
  launch computes it; TRL's ``precompute_ref_log_probs`` into the launch's own output folder.
  Reference batches: ``--per_device_train_batch_size`` pairs on both (finetune's
  ``--per_device_eval_batch_size``; TRL's default is the train batch).
* ``--per_device_train_batch_size`` pairs per rank and step (each a chosen and a rejected row),
  gradient accumulation 1, lr ``--learning_rate`` with ``--lr_warmup_steps`` linear warmup then
  linear decay, AdamW (the DeepSpeed JSON's), weight decay 0, clipping 1.0, ``--logging_steps``
  on both; ``configs/ds_zero3.json`` (for TRL without ``train_batch_size``, as P1 gives HF).
* TRL's rows are finetune's first-epoch order read in sequence (trl_pref_run.py's
  ``--data_order finetune``), so both train the same pairs at each step.

What is measured
----------------
tokens/s = (non-pad tokens of the chosen and rejected rows, prompts included, trained on in
optimizer steps W+1 .. N, summed over both ranks) / (wall time from the end of step W to the end
of step N), exactly as P1: finetune from ``OUT/metrics.jsonl``'s windows, TRL from rank 0's
per-step ``time.perf_counter`` and the ranks' cumulative token counts (``R.rank{r}.json``). N =
``--steps``, W = ``--warmup``: start-up and both reference passes are outside the timed span.

The ratio is the median over the pairs of launches (1-2, 3-4, ...: one per tool, alternating
order) of finetune's tokens/s over TRL's; per-tool figures are total tokens / total timed seconds.

The reference pass's share of a finetune launch: the seconds finetune reports for it (its line
``reference log-probs: computed (N train pairs) in X s``) over the launch's wall time (launcher
start to exit, from here). TRL's own pass (its progress bar's elapsed seconds, 1 s resolution) and
its start-up to the first step (``startup_s``) are recorded alongside.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import REPO, free_port, machine, med, versions  # noqa: E402
from bench.train import train_throughput as tp  # noqa: E402

PAIRS = tp.RES / "data" / "preference_train.jsonl"
TRL_SCRIPT = REPO / "bench" / "train" / "trl_pref_run.py"
TOOLS = ("finetune", "trl")
NAMES = {"finetune": "finetune", "trl": "TRL"}
# finetune's line after its reference pass (finetune/reference.py)
REFERENCE_LINE = re.compile(r"reference log-probs: (\w+) \((.+?) pairs\) in ([0-9.]+) s")
# TRL's progress bar of its reference pass over the train set, at 100%: [mm:ss<...] or [h:mm:ss<
TRL_BAR = re.compile(
    r"Computing reference log probs for train dataset: 100%\|[^|\r\n]*\|\s*(\d+)/\1 "
    r"\[(?:(\d+):)?(\d+):(\d+)<"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per launch (N)")
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from timing (W)")
    p.add_argument("--logging_steps", type=int, default=5)
    p.add_argument(
        "--per_device_train_batch_size", type=int, default=8, help="pairs per rank and step"
    )
    p.add_argument(
        "--max_seq_length",
        type=int,
        default=512,
        help="finetune's truncation, longer than any pair (TRL truncates nothing)",
    )
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument(
        "--lr_warmup_steps", type=int, default=5, help="learning-rate warmup (both tools)"
    )
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="train on the first this many pairs (0: all 1000); the reference scores them all",
    )
    p.add_argument("--num_gpus", type=int, default=2, help="ranks per launch")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="pairs of launches; order alternates (finetune, TRL), (TRL, finetune), ...",
    )
    tp.add_launch_args(p)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "dpo_throughput.json"))
    a = p.parse_args(argv)
    tp.check_window(p, a)
    # what P1's helpers read: its default model shape and setting, fp32, the given rows
    a.shape, a.setting, a.precision, a.long_rows = "scaled", "default", "fp32", False
    return a


def write_pairs(a: argparse.Namespace, tmp: Path) -> Path:
    if not a.pairs:
        return PAIRS
    path = tmp / "pairs.jsonl"
    path.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[: a.pairs]))
    return path


def finetune_cmd(a: argparse.Namespace, inputs: dict, run_dir: Path) -> list[str]:
    """P1's finetune launch (same model, DeepSpeed JSON, optimizer and schedule flags) on the
    pairs, under --objective dpo with its reference precomputed into a fresh cache."""
    return [
        *tp.finetune_cmd(a, inputs, run_dir / "out"),
        "--objective",
        "dpo",
        "--beta",
        str(a.beta),
        "--reference",
        "precompute",
        "--per_device_eval_batch_size",
        str(a.per_device_train_batch_size),
        "--dataset_cache_dir",
        str(run_dir / "cache"),
    ]


def trl_cmd(a: argparse.Namespace, inputs: dict, run_dir: Path) -> list[str]:
    return [
        tp.deepspeed_launcher(),
        "--num_gpus",
        str(a.num_gpus),
        "--master_port",
        str(free_port()),
        str(TRL_SCRIPT),
        "--objective",
        "dpo",
        "--precompute_ref",
        "--config_dir",
        inputs["model_dir"],
        "--tokenizer_dir",
        str(tp.TOKENIZER_DIR),
        "--train_file",
        inputs["train_file"],
        "--ds_config",
        inputs["ds_hf_path"],
        "--output_dir",
        str(run_dir / "trainer_out"),
        "--result",
        str(run_dir / "hf.json"),  # rank files hf.rank{r}.json, as P1's measure_hf reads them
        "--per_device_train_batch_size",
        str(a.per_device_train_batch_size),
        "--learning_rate",
        str(a.learning_rate),
        "--lr_scheduler_type",
        "linear",
        "--warmup_steps",
        str(a.lr_warmup_steps),
        "--max_steps",
        str(a.steps),
        "--logging_steps",
        str(a.logging_steps),
        "--beta",
        str(a.beta),
        "--seed",
        "42",
    ]


def finetune_reference(log: Path) -> dict:
    """finetune's reference pass from its log: how (must be "computed"), pairs, seconds."""
    found = REFERENCE_LINE.findall(log.read_text(errors="replace"))
    if not found:
        sys.exit(f"bench: no 'reference log-probs' line in {log}")
    how, pairs, seconds = found[-1]
    if how != "computed":
        sys.exit(f"bench: finetune's reference was {how}, not computed, in {log}")
    return {"how": how, "pairs": pairs, "seconds": float(seconds)}


def trl_reference_s(log: Path) -> float | None:
    """TRL's reference pass over the train set: its progress bar's elapsed time at 100%."""
    found = TRL_BAR.findall(log.read_text(errors="replace"))
    if not found:
        return None
    _, h, m, s = found[-1]
    return 3600 * int(h or 0) + 60 * int(m) + int(s)


# what each tool's summary also lists per launch
PER_LAUNCH = ("wall_s", "reference_s")


def pair_ratios(launches: list[dict]) -> list[float]:
    """finetune / TRL tokens/s of each pair of launches in a row (1-2, 3-4, ...)."""
    out = []
    for i in range(0, len(launches) - 1, 2):
        pair = {m["tool"]: m["tokens_per_s"] for m in launches[i : i + 2]}
        if set(pair) == set(TOOLS):
            out.append(pair["finetune"] / pair["trl"])
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    out_path = Path(a.out).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    logs_dir = out_path.parent / (out_path.stem + "_logs")
    if logs_dir.exists():
        shutil.rmtree(logs_dir)
    logs_dir.mkdir()
    env = tp.launch_env(a)
    started = _dt.datetime.now(_dt.timezone.utc)
    order = [t for i in range(a.rounds) for t in (TOOLS if i % 2 == 0 else TOOLS[::-1])]
    launches = []
    with tempfile.TemporaryDirectory(prefix="bench_dpo_") as tmp_s:
        tmp = Path(tmp_s)
        inputs = tp.write_inputs(a, tmp)
        inputs["train_file"] = str(write_pairs(a, tmp))
        for i, tool in enumerate(order):
            run_dir = tmp / f"{i}_{tool}"
            run_dir.mkdir()
            log = logs_dir / f"{i}_{tool}.log"
            cmd = (finetune_cmd if tool == "finetune" else trl_cmd)(a, inputs, run_dir)
            print(f"[bench] launch {i + 1}/{len(order)}: {tool} (log: {log})", flush=True)
            info = tp.timed_launch(a, cmd, tmp, env, log)
            if tool == "finetune":
                m = tp.measure_finetune(run_dir / "out", a)
                m["reference"] = finetune_reference(log)
                m["reference_s"] = m["reference"]["seconds"]
                m["reference_share"] = m["reference_s"] / info["wall_s"]
                shutil.copy(
                    run_dir / "out" / "metrics.jsonl", logs_dir / f"{i}_{tool}_metrics.jsonl"
                )
            else:
                m = tp.measure_hf(run_dir, a)
                m["reference_s"] = trl_reference_s(log)
                m["startup_s"] = m["meta"]["startup_s"]
            m.update(tool=tool, launch=i, **info)
            ref = (
                f"reference pass {m['reference_s']:.1f} s"
                if m["reference_s"] is not None
                else "reference pass not found in the log"
            )
            print(
                f"[bench]   {tool}: {m['tokens_per_s']:.1f} tokens/s "
                f"over steps {a.warmup + 1}..{a.steps} "
                f"({m['tokens']} tokens in {m['seconds']:.2f}s; launch wall {info['wall_s']:.1f}s, "
                f"{ref}, foreign CPU {info['foreign_cpu_s']}s)",
                flush=True,
            )
            launches.append(m)

    summary = tp.summarize(launches, TOOLS, PER_LAUNCH)
    quiet = tp.summarize([m for m in launches if not m["contended"]], TOOLS, PER_LAUNCH)
    ratios = pair_ratios(launches)
    ft = [m for m in launches if m["tool"] == "finetune"]
    reference = {
        "reference_s": [m["reference_s"] for m in ft],
        "wall_s": [m["wall_s"] for m in ft],
        "shares": [m["reference_share"] for m in ft],
        # all finetune launches: their reference seconds over their wall seconds
        "share": sum(m["reference_s"] for m in ft) / sum(m["wall_s"] for m in ft),
        "pairs": ft[0]["reference"]["pairs"],
    }
    result = {
        "benchmark": "dpo_throughput",
        "date_utc": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else argv,
        "machine": machine(),
        "versions": versions(),
        "settings": {
            **vars(a),
            "omp_num_threads": env.get("OMP_NUM_THREADS"),
            "order": order,
            "tokenizer": str(tp.TOKENIZER_DIR.relative_to(REPO)),
            "train_file": str(PAIRS.relative_to(REPO)),
            "gradient_accumulation_steps": 1,
            "zero_stage": 3,
            "objective": "dpo (sigmoid)",
            "reference": "precomputed (finetune --reference precompute; TRL --precompute_ref)",
        },
        "model_config": inputs["model_config"],
        "ds_config_finetune": inputs["ds_finetune"],
        "ds_config_trl": inputs["ds_hf"],
        "measure": (
            f"non-pad tokens of the chosen and rejected rows (all ranks) trained in optimizer "
            f"steps {a.warmup + 1}..{a.steps} / rank-0 wall time from end of step {a.warmup} to "
            f"end of step {a.steps}"
        ),
        "summary": summary,
        "pair_ratios": ratios,
        "ratio": med(ratios),
        "ratio_total_tokens": summary["finetune"]["tokens_per_s"] / summary["trl"]["tokens_per_s"],
        "summary_quiet_launches": quiet,
        "ratio_quiet_launches": (
            quiet["finetune"]["tokens_per_s"] / quiet["trl"]["tokens_per_s"] if quiet else None
        ),
        "reference": reference,
        "launches": launches,
        "logs_dir": str(logs_dir),
    }
    out_path.write_text(json.dumps(result, indent=1, default=str))

    print()
    print(
        f"DPO training throughput, {a.num_gpus} ranks, ZeRO-3, fp32, "
        f"{inputs['model_config']['num_hidden_layers']} layers "
        f"x {inputs['model_config']['hidden_size']}, {a.per_device_train_batch_size} pairs/rank, "
        f"reference precomputed, OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}"
    )
    print(
        f"{'launch':>6}  {'tool':<9} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'wall s':>7} "
        f"{'ref s':>6}  other load"
    )
    for m in launches:
        load = (
            "n/a"
            if m["foreign_cpu_share"] is None
            else f"{100 * m['foreign_cpu_share']:.0f}% of CPU"
            + (" (contended)" if m["contended"] else "")
        )
        ref = "–" if m["reference_s"] is None else f"{m['reference_s']:.1f}"
        print(
            f"{m['launch'] + 1:>6}  {NAMES[m['tool']]:<9} {m['tokens']:>7} {m['seconds']:>8.2f} "
            f"{m['tokens_per_s']:>9.1f} {m['wall_s']:>7.1f} {ref:>6}  {load}"
        )
    for tool, s in summary.items():
        print(f"{NAMES[tool]:<9} {s['tokens_per_s']:.1f} tokens/s over launches {s['launches']}")
    print(
        "pair ratios finetune/TRL: "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f"; median {result['ratio']:.3f}"
    )
    print(
        f"finetune's reference pass: {reference['share']:.3f} of its launches' wall time "
        f"({', '.join(f'{s:.1f}' for s in reference['reference_s'])} s)"
    )
    if quiet:
        print(f"quiet launches only: ratio {result['ratio_quiet_launches']:.3f}")
    if any(m["contended"] for m in launches):
        print(
            "warning: other processes used the CPU during some launches; their numbers are skewed"
        )
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
