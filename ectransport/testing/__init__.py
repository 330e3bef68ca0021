"""Test helpers for plane and plugin authors (front-end layer; needs pytest when used).

* :mod:`ectransport.testing.conformance`: ``PlaneConformance``, the conformance suite every data
  plane (built-in or plugin) must pass.
* :mod:`ectransport.testing.helpers`: its helpers on their own (byte patterns, waits with a
  deadline, a producer/consumer :class:`~ectransport.testing.helpers.Pair` of planes).
* :mod:`ectransport.testing.imports`: which ectransport modules a plugin imports (the plugin
  contract allows only :mod:`ectransport.plugin`).
"""
