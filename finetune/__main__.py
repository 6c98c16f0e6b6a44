from finetune.preemption import catch_early

if __name__ == "__main__":
    catch_early()  # before torch is imported: a preemption signal in start-up is not fatal

from finetune.cli import entry  # noqa: E402

if __name__ == "__main__":
    entry()
