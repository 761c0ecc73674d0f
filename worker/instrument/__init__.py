"""The trusted instrument: everything between a job arriving and a commit plus observation.

Every module in this folder decides what a generation does or records, and is
fingerprinted by being here (``fingerprint.package_modules``): an edit to any file
in it changes the instrument fingerprint and so the queue it serves, and a lineage
is never continued under different physics. Nothing here imports ``worker.fleet``.
Importing this package loads nothing; import the module you need.
"""
