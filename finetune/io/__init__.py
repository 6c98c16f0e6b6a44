"""Below everything else: durable writes (durable.py), the named fault sites (faults.py), the test
seams (seams.py) and the progress a deadline watches (progress.py). Nothing here imports another
part of finetune, so any module may import these."""
