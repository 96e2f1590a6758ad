"""Helpers the tests share, importable as ``support`` (pytest puts tests/ on ``sys.path`` through
tests/conftest.py, and spawned children inherit that path):

* :mod:`support.daemons`: ``RunningDaemon``, the real serve loop in a thread, and ``daemon_factory``;
* :mod:`support.net`: ``free_port``;
* :mod:`support.waiting`: ``wait_until``, polling a condition with a deadline;
* :mod:`support.procs`: the spawned trainer-rank and reader children of the multi-process tests;
* :mod:`support.oracle`: the scalar, loop-by-loop quantization oracle of SPEC §1.

The quantizers' edge-case table lives in ``sidecar.numerics.cases`` (bench/gpu_check.py runs it too).
"""
