"""The vLLM connector's fleet-trust keys (``trust_ca``, ``cert_file``, ``revocation_file``,
``admission``): schema settings under public names, and what they change for a consumer — no
``producer_keys`` needed when certificates admit; the announced key is then dialed and its
Welcome's certificate decides."""

from __future__ import annotations

import pytest
import zmq

from ectransport.errors import ConfigError
from ectransport.vllm.settings import parse_settings
from ectransport.vllm.trust import ProducerKeys

SECURE = {"secret_key_file": "/etc/ect/pd-0.key_secret"}
TRUST = {"trust_ca": ["/etc/ect/ca-public.pem"], "cert_file": "/etc/ect/pd-0.cert",
         "revocation_file": "/etc/ect/revocations.pem"}


def _key() -> str:
    return zmq.curve_keypair()[0].decode("ascii")


def test_the_keys_are_the_trust_section():
    s = parse_settings({**SECURE, **TRUST, "admission": "either", "producer_keys": [_key()]},
                       producer=False, consumer=True)
    t = s.common.trust
    assert t.trust_ca == ("/etc/ect/ca-public.pem",) and t.cert_file == "/etc/ect/pd-0.cert"
    assert t.revocation_file == ("/etc/ect/revocations.pem",) and t.admission == "either"


def test_a_certificate_admitting_consumer_needs_no_producer_keys_and_dials_the_announced_one():
    with pytest.raises(ConfigError, match="producer_keys"):
        parse_settings({**SECURE, **TRUST}, producer=False, consumer=True)  # allow_list mode
    s = parse_settings({**SECURE, **TRUST, "admission": "certificate"}, producer=False,
                       consumer=True)
    assert s.trusts_announced_keys
    keys = ProducerKeys(s)
    k = _key()
    assert keys.resolve(k) == (k, "") and keys.listed(k)
    assert keys.resolve(None)[0] is None  # nothing announced: nothing to dial


def test_either_dials_an_unlisted_announced_key_and_lists_only_producer_keys():
    listed = _key()
    s = parse_settings({**SECURE, **TRUST, "admission": "either", "producer_keys": [listed]},
                       producer=False, consumer=True)
    keys = ProducerKeys(s)
    stranger = _key()
    assert keys.resolve(stranger) == (stranger, "")  # its certificate decides
    assert keys.listed(listed) and not keys.listed(stranger)
    plain = parse_settings({**SECURE, "producer_keys": [listed]}, producer=False, consumer=True)
    assert ProducerKeys(plain).resolve(stranger)[0] is None  # no certificates: refused


def test_a_certificate_mode_without_trust_ca_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"\['admission'\].*needs trust_ca"):
        parse_settings({**SECURE, "admission": "certificate"}, producer=True, consumer=False)
