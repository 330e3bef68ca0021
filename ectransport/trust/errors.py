"""The error of fleet trust's operator-facing operations (CA files, issuing, revocation lists).

Verifying a peer's certificate never raises: it returns a typed refusal
(:class:`ectransport.trust.verify.Refused`). ``TrustError`` is for what an operator or a caller
got wrong: a missing CA, a wrong passphrase, a revocation list not signed by a trusted CA, a
name that is not allowed in a certificate.
"""

from __future__ import annotations

from ectransport.errors import ConfigError


class TrustError(ConfigError):
    """A CA, certificate or revocation list file (or an argument for one) is unusable; the
    message names the file or value, what was expected and what to do."""
