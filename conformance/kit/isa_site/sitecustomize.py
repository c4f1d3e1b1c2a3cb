"""Start-up hook of every process the suite starts in a run forced below AVX-512 (``conformance.kit.isa`` puts this
folder first on ``PYTHONPATH``): vLLM's kernel choice follows ``ATEN_CPU_CAPABILITY`` in servers and their engine
cores as in the test process, so no comparison pits one machine's kernels against another's. Python loads only the
first ``sitecustomize`` on the path, so this one then applies the engine's own start-up hook (``engine.compat``)."""

try:
    from conformance.kit.isa import follow_aten_capability

    follow_aten_capability()
    from engine.compat import torchvision as _tv_compat

    _tv_compat.install()
except Exception as _err:  # a start-up hook must never break the interpreter; say why instead
    import sys

    print(f"conformance.kit.isa sitecustomize: not applied ({_err!r})", file=sys.stderr)
