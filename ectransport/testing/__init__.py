"""Test helpers for plane and plugin authors (front-end layer: imports pytest only when used).

* :mod:`ectransport.testing.conformance`: :class:`~ectransport.testing.conformance.PlaneConformance`,
  the conformance suite every data plane (built-in or plugin) must pass.
"""
