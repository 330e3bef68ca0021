"""Test helpers for plane and plugin authors (front-end layer; needs pytest when used).

* :mod:`ectransport.testing.conformance`: ``PlaneConformance``, the conformance suite every data
  plane (built-in or plugin) must pass.
"""
