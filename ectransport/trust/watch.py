"""A :class:`~ectransport.trust.store.TrustStore` fed by files and kept current:
:class:`FileTrust` re-reads the CA public key files and revocation list files when they change,
checked at most every ``reload_s`` (``[trust] revocation_reload_s``, 2 s by default).

Change detection per file: (inode, mtime, size) first, then a SHA-256 of the contents, so a file
rewritten with the same bytes is no change and one rewritten within the same mtime tick with a
new size or inode is. A file that becomes unreadable or invalid keeps what it held before (an
error is logged once per distinct content): a broken copy never widens nor silently narrows
trust; revocations are undone only by a newer signed list. The node loop calls
:meth:`FileTrust.reload_if_changed` and, when it returns True, re-checks its live sessions.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ectransport.settings_schema import TrustSettings
from ectransport.trust.errors import TrustError
from ectransport.trust.files import (
    MAX_CERT_FILE_BYTES,
    MAX_REVOCATIONS_FILE_BYTES,
    parse_ca_public,
    parse_revocations,
    read_bytes,
)
from ectransport.trust.keys import CaPublicKey
from ectransport.trust.policy import TrustPolicy
from ectransport.trust.store import TrustStore

log = logging.getLogger("ectransport.trust")

_Sig = tuple[int, int, int]  # (st_ino, st_mtime_ns, st_size)


class _Watched:
    """One file: its last stat signature, content hash and the last good parse."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sig: _Sig | None = None
        self.digest: bytes | None = None
        self.bad_digest: bytes | None = None
        self.missing_logged = False

    def poll(self, limit: int, what: str) -> bytes | None:
        """The new contents when the file changed since the last poll, else None. Raises
        TrustError when it cannot be read."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise TrustError(f"{what} {self.path} does not exist") from None
        except OSError as e:
            raise TrustError(f"cannot stat {what} {self.path}: {e.strerror or e}") from None
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self.sig:
            return None
        data = read_bytes(self.path, limit, what)
        self.sig = sig
        digest = hashlib.sha256(data).digest()
        if digest == self.digest:
            return None
        self.digest = digest
        return data


class FileTrust:
    """Trusted CAs and revocation lists read from files, reloaded when they change.

    Args:
        ca_files: CA public key files (``[trust] trust_ca``); at least one.
        revocation_files: revocation list files (``[trust] revocation_file``).
        skew_s: clock-skew tolerance, s.
        reload_s: :meth:`reload_if_changed` looks at the files at most this often, s.

    Raises:
        TrustError: at start-up only: no CA file, a file missing, unreadable or invalid, a
            forged revocation list (one of an untrusted CA is ignored). Later changes never
            raise (see module).

    ``store`` is the :class:`TrustStore` to verify with (it is updated in place).
    """

    def __init__(self, ca_files: Sequence[str | os.PathLike[str]],
                 revocation_files: Sequence[str | os.PathLike[str]] = (), *,
                 skew_s: float, reload_s: float) -> None:
        if not ca_files:
            raise TrustError("no CA public key file given ([trust] trust_ca)")
        if not reload_s > 0:
            raise TrustError(f"reload interval must be > 0 s, got {reload_s!r}")
        self.reload_s = float(reload_s)
        self._cas = [_Watched(Path(p)) for p in ca_files]
        self._revs = [_Watched(Path(p)) for p in revocation_files]
        self._ca_keys: dict[Path, list[CaPublicKey]] = {}
        self._rev_blobs: dict[Path, list[bytes]] = {}
        self._next_check = float("-inf")
        for w in self._cas:
            data = w.poll(MAX_CERT_FILE_BYTES, "CA public key file")
            assert data is not None
            self._ca_keys[w.path] = parse_ca_public(_ascii(data, w.path), str(w.path))
        for w in self._revs:
            data = w.poll(MAX_REVOCATIONS_FILE_BYTES, "revocation list file")
            assert data is not None
            self._rev_blobs[w.path] = parse_revocations(_ascii(data, w.path))
        self.store = TrustStore(self._all_cas(), self._all_blobs(), skew_s=skew_s)

    @classmethod
    def from_settings(cls, trust: TrustSettings) -> FileTrust | None:
        """The file trust ``[trust]`` configures, or None when it names no CA file."""
        if not trust.trust_ca:
            return None
        return cls(trust.trust_ca, trust.revocation_file, skew_s=trust.clock_skew_s,
                   reload_s=trust.revocation_reload_s)

    def _all_cas(self) -> list[CaPublicKey]:
        return [k for w in self._cas for k in self._ca_keys.get(w.path, [])]

    def _all_blobs(self) -> list[bytes]:
        return [b for w in self._revs for b in self._rev_blobs.get(w.path, [])]

    def reload_if_changed(self, now: float) -> bool:
        """Re-read what changed, at most every ``reload_s``; ``now`` is a monotonic clock
        reading, s (it only spaces the checks). Returns True when the trusted CAs or a
        revocation list changed: re-check the live sessions
        (:meth:`~ectransport.trust.policy.TrustPolicy.recheck`)."""
        if now < self._next_check:
            return False
        self._next_check = now + self.reload_s
        return self.reload()

    def reload(self) -> bool:
        """Re-read what changed now (e.g. on SIGHUP). Returns as :meth:`reload_if_changed`."""
        cas_changed = False
        for w in self._cas:
            text = self._poll(w, MAX_CERT_FILE_BYTES, "CA public key file")
            if text is None:
                continue
            try:
                keys = parse_ca_public(text, str(w.path))
            except TrustError as e:
                self._bad(w, e)
                continue
            if keys != self._ca_keys.get(w.path):
                self._ca_keys[w.path] = keys
                cas_changed = True
        revs_changed = False
        for w in self._revs:
            text = self._poll(w, MAX_REVOCATIONS_FILE_BYTES, "revocation list file")
            if text is None:
                continue
            try:
                self._rev_blobs[w.path] = parse_revocations(text)
                revs_changed = True
            except TrustError as e:
                self._bad(w, e)
        changed = cas_changed and self.store.set_cas(self._all_cas())
        if changed or revs_changed:
            # every list again: one refused while its CA was not trusted yet may apply now
            got = self.store.update_revocations(self._all_blobs())
            for p in got.problems:
                log.warning("revocation lists: %s", p)
            for p in got.untrusted:
                log.info("revocation lists: %s; ignored", p)
            changed = changed or bool(got.changed)
        if changed:
            log.info("trust reloaded: %d CA(s) trusted, revocation lists of %s",
                     len(self.store.cas),
                     {k: r.seq for k, r in self.store.revocations.items()} or "none")
        return changed

    def _poll(self, w: _Watched, limit: int, what: str) -> str | None:
        try:
            data = w.poll(limit, what)
        except TrustError as e:
            if not w.missing_logged:
                log.error("%s; keeping what it held before", e)
                w.missing_logged = True
            return None
        w.missing_logged = False
        if data is None:
            return None
        try:
            return _ascii(data, w.path)
        except TrustError as e:
            self._bad(w, e)
            return None

    @staticmethod
    def _bad(w: _Watched, e: TrustError) -> None:
        if w.bad_digest != w.digest:
            w.bad_digest = w.digest
            log.error("%s; keeping what %s held before", e, w.path)


def policy_from_settings(trust: TrustSettings, *,
                         allow_list: Callable[[str], bool] | None = None,
                         ) -> tuple[TrustPolicy, FileTrust | None]:
    """The admission policy ``[trust]`` configures, and the file trust feeding it (None when
    ``trust_ca`` is empty: then ``admission`` is ``allow_list``, the schema enforces it).

    The node keeps the :class:`FileTrust` to call :meth:`FileTrust.reload_if_changed` from its
    loop (and ``policy.recheck`` on its live sessions when that returns True, and every
    ``trust.expiry_check_s``). ``allow_list``: see :class:`TrustPolicy`.

    Raises:
        TrustError: a CA or revocation file is missing or invalid (see :class:`FileTrust`).
    """
    files = FileTrust.from_settings(trust)
    policy = TrustPolicy(trust.admission, None if files is None else files.store,
                         allow_list=allow_list)
    return policy, files


def _ascii(data: bytes, path: Path) -> str:
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise TrustError(f"{path} is not a text file of armored blocks") from None
