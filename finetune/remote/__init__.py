"""The bucket of ``--remote_output_dir``: everything that copies to, fetches from, leases or
verifies a prefix, over ``io/remote.py``'s S3Storage (the storage backend).

copy.py     the running job's copy (the Checkpointer sees it through checkpoint's BucketCopy
            protocol); lease.py  PREFIX/.lease, one live run per prefix; fetch.py  a checkpoint
            brought down for a resume or an export; verify.py  what ``ls``/``verify`` read of a
            prefix. Offline tools import fetch and verify, never copy.
"""
