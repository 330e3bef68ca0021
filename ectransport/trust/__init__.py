"""Fleet trust: node certificates from a deployment CA instead of pairwise allow-lists.

A deployment CA (an Ed25519 key pair) signs, per node, a small certificate binding the node's
CURVE public key to a role (producer, consumer, both), an instance name and a validity period,
and a revocation list. A node that trusts the CA admits a peer whose certificate — presented in
``Hello.cert`` / ``Welcome.cert`` over the CURVE session — is valid for the connection's CURVE
key and the role wanted: adding a node means issuing it a certificate, removing one means
revoking it, and no allow-list file is touched anywhere.

The pure core, importable by the sans-I/O layers (it imports ``ectransport.protocol``,
``ectransport.errors``, the settings schema, ``msgspec`` and ``cryptography`` only):

* :mod:`~ectransport.trust.wire` — :class:`NodeCert`, :class:`RevocationList`, the sealed
  envelope, :class:`Role`;
* :mod:`~ectransport.trust.keys` — :class:`CaPublicKey`, :class:`CertificateAuthority`;
* :mod:`~ectransport.trust.verify` — :func:`verify` → :class:`Admitted` | :class:`Refused`
  (:class:`RefusalReason`), never raising for any input bytes;
* :mod:`~ectransport.trust.store` — :class:`TrustStore` (CAs + revocation lists, thread-safe);
* :mod:`~ectransport.trust.policy` — :class:`TrustPolicy`: the one call a node makes,
  ``policy.admit(curve_key=, cert=, role_wanted=, now=)``, and ``recheck`` for live sessions.

Files (not imported here; they use the file system): :mod:`ectransport.trust.files` (the CA
directory, certificate and revocation files) and :mod:`ectransport.trust.watch`
(:class:`~ectransport.trust.watch.FileTrust`: a store reloaded when its files change).
Spec: ``protocols/certificates.md``; operators: ``docs/fleet-trust.md``.
"""

from ectransport.trust.errors import TrustError
from ectransport.trust.keys import CaPublicKey, CertificateAuthority, key_id, trusted
from ectransport.trust.policy import AdmissionMode, TrustPolicy
from ectransport.trust.store import RevocationUpdate, TrustStore
from ectransport.trust.verify import (
    DEFAULT_SKEW_S,
    Admitted,
    RefusalReason,
    Refused,
    Revocations,
    check_revocations,
    inspect_cert,
    verify,
)
from ectransport.trust.wire import (
    MAX_CERT_BYTES,
    NodeCert,
    RevocationList,
    Role,
    Sealed,
    is_curve_key,
)

__all__ = [
    "DEFAULT_SKEW_S", "MAX_CERT_BYTES", "AdmissionMode", "Admitted", "CaPublicKey",
    "CertificateAuthority", "NodeCert", "RefusalReason", "Refused", "RevocationList",
    "RevocationUpdate", "Revocations", "Role", "Sealed", "TrustError", "TrustPolicy",
    "TrustStore", "check_revocations", "inspect_cert", "is_curve_key", "key_id", "trusted",
    "verify",
]
