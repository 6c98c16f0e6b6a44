"""The bucket of ``--remote_output_dir``: everything that opens, copies to, fetches from, leases or
verifies a prefix, over ``io/remote.py``'s S3Storage (the storage backend).

prefix.py   the prefix opened at the start of a run: every rank's probe, rank 0's lease
copy.py     the running job's copy, on a thread per rank, agreed at step boundaries by one
            all-reduce (the Checkpointer sees it through checkpoint's BucketCopy protocol)
lease.py    PREFIX/.lease: one live run per prefix, lease.py's rules on conditional writes
fetch.py    a checkpoint brought down for a resume or an export
verify.py   what ``ls`` and ``verify`` read of a prefix, with no download

The offline tools import fetch and verify, never copy or prefix.
"""
