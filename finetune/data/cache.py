"""Tokenized datasets, built once and memory-mapped by every rank after.

The tokenized (and packed) train and eval sets are kept under ``DIR/finetune-tokenized/<key>/``
(DIR: ``--dataset_cache_dir``, default datasets' cache). ``key`` fingerprints everything the
result depends on: the data's bytes (local files) or datasets' own fingerprint of the loaded
splits (hub datasets), the tokenizer's saved files, the data format's name and the values of its
own flags (each format lists them: a new format or flag needs no change here), the length and
split flags, the split seed and the library versions. So a changed tokenizer, flag or file is a
miss, never a stale hit.

The first rank of each group of ranks that see the same DIR builds a missing entry (tokenizing with
several processes) in a temporary folder, fsyncs it and renames it into place: an entry is
complete or absent, never torn, and two builders on shared storage cannot mix their files (the
second rename fails and its copy is dropped). Restarts find the entry and skip tokenization.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import xxhash

from finetune import distributed as dist
from finetune.config import ConfigError, RunConfig
from finetune.data.eval_sets import EvalSet, seeded_subset
from finetune.data.formats import choose
from finetune.data.load import data_files, load_raw, load_splits, nothing_to_learn, tokenize
from finetune.data.packing import pack_sets
from finetune.distributed import logger
from finetune.io.durable import fsync_path, hash_file, write_json_durably
from finetune.io.storage import LocalStorage
from finetune.sharing import leads_storage

CACHE_FORMAT = 3  # bump when what tokenize/pack produce changes for the same inputs
SUBDIR = "finetune-tokenized"
INFO = "info.json"  # written last inside the temporary folder: the entry's contents and provenance
TMP_PREFIX = ".tmp-"
SMALL_DATASET = 20_000  # rows below which one process tokenizes (starting workers costs more)


def cache_root(cfg: RunConfig) -> Path:
    if cfg.data.dataset_cache_dir:
        return Path(cfg.data.dataset_cache_dir) / SUBDIR
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / SUBDIR


def prepare(cfg: RunConfig, tokenizer, what: str = "dataset"):
    """The tokenized (train, eval or None) sets, memory-mapped from the cache. Collective.
    ``what`` names them in the log (a held-out eval set is "eval set NAME": its rows are the
    "train" part of its own entry)."""
    start, root = time.perf_counter(), cache_root(cfg)
    # Rank 0 fingerprints (reads the data files once); everyone needs the key.
    key = dist.share_from(0, lambda: fingerprint(cfg, tokenizer))
    leader = leads_storage(LocalStorage(root), "dataset_cache_dir")
    report = dist.run_agreed(lambda: ensure(cfg, tokenizer, root, key), on=leader)
    train, evalset, info = dist.run_agreed(lambda: load(root / key))
    reports = [r for r in dist.all_gather_object(report) if r is not None]
    built = [r for r in reports if r["built"]]
    how = (
        f"cache miss: tokenized with {built[0]['num_proc']} process(es) "
        f"in {built[0]['seconds']:.1f} s"
        if built
        else "cache hit"
    )
    dist.log_main(
        logging.INFO,
        "%s %s in %s: %s train / %s eval examples; ready in %.1f s",
        what,
        how,
        root / key,
        f"{len(train):,}",
        f"{len(evalset):,}" if evalset is not None else 0,
        time.perf_counter() - start,
    )
    packing = info.get("packing")
    if packing:
        dist.log_main(
            logging.INFO,
            "packing (%s): %s examples into %s blocks of up to %d tokens; efficiency %.1f%% "
            "(real tokens / block tokens)",
            packing["strategy"],
            f"{packing.get('examples', '?'):,}" if "examples" in packing else "all",
            f"{packing['blocks']:,}",
            cfg.data.max_seq_length,
            100 * packing["efficiency"],
        )
    if info["dropped"]:
        dist.log_main(
            logging.WARNING,
            "dropped %d of %d examples with no trainable tokens after truncation",
            info["dropped"],
            info["raw_rows"],
        )
    return train, evalset


def prepare_eval_sets(cfg: RunConfig, tokenizer, sets: list[EvalSet]) -> dict[str | None, Any]:
    """The held-out sets (data/eval_sets.py) by name, each tokenized and cached as a single dataset
    and cut to its seeded subset. Collective; a set with no rows to evaluate is exit 2, named."""
    out = {}
    for s in sets:
        where = f"--eval_datasets set {s.name}" if s.name else "the eval set"
        one = replace(cfg, data=s.args, uses_embedded_data=False)
        try:
            train, evalset = prepare(one, tokenizer, f"held-out {s.described}:")
        except ConfigError as e:  # raised alike on every rank (prepare agrees): name the set
            raise ConfigError(f"{where} ({s.described}): {e}") from None
        ds = evalset if s.from_hub else train
        if ds is None or len(ds) == 0:
            raise ConfigError(
                f"{where} ({s.described}): no rows to evaluate"
                + (" (the dataset has no validation split)" if ds is None else "")
            )
        out[s.name] = seeded_subset(ds, s.args.max_eval_samples, cfg.train.seed)
    return out


# --- the key -------------------------------------------------------------------------------


def fingerprint(cfg: RunConfig, tokenizer) -> str:
    """The cache key: a hash of everything the tokenized sets depend on."""
    import datasets
    import tokenizers
    import transformers

    d = cfg.data
    data_format = choose(d)
    inputs = {
        "format": CACHE_FORMAT,
        "data": _data_identity(cfg),
        "tokenizer": _tokenizer_identity(tokenizer),
        # The chosen format's own flags, whatever they are: the other formats' flags do not matter.
        "data_format": {"name": data_format.name, "flags": data_format.values},
        "flags": {
            k: getattr(d, k)
            for k in (
                "max_seq_length",
                "packing",
                "packing_strategy",
                "validation_split_percentage",
                "max_train_samples",
                "max_eval_samples",
            )
        },
        # The seed only matters where the eval set is split off the training data, or is a subset
        # (--max_eval_samples) drawn with it.
        "split_seed": None
        if (d.validation_file or cfg.uses_embedded_data) and not d.max_eval_samples
        else cfg.train.seed,
        "versions": {
            "datasets": datasets.__version__,
            "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__,
        },
    }
    return xxhash.xxh3_128(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _data_identity(cfg: RunConfig) -> dict:
    d = cfg.data
    if d.dataset_name:
        # Hub (or local-folder) datasets: datasets fingerprints what it loaded (revision, files).
        raw = load_splits(d)
        return {
            "dataset": d.dataset_name,
            "config": d.dataset_config_name,
            "splits": {name: split._fingerprint for name, split in raw.items()},
        }
    files = data_files(d)
    # The bytes, not the path or mtime: a file rewritten in place (or
    # copied with its mtime) is new data.
    return {split: hash_file(path) for split, path in sorted(files.items())}


def _tokenizer_identity(tokenizer) -> str:
    """A hash of the files the tokenizer saves (vocab, merges, special tokens, chat template)."""
    h = xxhash.xxh3_128(type(tokenizer).__name__.encode())
    with tempfile.TemporaryDirectory(prefix="finetune-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                h.update(path.name.encode())
                h.update(path.read_bytes())
    return h.hexdigest()


# --- building an entry ---------------------------------------------------------------------


def ensure(cfg: RunConfig, tokenizer, root: Path, key: str) -> dict:
    """Make ``root/key`` exist (a storage group's leader). Returns what it did, for the log."""
    start = time.perf_counter()

    def fill(tmp: Path) -> dict:
        info = _build(cfg, tokenizer, tmp)
        info["seconds"] = round(time.perf_counter() - start, 3)
        return info

    info = publish(root, root / key, fill)
    if info is None:
        return {"built": False}
    return {"built": True, "seconds": info["seconds"], "num_proc": info["num_proc"]}


def publish(root: Path, entry: Path, fill: Callable[[Path], dict]) -> dict | None:
    """Make ``entry`` (under ``root``) exist, complete or absent, never torn: ``fill`` writes its
    files into a temporary folder of this host and process and returns its info, written last
    (INFO); the folder is fsync'd and renamed into place (a second builder's rename fails and its
    copy is dropped). The info, or None when the entry was there already (also the reference's
    entries: reference.py)."""
    if (entry / INFO).is_file():
        return None
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned(root)
    tmp = root / f"{TMP_PREFIX}{entry.name}-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        info = fill(tmp)
        write_json_durably(tmp / INFO, info)
        _fsync_tree(tmp)
        try:
            os.rename(tmp, entry)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            logger.info("cache: another builder published %s first; using theirs", entry)
        fsync_path(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _build(cfg: RunConfig, tokenizer, tmp: Path) -> dict:
    d, max_len = cfg.data, cfg.data.max_seq_length
    work = tmp / "work"
    work.mkdir(parents=True)
    train_raw, eval_raw = load_raw(d, cfg.train.seed)
    num_proc = workers(d.preprocessing_num_workers, len(train_raw))
    logger.info(
        "dataset cache: tokenizing %s examples with %d process(es) into %s",
        f"{len(train_raw):,}",
        num_proc,
        tmp.parent,
    )
    train = tokenize(train_raw, tokenizer, d, max_len, num_proc, str(work / "train.arrow"))
    if len(train) == 0:
        raise ConfigError(nothing_to_learn(d, tokenizer, train_raw, max_len))
    evalset = (
        tokenize(eval_raw, tokenizer, d, max_len, 1, str(work / "eval.arrow"))
        if eval_raw is not None
        else None
    )
    dropped = (
        len(train_raw) - len(train) + (len(eval_raw) - len(evalset) if eval_raw is not None else 0)
    )
    raw_rows = len(train_raw) + (len(eval_raw) if eval_raw is not None else 0)
    train, evalset, packing = pack_sets(d, train, evalset, str(work))
    train.save_to_disk(str(tmp / "train"))
    if evalset is not None:
        evalset.save_to_disk(str(tmp / "eval"))
    del train, evalset  # they map files in work/
    shutil.rmtree(work)
    return {
        "format": CACHE_FORMAT,
        "num_proc": num_proc,
        "dropped": dropped,
        "raw_rows": raw_rows,
        "has_eval": eval_raw is not None,
        "packing": packing,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def workers(requested: int | None, rows: int) -> int:
    """Tokenizing processes: as asked, else the cores this process may use (one for small data)."""
    if requested:
        return requested
    if rows < SMALL_DATASET:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), 64))


def remove_abandoned(root: Path) -> None:
    """Delete temporary folders of builds on this host whose process is gone (killed mid-build).

    Other hosts' folders are left alone: their builders may be alive. None is ever read.
    """
    host = socket.gethostname()
    for tmp in root.glob(f"{TMP_PREFIX}*-{host}-*"):
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        fsync_path(path)
    fsync_path(folder)


# --- reading an entry ----------------------------------------------------------------------


def load(entry: Path):
    """(train, eval or None, info) memory-mapped from a published entry."""
    import datasets

    info = _read_info(entry)
    try:
        train = datasets.load_from_disk(str(entry / "train"))
        evalset = datasets.load_from_disk(str(entry / "eval")) if info["has_eval"] else None
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--dataset_cache_dir: the cached dataset {entry} is unreadable ({e}); "
            "delete that folder to rebuild it"
        ) from None
    return train, evalset, info


def _read_info(entry: Path) -> dict:
    # On a network filesystem a folder another node just renamed into
    # place may take a moment to show.
    for _attempt in range(20):
        try:
            return json.loads((entry / INFO).read_text())
        except FileNotFoundError:
            time.sleep(0.5)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"--dataset_cache_dir: {entry / INFO} is unreadable ({e}); "
                "delete that folder to rebuild it"
            ) from None
    raise ConfigError(
        f"--dataset_cache_dir: {entry} is missing after it was built; is the folder shared "
        "the same way on every node?"
    )
