"""A training run from start to end, the thin entry point ``finetune`` calls: take OUT's lease,
build the trainer, train, write exit_status.json, close; the lease released and the process group
destroyed whatever happens. Returns the process exit code.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from finetune import __version__, run_config
from finetune import distributed as dist
from finetune.build import build_trainer
from finetune.config import ConfigError, RunConfig
from finetune.exit_status import EXIT_LEASE_LOST, clear_exit_status, write_exit_status
from finetune.lease import Lease
from finetune.lease import acquire as acquire_lease
from finetune.preemption import EXIT_PREEMPTED, Preempted, Preemption, parse_signals
from finetune.remote.prefix import Prefix, RemoteUnavailable, open_remote


def run(cfg: RunConfig) -> int:
    """Entry point for a training run; returns the process exit code."""
    # Before anything slow: from here on a preemption signal is recorded, never fatal.
    preemption = Preemption(parse_signals(cfg.ckpt.preempt_signals))
    dist.init(cfg.train.ddp_timeout)
    lease: Lease | None = None
    prefix: Prefix | None = None
    try:
        # One live run per --output_dir, before anything is written there (exit 2 naming the other).
        out = Path(cfg.ckpt.output_dir)
        run_id, created = dist.share_from(0, lambda: (uuid.uuid4().hex[:12], not out.exists()))
        lease = dist.run_agreed(lambda: acquire_lease(out, run_id), on=dist.is_main())
        try:
            # --remote_output_dir: probed on every rank, then one live run per prefix (exit 2)
            if cfg.ckpt.remote_output_dir:
                prefix = open_remote(cfg.ckpt.remote_output_dir, run_id, out)
            # bad input stops here, before anything is written
            trainer = build_trainer(cfg, preemption, run_id, lease, prefix)
        except ConfigError:
            raise  # OUT as it was, a previous run's exit_status.json included
        except Preempted as e:
            # during a long start-up step (a universal conversion): what it did is kept
            return _requeue(cfg, lease, "preempted", e)
        except RemoteUnavailable as e:
            # a restart that waited for the bucket in vain: the job comes back later
            return _requeue(cfg, lease, "remote unavailable", e)
        except BaseException:
            if dist.is_main():  # a crash must not leave a previous run's "75" behind
                clear_exit_status(cfg.ckpt.output_dir)
            raise
        # rank 0's heartbeat's view
        ours = (lambda: not lease.lost) if lease is not None else (lambda: True)
        if dist.is_main() and ours():
            write_exit_status(cfg.ckpt.output_dir, None, {"reason": "running"})
            # what --config reruns
            run_config.write_best_effort(cfg, cfg.ckpt.output_dir, __version__)
        try:
            code = trainer.train()
        except BaseException as e:
            # a crash (DeepSpeed's fp16 minimum-scale Exception, OOM): not "running"
            if dist.is_main() and ours():
                write_exit_status(
                    cfg.ckpt.output_dir,
                    1,
                    {
                        "reason": "failed",
                        "error": dist.describe_error(e),
                        "step": trainer.state.global_step,
                    },
                )
            if ours():
                trainer.close(1)
            raise
        finally:
            trainer.data.close()
        # Collective: the heartbeat may have learned after the last check that another run took
        # OUT over (during the final eval, or in a run that never saves).
        if trainer.out_given_up or dist.any_rank(not ours()):
            # OUT belongs to the run that took the lease over: its exit_status.json, its events,
            # its plot. Nothing of this run's end is written there.
            if not trainer.out_given_up:
                dist.log_main(
                    logging.ERROR,
                    "another run took over %s's lease during the run's last steps; "
                    "stopping without writing anything more there (exit %d)",
                    cfg.ckpt.output_dir,
                    EXIT_LEASE_LOST,
                )
            return EXIT_LEASE_LOST
        if dist.is_main():
            write_exit_status(cfg.ckpt.output_dir, code, trainer.stop_note)
        # Nobody exits before the file is written: under `srun --kill-on-bad-exit` the first rank
        # to exit with 75 gets the others killed, and the file is how job scripts learn about 75.
        dist.barrier()
        # Last, and best-effort: the final plot and the trackers' finish (a wandb upload can take a
        # while) come after the checkpoint and exit_status.json, so a preemption's grace time is
        # never spent on them, and no rank waits for them in a collective.
        trainer.close(code)
        return code
    finally:
        if prefix is not None:
            prefix.release()  # the remote lease, if still this run's
        if lease is not None:
            lease.release()  # removes the lease only if it is still this run's
            if created and dist.is_main() and not lease.lost:
                _remove_if_empty(out)  # bad input: the lease was all this run wrote
        dist.shutdown()


def _requeue(cfg: RunConfig, lease: Lease | None, reason: str, e: Exception) -> int:
    """Start-up stopped for a reason that passes (``reason`` in exit_status.json): exit 75, so the
    job is requeued. Collective."""
    dist.log_main(logging.WARNING, "%s; exiting with %d so the job is requeued", e, EXIT_PREEMPTED)
    if lease is not None and not lease.lost:  # rank 0's
        write_exit_status(
            cfg.ckpt.output_dir,
            EXIT_PREEMPTED,
            {"reason": reason, "step": None, "during": "start-up", "error": str(e)},
        )
    # Nobody exits before the file is written: under `srun --kill-on-bad-exit` it tells 75.
    dist.barrier()
    return EXIT_PREEMPTED


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty: the run wrote something worth keeping
