"""Keeps sublet's test run out of test/, torch_memory_saver's own tests vendored verbatim:
tests/python/test_compat_tms_upstream.py runs them, in a child, against the installed drop-in."""

collect_ignore = ["test"]
