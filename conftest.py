"""Repository-wide pytest settings."""

# A start-up hook for subprocesses; importing it in the test process would activate the compat shim.
collect_ignore = ["engine/compat/site"]
