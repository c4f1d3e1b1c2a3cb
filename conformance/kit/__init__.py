"""The suite's kit: what runs it, in this repository or installed into another (``pytest --pyargs conformance``).

``plugin.py`` the pytest plugin (entry point ``pytest11``: options, markers, collection order, summary),
``tiers.py`` the quick tier's rule and workload, ``shards.py`` ``--engine-shard K/N``, ``availability.py`` which
backends can run and ``--engine-require``, ``isa.py`` (with ``isa_site/``) the forced-ISA runs, ``runbook.py`` the GPU
runbook, ``report.py`` the run's report, ``record.py`` its versioned schema, ``matrix.py`` the HTML matrix and the
Markdown summary, ``reaper.py`` the watcher that kills what a dead run left running.
"""
