"""What the suite's checks (and the benchmarks) run against: the subjects.

``pool.py`` the shared engines, ``servers.py`` the shared servers (``python -m engine.serve`` per served config),
``served.py`` the served twins, ``bill.py`` what both started and what it cost, ``target.py`` a server under test
(ours or a foreign one), ``stock.py`` the stock-server launchers (``vllm serve``, llama.cpp's server),
``variants.py`` model variants built at test time, ``example_backend/`` a backend from another package.
"""
