"""CURVE key files and the client allow-list.

Key files use the zcert text format written by ``zmq.auth.create_certificates`` (``NAME.key`` holds
the public key, ``NAME.key_secret`` both keys), so they interoperate with other ZeroMQ tools. Keys
in memory are 40-character Z85 ``str``.

Errors are :class:`~ectransport.errors.ConfigError` with a one-line message naming the path.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import zmq.auth
from zmq.utils import z85

from ectransport.errors import ConfigError

log = logging.getLogger(__name__)

Z85_KEY_CHARS = 40
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


def is_z85_key(text: str) -> bool:
    """True if ``text`` is a 40-character Z85 string encoding a 32-byte CURVE key."""
    if not isinstance(text, str) or len(text) != Z85_KEY_CHARS:
        return False
    try:
        return len(z85.decode(text)) == 32
    except (ValueError, KeyError, IndexError, TypeError, UnicodeError):
        return False


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise ConfigError(f"key name {name!r} is not a plain file name; use e.g. 'producer-a'")


def generate_keypair(
    out_dir: str | os.PathLike[str], name: str, force: bool = False
) -> tuple[Path, Path]:
    """Write a new CURVE keypair as ``OUT_DIR/NAME.key`` (public) and ``NAME.key_secret``.

    The secret file is created with mode 0600 before any key material is written into it
    (``create_certificates`` itself uses the process umask). Returns ``(public_path,
    secret_path)``. Raises ConfigError if either file exists and ``force`` is false.
    """
    _check_name(name)
    out = Path(out_dir)
    public_path = out / (name + PUBLIC_SUFFIX)
    secret_path = out / (name + SECRET_SUFFIX)
    try:
        out.mkdir(parents=True, exist_ok=True)
        existing = [p for p in (public_path, secret_path) if p.exists()]
        if existing and not force:
            raise ConfigError(
                f"refusing to overwrite existing key file {existing[0]}; "
                "pass force=True (--force) to replace it, or choose another name"
            )
        for p in existing:
            p.unlink()
        # Pre-create the secret file 0600 so the key is never readable by others, not even briefly.
        fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        zmq.auth.create_certificates(out, name)
        os.chmod(secret_path, 0o600)
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError(f"cannot write keypair {name!r} into {out}: {e.strerror or e}") from e
    return public_path, secret_path


def _read_cert(path: Path) -> tuple[str, str | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise ConfigError(f"cannot read key file {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise ConfigError(f"{path} is not a zcert key file (no public-key line)") from e
    pub = public.decode("ascii", "replace")
    if not is_z85_key(pub):
        raise ConfigError(f"{path}: public-key is not a 40-character Z85 CURVE key")
    sec = None if secret is None else secret.decode("ascii", "replace")
    if sec is not None and not is_z85_key(sec):
        raise ConfigError(f"{path}: secret-key is not a 40-character Z85 CURVE key")
    return pub, sec


def load_public(path_or_z85: str | os.PathLike[str]) -> str:
    """Return a Z85 public key given either the key itself (40 chars) or a cert file path.

    A secret cert file is accepted too (its public key is returned).
    """
    if isinstance(path_or_z85, str) and is_z85_key(path_or_z85) and not os.path.exists(path_or_z85):
        return path_or_z85
    path = Path(path_or_z85)
    if not path.exists():
        raise ConfigError(
            f"{str(path_or_z85)!r} is neither a 40-character Z85 public key nor an existing key "
            "file"
        )
    return _read_cert(path)[0]


def secret_file_is_private(path: str | os.PathLike[str]) -> bool:
    """True if no group/other permission bits are set on ``path``."""
    return stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0


def load_keypair(secret_path: str | os.PathLike[str]) -> tuple[str, str]:
    """Load ``(public, secret)`` Z85 keys from a ``.key_secret`` cert file.

    Warns (``logging`` and ``warnings``) if the file is accessible by group or others.
    """
    path = Path(secret_path)
    pub, sec = _read_cert(path)
    if sec is None:
        raise ConfigError(f"{path} holds only a public key; pass the .key_secret file")
    if zmq.curve_public(sec.encode("ascii")).decode("ascii") != pub:
        raise ConfigError(f"{path}: public-key does not match secret-key (corrupt key file)")
    if not secret_file_is_private(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        msg = (
            f"secret key file {path} has mode {mode:04o} (group/world accessible); "
            f"run: chmod 600 {path}"
        )
        log.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=2)
    return pub, sec


_PUBLIC_BANNER = (
    "#   ****  Generated on {now} by ectransport  ****\n"
    "#   ZeroMQ CURVE Public Certificate (client allow-list entry)\n"
    "\n"
)


def allow_key(
    allow_dir: str | os.PathLike[str],
    pubkey_or_file: str | os.PathLike[str],
    name: str | None = None,
) -> Path:
    """Write a public cert ``ALLOW_DIR/NAME.key`` admitting ``pubkey_or_file`` (key or cert file).

    ``name`` defaults to ``client-`` + a hash prefix of the key. The file is written atomically
    (temp file + rename) so a running :class:`AllowList` never reads half a file. Returns its path.
    """
    pub = load_public(pubkey_or_file)
    if name is None:
        name = "client-" + hashlib.sha256(pub.encode("ascii")).hexdigest()[:16]
    _check_name(name)
    d = Path(allow_dir)
    target = d / (name + PUBLIC_SUFFIX)
    text = (
        _PUBLIC_BANNER.format(now=datetime.datetime.now().isoformat(timespec="seconds"))
        + f'metadata\ncurve\n    public-key = "{pub}"\n'
    )
    try:
        d.mkdir(parents=True, exist_ok=True)
        # Temp name must not end in .key, or a concurrent AllowList scan could pick it up.
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".part")
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise ConfigError(f"cannot write allow-list entry {target}: {e.strerror or e}") from e
    return target


class AllowList:
    """Admits CURVE client public keys; used as the ZAP policy of :class:`ZmqControlServer`.

    A key is admitted if it is in ``directory`` (public cert files ``*.key``, zcert format) or
    ``callback(pubkey) -> bool`` returns True. The directory is re-scanned when its listing or any
    file's mtime/size changes, checked at most every ``check_interval_s`` (default 0.5 s) on lookup;
    :meth:`reload` forces a re-scan (e.g. on SIGHUP).

    Fails closed: an unreadable directory contributes no keys (logged as an error); an unreadable or
    malformed file contributes none (logged as a warning); a raising callback admits nobody.
    ``admits`` is thread-safe (it runs in the ZAP authenticator thread).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        callback: Callable[[str], bool] | None = None,
        check_interval_s: float = 0.5,
    ) -> None:
        if directory is None and callback is None:
            raise ConfigError("AllowList needs a directory of public key files and/or a callback")
        self.directory = None if directory is None else Path(directory)
        self.callback = callback
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._keys: frozenset[str] = frozenset()
        self._signature: object = None
        self._last_check = float("-inf")
        if self.directory is not None:
            self.reload()

    @property
    def keys(self) -> frozenset[str]:
        """The keys currently loaded from the directory (not the callback's)."""
        self._maybe_refresh()
        return self._keys

    def reload(self) -> None:
        """Re-scan the directory now (cheap if nothing changed)."""
        if self.directory is None:
            return
        with self._lock:
            self._refresh_locked(force=True)

    def admits(self, pubkey: str) -> bool:
        """True if ``pubkey`` (Z85) is admitted."""
        if self.directory is not None:
            self._maybe_refresh()
            if pubkey in self._keys:
                return True
        if self.callback is not None:
            try:
                return bool(self.callback(pubkey))
            except Exception:
                log.exception("allow-list callback raised for key %s...; denying", pubkey[:8])
                return False
        return False

    # -- internals -------------------------------------------------------------------------
    def _maybe_refresh(self) -> None:
        if self.directory is None:
            return
        with self._lock:
            if time.monotonic() - self._last_check >= self.check_interval_s:
                self._refresh_locked(force=False)

    def _scan_signature(self) -> tuple[tuple[str, int, int], ...]:
        """(name, mtime_ns, size) of every public key file, sorted: a change means a rescan."""
        assert self.directory is not None
        entries: list[tuple[str, int, int]] = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.endswith(PUBLIC_SUFFIX) and not e.name.startswith("."):
                    st = e.stat()
                    entries.append((e.name, st.st_mtime_ns, st.st_size))
        entries.sort()
        return tuple(entries)

    def _refresh_locked(self, force: bool) -> None:
        assert self.directory is not None
        self._last_check = time.monotonic()
        try:
            sig = self._scan_signature()
        except OSError as e:
            if self._keys or self._signature != "error":
                log.error(
                    "allow-list directory %s is unreadable (%s): admitting no keys from it",
                    self.directory,
                    e.strerror or e,
                )
            self._keys = frozenset()
            self._signature = "error"
            return
        if sig == self._signature and not force:
            return
        keys = set()
        for fname, _, _ in sig:
            path = self.directory / fname
            try:
                keys.add(_read_cert(path)[0])
            except ConfigError as e:
                log.warning("allow-list: skipping %s", e)
        self._keys = frozenset(keys)
        self._signature = sig
        log.info("allow-list %s: %d client key(s) loaded", self.directory, len(keys))
