"""Which producer public key a consumer uses for a fetch named by ``ec_transfer_params``.

``ec_transfer_params`` come from the request (the orchestrator copies them, but an OpenAI client
can send them too), so the address and key they carry are not trusted by themselves: the consumer
connects only to producers whose CURVE key is in its ``producer_keys``. With CURVE, a producer
that does not hold the secret of that key cannot complete the handshake, so a forged address
yields a miss (local compute), never foreign bytes. With fleet trust admitting by certificate
(``admission`` ``certificate`` / ``either``), an announced key outside ``producer_keys`` is
dialed too: the producer's Welcome must then carry a valid producer certificate for it, else
the fetch misses (AUTH).
"""

from __future__ import annotations

import os

from ectransport.control.keys import AllowList, is_z85_key, load_public
from ectransport.vllm.settings import Settings


class ProducerKeys:
    """The trusted producer keys of a consumer (see module docstring).

    Args:
        settings: uses ``producer_keys`` (Z85 keys, ``.key`` files, directories re-read on change,
            or ``"announced"``) and ``insecure``.

    Raises:
        ConfigError: a key file is unreadable or malformed, a directory is unreadable.
    """

    def __init__(self, settings: Settings):
        self.insecure = settings.insecure
        self.announced = settings.trusts_announced_keys
        self.certificates = settings.certificates_admit
        self._static: set[str] = set()
        self._dirs: list[AllowList] = []
        if not self.announced:
            for entry in settings.producer_keys:
                if os.path.isdir(entry):
                    self._dirs.append(AllowList(directory=entry))
                else:
                    self._static.add(load_public(entry))

    def _trusted(self, key: str) -> bool:
        return key in self._static or any(d.admits(key) for d in self._dirs)

    def listed(self, key: str) -> bool:
        """Whether ``key`` is in ``producer_keys`` (fleet trust's allow-list on a consumer;
        with "announced" every key is)."""
        return self.announced or self._trusted(key)

    def resolve(self, announced: object) -> tuple[str | None, str]:
        """``(key, "")`` to connect with, or ``(None, why)`` when the fetch must not happen.

        Args:
            announced: the ``public_key`` of the item's announcement
                (:class:`~ectransport.vllm.announcement.Announcement`: a 40-character string or
                None; still checked here to be a Z85 key, since it comes from the request).
        """
        if self.insecure:
            return None, ""
        if announced is not None and not (isinstance(announced, str) and is_z85_key(announced)):
            return None, "ec_transfer_params carry a public_key that is not a Z85 CURVE key"
        if self.announced:
            if announced is None:
                return None, ("ec_transfer_params carry no public_key "
                              "(producer_keys is \"announced\")")
            return announced, ""
        if announced is not None:
            if self._trusted(announced) or self.certificates:  # else its certificate decides
                return announced, ""
            return None, f"producer key {announced[:8]}... is not in producer_keys"
        keys = set(self._static)
        for d in self._dirs:
            keys |= d.keys
        if len(keys) == 1:
            return next(iter(keys)), ""
        return None, (f"ec_transfer_params carry no public_key and producer_keys holds "
                      f"{len(keys)} keys; cannot tell which producer this is")
