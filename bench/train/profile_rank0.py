"""cProfile rank 0 of a multi-rank run, for looking into where a training step's time goes.

    deepspeed --num_gpus 2 bench/train/profile_rank0.py --stats /tmp/ft.prof --module finetune \
[finetune flags]
    deepspeed --num_gpus 2 bench/train/profile_rank0.py --stats /tmp/hf.prof \
        bench/train/hf_trainer_run.py \
[its flags]
    python -c "import pstats; pstats.Stats('/tmp/ft.prof').sort_stats('cumulative').print_stats(40)"

Every rank runs the target; rank 0 (``RANK``) writes the stats. The DeepSpeed launcher's
``--local_rank=N`` is passed through to the target.
"""

from __future__ import annotations

import cProfile
import os
import runpy
import sys


def main() -> None:
    argv = sys.argv[1:]
    local_rank = [a for a in argv if a.startswith("--local_rank")]
    argv = [a for a in argv if not a.startswith("--local_rank")]
    if len(argv) < 3 or argv[0] != "--stats":
        sys.exit(__doc__)
    stats, target, rest = argv[1], argv[2], argv[3:]
    if target == "--module":
        module, rest = rest[0], rest[1:]
        sys.argv = [module, *local_rank, *rest]
        run = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv = [target, *local_rank, *rest]
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    prof = cProfile.Profile()

    def dump() -> None:
        prof.disable()
        if os.environ.get("RANK", "0") == "0":
            prof.dump_stats(stats)

    # Both targets end with os._exit (no interpreter teardown): write the stats first.
    real_exit = os._exit

    def exit_after_dump(status: int) -> None:
        dump()
        real_exit(status)

    os._exit = exit_after_dump
    code = 0
    prof.enable()
    try:
        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    dump()
    sys.exit(code)


if __name__ == "__main__":
    main()
