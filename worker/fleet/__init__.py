"""Fleet plumbing: Celery wiring, planning, leases, the embedded Redis, timings and URLs.

Loaded eagerly by a worker like the instrument (so editing it under a running worker
changes nothing), but not fingerprinted: a queueing or recovery fix must not force
a lineage to start over. It may import ``worker.instrument``; the instrument never
imports it. Importing this package loads nothing.
"""
