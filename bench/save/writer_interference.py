"""Background checkpoint writer: thread or process, which interferes less with training on a \
busy CPU?

A small "training" loop runs in this process (a tiny transformers Llama, or an MLP: forward,
backward, Adam step, torch's default threads), timed per step. While it runs, a snapshot of
``--snapshot_mb`` of fp32 tensors (shaped like one rank's ZeRO optimizer shard: fp32 master,
exp_avg, exp_avg_sq) is written, durably and checksummed, by one of these writers:

  none           no write: the reference step time.
  thread         finetune's own --async_save path:
                 ``GuardedWriter.reset(dir, step, background=True)``, ``.save(state, path)``
                 (``host_plan``: the snapshot planned on the training thread, the stall; its
                 tensors copied into host memory by ``run_copies``),
                 ``.start()`` (``Queue`` thread: torch.save into a ``HashingWriter``,
                 sync_file_range kicks, fsync), ``.done()`` polled after each step.
  thread_reused  ``thread`` minus the planned copy: the live tensors are copied into host buffers
                 kept from one save to the next (as the writer's page-locked pool does on a
                 GPU), then ``GuardedWriter``'s own ``Queue`` writes them: tells buffer reuse from
                 thread-vs-process.
  process        a writer process (torch.multiprocessing, spawn) started before the loop, mapping
                 shared-memory buffers made (and pre-faulted) before the loop: a save copies the
                 live tensors into those buffers on the training thread (the stall) and sends the
                 path; the child writes with the very same ``GuardedWriter._write`` (HashingWriter +
                 fsync).
  process_fresh  as ``process`` but no buffers are kept: each save allocates new shared memory,
                 copies into it (the stall) and hands the tensors over a torch.multiprocessing Queue
                 (fds).
  none_1t        ``none`` with torch.set_num_threads(1) for the measured steps: the reference of the
                 _1t rows.
  thread_1t      ``thread`` with torch.set_num_threads(1) on the training side while the write runs.
  process_1t     ``process`` likewise.
  thread_nice    ``thread`` with the writer thread at nice 10 (Linux: setpriority on its thread id).
  process_nice   ``process`` with the child's writing thread at nice 10.

Variants are interleaved (none, thread, process, ..., none, thread, ...) ``--repeats`` times. For
each repeat: ``--pre`` untimed-for-the-write steps (a local baseline), the save (its stall timed
apart), then steps until the write is done; ``none`` runs ``--none_steps`` steps instead. Reported
per variant: median step time of the steps that overlap the write (pooled over repeats), its ratio
to ``none``'s (the _1t rows also to ``none_1t``'s; and the median of ratios to each repeat's own
pre-write steps), the stall, the write's wall time (save issued → file fsynced, taken by the writer
itself), the writer thread's CPU seconds, and the training time lost per save: stall + sum over
overlapping steps of (step - the none median; for _1t rows the none_1t median) ("lost s"; JSON also
has it against none alone and against each repeat's own pre-write steps). The _nice variants run
only on request.

    .venv/bin/python bench/save/writer_interference.py [--repeats 5] [--snapshot_mb 300]
        [--model llama|mlp] [--variants none,thread,process,...] [--dir DIR]
        [--out bench/results/writer_interference.json]
    .venv/bin/python bench/save/writer_interference.py --smoke      # tiny sizes, 1 repeat, < 30 s
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import REPO, machine  # noqa: E402
from finetune.checkpoint.writer import GuardedWriter  # noqa: E402

VARIANTS = (
    "none",
    "thread",
    "thread_reused",
    "process",
    "process_fresh",
    "none_1t",
    "thread_1t",
    "process_1t",
    "thread_nice",
    "process_nice",
)
DEFAULT_VARIANTS = VARIANTS[:8]  # the _nice ones on request: their writes take many times longer
NICE = 10
MB = 1 << 20


# ---------------------------------------------------------------------------------------------
# the snapshot


def make_snapshot(nbytes: int) -> dict:
    """A dict laid out like one rank's ZeRO optimizer file: three flat fp32 tensors + small
    metadata."""
    n = max(1, nbytes // 4 // 3)
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g)
    return {
        "optimizer_state_dict": {
            "zero_stage": 3,
            "loss_scaler": None,
            "partition_count": 1,
            "fp32_flat_groups": [master],
            "optimizer_state_dict": {
                "state": {
                    0: {
                        "step": torch.tensor(10.0),
                        "exp_avg": master * 0.1,
                        "exp_avg_sq": master.square(),
                    }
                },
                "param_groups": [
                    {
                        "lr": 1e-4,
                        "betas": (0.9, 0.999),
                        "eps": 1e-8,
                        "weight_decay": 0.0,
                        "params": [0],
                    }
                ],
            },
        },
        "ds_config": {"train_batch_size": 8},
        "ds_version": "bench",
    }


def tensors(obj) -> list[torch.Tensor]:
    """The tensors of a nested dict/list, in a deterministic order."""
    out: list[torch.Tensor] = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            for k in o:
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return out


def map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def fresh_shared(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor like ``t`` in new shared memory (no copy of t's data yet)."""
    st = torch.UntypedStorage._new_shared(t.numel() * t.element_size())
    return torch.empty(0, dtype=t.dtype).set_(st, 0, t.size(), t.stride())


# ---------------------------------------------------------------------------------------------
# the writers


class TimedWriter(GuardedWriter):
    """finetune's GuardedWriter, unchanged, plus the writer thread's wall and CPU time per file
    (and, for the _nice variants, the writer thread's niceness raised first)."""

    nice = 0

    def _write(self, state_dict, path) -> None:
        if self.nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        t0, c0 = time.monotonic(), time.thread_time()
        super()._write(state_dict, path)
        self.timing = (t0, time.monotonic(), time.thread_time() - c0)


def _child_write(state, path: str, nice: int, out: list) -> None:
    # this thread only (Linux): it ends with the write, so the child's own niceness is unchanged
    if nice:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    t0, c0 = time.monotonic(), time.thread_time()
    w = GuardedWriter(object())
    w.reset(Path(path).parent)
    w._write(state, path)
    size, digest = w.files.get(os.path.basename(path), (0, ""))
    out.append((w.error, size, digest, t0, time.monotonic(), time.thread_time() - c0))


def _child(inbox, conn) -> None:
    """Writer process: waits for ('init', state) / ('write', path, nice) / ('write_fresh', path,
    nice, state) / None.

    Each write runs on a fresh thread of the child (so a nice value dies with it); the main thread
    waits."""
    torch.set_num_threads(1)
    state = None
    conn.send(("ready", time.monotonic()))
    while True:
        msg = inbox.get()
        if msg is None:
            break
        if msg[0] == "init":
            state = msg[1]
            conn.send(("init", time.monotonic()))
            continue
        path, nice = msg[1], msg[2]
        cur = msg[3] if msg[0] == "write_fresh" else state
        out: list = []
        t = threading.Thread(target=_child_write, args=(cur, path, nice, out))
        t.start()
        t.join()
        del cur
        conn.send(("done", *out[0]))


class ProcessWriter:
    def __init__(self, snapshot: dict):
        ctx = mp.get_context("spawn")
        self.inbox = ctx.Queue()
        self.conn, child_conn = ctx.Pipe()
        t0 = time.monotonic()
        self.proc = ctx.Process(target=_child, args=(self.inbox, child_conn), daemon=True)
        self.proc.start()
        self._expect("ready", 120)
        self.spawn_s = time.monotonic() - t0
        t0 = time.monotonic()
        # share_memory_ of the empty clone writes every page once: the buffers are pre-faulted.
        self.shm = map_tensors(snapshot, lambda t: torch.empty_like(t).share_memory_())
        self.shm_alloc_s = time.monotonic() - t0
        t0 = time.monotonic()
        self.inbox.put(("init", self.shm))
        self._expect("init", 120)
        self.handoff_s = time.monotonic() - t0
        self.pairs = list(zip(tensors(snapshot), tensors(self.shm)))
        self.pending = None
        self.fresh = None

    def _expect(self, kind, timeout):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"writer process sent no {kind!r} in {timeout}s")
        msg = self.conn.recv()
        if msg[0] != kind:
            raise RuntimeError(f"writer process: expected {kind!r}, got {msg!r}")
        return msg

    def save_reused(self, path: str, nice: int = 0) -> None:
        for src, dst in self.pairs:
            dst.copy_(src)
        self.inbox.put(("write", path, nice))

    def save_fresh(self, snapshot: dict, path: str) -> None:
        self.fresh = map_tensors(snapshot, lambda t: fresh_shared(t).copy_(t))
        self.inbox.put(("write_fresh", path, 0, self.fresh))

    def done(self) -> bool:
        if self.pending is None and self.conn.poll():
            self.pending = self.conn.recv()
            self.fresh = None
        return self.pending is not None

    def result(self):
        while not self.done():
            time.sleep(0.005)
        msg, self.pending = self.pending, None
        _, error, size, digest, t0, t1, cpu = msg
        if error:
            raise RuntimeError(f"writer process: {error}")
        return size, digest, t0, t1, cpu

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------------------------------------
# the training loop


def make_trainer(kind: str, smoke: bool):
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        if smoke:
            h, layers, bs, seq, vocab = 64, 1, 2, 32, 512
        else:
            h, layers, bs, seq, vocab = 256, 4, 4, 128, 2048  # ~100 ms a step on 2 idle cores
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=h,
            intermediate_size=4 * h,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=seq,
        )
        model = LlamaForCausalLM(cfg)
        x = torch.randint(0, vocab, (bs, seq))

        def loss():
            return model(input_ids=x, labels=x).loss

        desc = f"llama h={h} layers={layers} batch={bs}x{seq} vocab={vocab}"
    else:
        h, layers, bs = (128, 2, 16) if smoke else (1024, 4, 256)
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(h, h), torch.nn.GELU()]
        model = torch.nn.Sequential(*mods, torch.nn.Linear(h, 1))
        x, y = torch.randn(bs, h), torch.randn(bs, 1)

        def loss():
            return torch.nn.functional.mse_loss(model(x), y)

        desc = f"mlp h={h} layers={layers} batch={bs}"
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    nparams = sum(p.numel() for p in model.parameters())

    def step() -> float:
        t = time.perf_counter()
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    return step, f"{desc} params={nparams / 1e6:.2f}M"


# ---------------------------------------------------------------------------------------------


def run_variant(
    variant, step, snapshot, pw, kept, work: Path, rep: int, a, default_threads: int
) -> dict:
    pre = [step() for _ in range(a.pre)]
    rec = {"variant": variant, "repeat": rep, "pre_s": pre}
    if variant.startswith("none"):
        if variant == "none_1t":
            torch.set_num_threads(1)
        try:
            rec["steps_s"] = [step() for _ in range(a.none_steps)]
        finally:
            torch.set_num_threads(default_threads)
        return rec
    path = str(work / f"{variant}-{rep}.pt")
    t_issue = time.monotonic()
    if variant.startswith("thread"):
        w = TimedWriter(object())
        w.nice = NICE if variant == "thread_nice" else 0
        w.reset(work, rep, background=True)
        if variant == "thread_reused":
            for src, dst in kept[1]:
                dst.copy_(src)
            w.queue.add(kept[0], path, sum(t.numel() * t.element_size() for t in tensors(kept[0])))
        else:
            w.save(snapshot, path)  # host_plan on this thread
        stall = time.monotonic() - t_issue
        w.start()
        done = w.done
    elif variant == "process_fresh":
        pw.save_fresh(snapshot, path)
        stall = time.monotonic() - t_issue
        done = pw.done
    else:
        pw.save_reused(path, NICE if variant == "process_nice" else 0)
        stall = time.monotonic() - t_issue
        done = pw.done
    if variant.endswith("_1t"):
        torch.set_num_threads(1)
    steps = []
    deadline = time.monotonic() + a.max_write_s
    try:
        while True:
            steps.append(step())
            if done():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: write not done after {a.max_write_s}s")
    finally:
        torch.set_num_threads(default_threads)
    if variant.startswith("thread"):
        w.join()
        if w.error:
            raise RuntimeError(f"thread writer: {w.error}")
        size, digest = w.files[os.path.basename(path)]
        t0, t1, cpu = w.timing
    else:
        size, digest, t0, t1, cpu = pw.result()
    os.unlink(path)
    rec.update(
        steps_s=steps,
        stall_s=stall,
        write_s=t1 - t_issue,
        write_only_s=t1 - t0,
        writer_cpu_s=cpu,
        bytes=size,
        digest=digest,
    )
    return rec


def summarize(records: list[dict], variants: list[str]) -> dict:
    med = statistics.median
    by = {v: [r for r in records if r["variant"] == v] for v in variants}

    def pooled(v):
        steps = [s for r in by.get(v, []) for s in r["steps_s"]]
        return med(steps) if steps else None

    none_med, none1_med = pooled("none"), pooled("none_1t")
    out = {}
    for v, rs in by.items():
        if not rs:
            continue
        steps = [s for r in rs for s in r["steps_s"]]
        e = {
            "step_ms": med(steps) * 1e3,
            "step_ms_each_repeat": [med(r["steps_s"]) * 1e3 for r in rs],
            "pre_step_ms": med([s for r in rs for s in r["pre_s"]]) * 1e3,
            "steps_measured": len(steps),
            "repeats": len(rs),
        }
        if none_med:
            e["slowdown_vs_none"] = med(steps) / none_med
        e["slowdown_vs_own_pre"] = med([med(r["steps_s"]) / med(r["pre_s"]) for r in rs])
        if v.endswith("_1t") and none1_med:
            e["slowdown_vs_none_1t"] = med(steps) / none1_med
        if not v.startswith("none"):
            e["stall_s"] = med([r["stall_s"] for r in rs])
            e["stall_s_each"] = [r["stall_s"] for r in rs]
            e["write_s"] = med([r["write_s"] for r in rs])
            e["write_s_each"] = [r["write_s"] for r in rs]
            e["write_only_s"] = med([r["write_only_s"] for r in rs])
            e["writer_cpu_s"] = med([r["writer_cpu_s"] for r in rs])
            e["bytes"] = rs[0]["bytes"]
            e["digests"] = sorted({r["digest"] for r in rs})
            e["steps_overlapping_each"] = [len(r["steps_s"]) for r in rs]
            if none_med:
                lost = [r["stall_s"] + sum(s - none_med for s in r["steps_s"]) for r in rs]
                e["lost_s"] = med(lost)
                e["lost_s_each"] = lost
            ref = none1_med if v.endswith("_1t") and none1_med else none_med
            if ref:
                lost_ref = [r["stall_s"] + sum(s - ref for s in r["steps_s"]) for r in rs]
                e["lost_vs_same_threads_none_s"] = med(lost_ref)
                e["lost_vs_same_threads_none_s_each"] = lost_ref
            lost_pre = [r["stall_s"] + sum(s - med(r["pre_s"]) for s in r["steps_s"]) for r in rs]
            e["lost_vs_pre_s"] = med(lost_pre)
            e["lost_vs_pre_s_each"] = lost_pre
        out[v] = e
    return out


def print_table(summary: dict) -> None:
    hdr = (
        f"{'variant':<14}{'step ms':>9}{'vs none':>9}{'vs none_1t':>11}{'stall s':>9}{'write s':>9}"
        f"{'cpu s':>7}{'lost s':>8}{'steps':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for v, e in summary.items():

        def f(key, fmt, e=e):
            width = int(fmt.split(".")[0])
            return format(e[key], fmt) if key in e else "-".rjust(width)

        print(
            f"{v:<14}{f('step_ms', '9.1f')}{f('slowdown_vs_none', '9.3f')}"
            f"{f('slowdown_vs_none_1t', '11.3f')}"
            f"{f('stall_s', '9.3f')}{f('write_s', '9.2f')}{f('writer_cpu_s', '7.2f')}"
            f"{f('lost_vs_same_threads_none_s', '8.2f')}{e['steps_measured']:>7}"
        )
    print(
        "step ms: median of the steps overlapping the write, pooled over repeats; "
        "lost s: stall + sum of (step - median step of none, or of none_1t for _1t rows) "
        "over them, median over repeats"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--snapshot_mb", type=float, default=300)
    ap.add_argument("--model", choices=("llama", "mlp"), default="llama")
    ap.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"any of {','.join(VARIANTS)}"
    )
    ap.add_argument("--pre", type=int, default=3, help="steps before each save (a local baseline)")
    ap.add_argument("--none_steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max_write_s", type=float, default=120)
    ap.add_argument(
        "--dir", default=None, help="where files are written (default: a temp dir under /tmp)"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat (< 30 s)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "writer_interference.json"))
    a = ap.parse_args()
    if a.smoke:
        a.repeats, a.snapshot_mb, a.pre, a.none_steps, a.warmup = 1, 16, 2, 4, 2
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; known: {','.join(VARIANTS)}")

    started = time.time()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="writer-interference-", dir=a.dir))
    default_threads = torch.get_num_threads()
    step, model_desc = make_trainer(a.model, a.smoke)
    snapshot = make_snapshot(int(a.snapshot_mb * MB))
    snap_bytes = sum(t.numel() * t.element_size() for t in tensors(snapshot))
    pw = ProcessWriter(snapshot) if any(v.startswith("process") for v in variants) else None
    kept = None
    if "thread_reused" in variants:  # host buffers kept across saves, pre-faulted
        kept_state = map_tensors(snapshot, lambda t: torch.zeros_like(t))
        kept = (kept_state, list(zip(tensors(snapshot), tensors(kept_state))))
    records: list[dict] = []
    try:
        for _ in range(a.warmup):
            step()
        for rep in range(a.repeats):
            for v in variants:
                r = run_variant(v, step, snapshot, pw, kept, work, rep, a, default_threads)
                records.append(r)
                extra = (
                    f" stall {r['stall_s']:.3f}s write {r['write_s']:.2f}s "
                    f"over {len(r['steps_s'])} steps"
                    if "stall_s" in r
                    else ""
                )
                print(
                    f"[{time.time() - started:6.1f}s] repeat {rep} {v:<14} median step "
                    f"{statistics.median(r['steps_s']) * 1e3:.1f} ms{extra}",
                    flush=True,
                )
    finally:
        if pw is not None:
            pw.close()
        shutil.rmtree(work, ignore_errors=True)

    summary = summarize(records, variants)
    digests = {d for e in summary.values() for d in e.get("digests", [])}
    result = {
        "what": __doc__.splitlines()[0],
        "variants": summary,
        "same_bytes_every_writer": len(digests) <= 1,
        "snapshot_bytes": snap_bytes,
        "repeats": a.repeats,
        "torch_threads": default_threads,
        "machine": machine(),
        "machine_cores": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "model": model_desc,
        "smoke": a.smoke,
        "process_setup_s": (
            {
                "spawn_and_import": pw.spawn_s,
                "shm_alloc_prefault": pw.shm_alloc_s,
                "handoff_to_child": pw.handoff_s,
            }
            if pw is not None
            else None
        ),
        "elapsed_s": time.time() - started,
        "records": records,
    }
    print()
    print(
        f"model {model_desc}; snapshot {snap_bytes / MB:.0f} MiB; torch threads {default_threads}; "
        f"cores {os.cpu_count()}; repeats {a.repeats}; "
        f"load {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print_table(summary)
    if pw is not None:
        print(
            f"process setup (once): spawn+import {pw.spawn_s:.2f}s, "
            f"shm alloc+prefault {pw.shm_alloc_s:.3f}s, "
            f"handoff {pw.handoff_s:.3f}s"
        )
    print(f"same bytes from every writer: {result['same_bytes_every_writer']}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({result['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()
