"""Loading nixl and building its agents: the import (lazy: it takes seconds), what the
installation offers (the UCX plugin, CUDA for VRAM), agents with a progress-thread delay, and the
boundary rule for NIXL's native errors (:func:`quietly`)."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from ectransport.data.base import Capabilities, TransferModel
from ectransport.errors import PlaneUnavailable

INSTALL_HINT = "install it with: pip install 'ectransport[nixl]'"
#: Default pause of NIXL's progress thread between passes, microseconds. NIXL's Python wrapper
#: creates agents with a delay of 0: an idle agent then burns a whole core (measured 1.00 CPU-s/s;
#: 0.04 with 100 us), which on a small host starves everything else. READ latency is unchanged:
#: the READ is driven by the thread that posts it (measured 1.3-1.7 ms p50 either way, 8.8 MiB).
PROGRESS_DELAY_US = 100
_AGENT_CTOR_LOCK = threading.Lock()

_log = logging.getLogger("ectransport.data.nixl")

# NIXL's native errors (nixlNotFoundError, nixlBackendError, ...) derive from Exception directly,
# with no common base, and are only importable once nixl is; the NIXL boundary therefore catches
# Exception (``noqa: BLE001``) and turns it into a DataPlaneError, an ERR state or a debug log.


def quietly(what: str, fn: Any, *args: Any) -> bool:
    """Call ``fn(*args)`` for cleanup; log (debug) instead of raising. True if it succeeded."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - see above
        _log.debug("nixl plane: %s failed: %s", what, exc)
        return False
    return True


class LazyCapabilities:
    """Class attribute computed on first access: VRAM is offered only if CUDA is usable."""

    def __init__(self) -> None:
        self._caps: Capabilities | None = None

    def __get__(self, obj: object, owner: type) -> Capabilities:
        if self._caps is None:
            kinds = {"DRAM"}
            if _cuda_available():
                kinds.add("VRAM")
            self._caps = Capabilities(
                transfer_model=TransferModel.READ,
                mem_kinds=frozenset(kinds),
                max_transfer_bytes=None,
                notifications=True,
            )
        return self._caps


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    if "torch" not in sys.modules and _torch_build() == (None, None):
        return False  # a CPU-only torch build: no VRAM, and no ~2 s torch import to learn it
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken torch install means no VRAM, not a crash
        return False


def _torch_build() -> tuple[str | None, str | None] | None:
    """``(torch.version.cuda, torch.version.hip)`` of the installed torch, read off disk
    (``torch/version.py``) without importing torch; None if torch is absent or that file can't
    be read."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        vspec = importlib.util.spec_from_file_location(
            "_ectransport_torch_version", Path(spec.origin).parent / "version.py")
        if vspec is None or vspec.loader is None:
            return None
        mod = importlib.util.module_from_spec(vspec)
        vspec.loader.exec_module(mod)
    except Exception:  # noqa: BLE001 - unreadable: the caller takes the slow, exact path
        return None
    return getattr(mod, "cuda", None), getattr(mod, "hip", None)


def _import_nixl_meta() -> None:
    """``import nixl``, without the torch import it would do only to learn "no CUDA".

    nixl's meta package picks its backend wheel by CUDA major (``nixl_meta_utils``): from a CUDA
    stack already imported, else torch's build version read off disk, else — a CPU-only torch —
    by importing all of torch (``torch.version.cuda``: the same file, so again None). That import
    is ~2 s of CPU in every fresh process (measured: 2.1 of the 2.6 s a fresh interop consumer
    spent opening its nixl plane; 8 consumers opened one after another made the 8-consumer nixl
    fan-out cell 25-78 s against 1-3 s on tcp). When the answer is known to be None (no torch
    or CUDA stack imported, torch's version file readable and without CUDA) detection is told so
    for the duration of the import; the meta package then picks its backend exactly as it does
    after importing torch (first of nixl_cu13, nixl_cu12, nixl_rocm installed).
    """
    if "nixl" in sys.modules or any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy")):
        import nixl  # noqa: F401
        return
    build = _torch_build()
    if build is None or build[0] is not None:
        import nixl  # noqa: F401 - torch absent (cheap) or a CUDA build (read off disk: cheap)
        return
    try:
        import nixl_meta_utils  # type: ignore[import-untyped]
    except ImportError:  # a nixl without the meta package (e.g. a source build): no detection
        import nixl  # noqa: F401
        return
    with _AGENT_CTOR_LOCK:
        detect = nixl_meta_utils.detect_cuda_major
        nixl_meta_utils.detect_cuda_major = lambda: None
        try:
            import nixl  # noqa: F401
        finally:
            nixl_meta_utils.detect_cuda_major = detect


def _import_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)``; PlaneUnavailable if nixl is missing or broken."""
    try:
        _import_nixl_meta()
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise PlaneUnavailable(f"the nixl data plane needs nixl ({exc}); {INSTALL_HINT}") from exc
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # nixl logs every agent and backend creation at INFO to stdout; keep warnings and errors
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def _ucx_plugin_present() -> bool | None:
    """Whether a NIXL UCX plugin file is found next to the installed wheels (None: can't tell)."""
    dirs = [os.environ["NIXL_PLUGIN_DIR"]] if os.environ.get("NIXL_PLUGIN_DIR") else []
    for mod in ("nixl_cu13", "nixl_cu12", "nixl_rocm"):
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.submodule_search_locations:
            pkg = Path(next(iter(spec.submodule_search_locations)))
            dirs.append(str(pkg.parent / f"{mod}.libs" / "nixl"))
    if not dirs:
        return None  # e.g. a source build with plugins elsewhere
    return any(Path(d, "libplugin_UCX.so").exists() for d in dirs)


def new_agent(nixl_agent: Any, name: str, config: Any, delay_us: int) -> Any:
    """``nixl_agent(name, config)`` with the progress-thread delay set to ``delay_us``
    (microseconds between progress passes; 0 = spin, NIXL's Python default). The benchmark's raw
    NIXL baseline builds its agents with this too, so both sides of an A/B use one agent config.

    The wrapper hard-codes ``pthrDelay = 0`` on the native config it builds; the native agent
    constructor is wrapped for the duration of this call (under a lock) to set it.
    """
    import nixl._api as api

    with _AGENT_CTOR_LOCK:
        native = api.nixlBind.nixlAgent

        def make(agent_name: str, native_config: Any) -> Any:
            native_config.pthrDelay = delay_us
            return native(agent_name, native_config)

        api.nixlBind.nixlAgent = make
        try:
            return nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgent = native

